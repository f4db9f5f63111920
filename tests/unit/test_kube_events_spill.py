"""The event a container gets when it spills GPU memory to host memory."""

import datetime as dt

import pytest

from vgpu_agent.kube.events import (
    REASON_MEMORY_SPILLED,
    PodRef,
    SpilledDevice,
    pod_event,
    spill_message,
)

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
U0 = "GPU-00000000-0000-0000-0000-000000000000"


def test_the_message_says_how_much_on_which_gpu_and_what_it_costs():
    text = spill_message("main", [SpilledDevice(U0, 3, 3 << 29, 40 << 30),
                                  SpilledDevice("GPU-gone", None, 1 << 19, 1 << 30)])
    assert text.startswith("container main went past the GPU's physical memory: ")
    assert f"1536.0 MiB on GPU 3 ({U0}) (limit 40960 MiB)" in text
    assert "0.5 MiB on GPU-gone (limit 1024 MiB)" in text
    assert "charged to the container's memory limit" in text and "slower" in text


def test_a_long_message_is_cut_to_what_the_api_accepts():
    many = [SpilledDevice(U0 + str(i), i, 1 << 30, 1 << 31) for i in range(40)]
    assert len(spill_message("c" * 300, many)) == 1024


def test_a_spill_event_is_a_normal_event_on_the_pod():
    body = pod_event(PodRef("ml", "trainer", "uid-1"), REASON_MEMORY_SPILLED, "x", "node-a", NOW,
                     7, "Normal")
    assert (body["type"], body["reason"]) == ("Normal", "VgpuMemorySpilled")
    assert body["involvedObject"]["uid"] == "uid-1"
    assert pod_event(PodRef("ml", "p", "u"), "R", "x", "n", NOW, 1)["type"] == "Warning"


def test_an_event_type_the_api_does_not_know_is_refused():
    with pytest.raises(ValueError, match="'Error' is not allowed: Normal or Warning"):
        pod_event(PodRef("ml", "p", "u"), "R", "x", "n", NOW, 1, "Error")

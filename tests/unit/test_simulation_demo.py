"""The demo's choices that need no agent: settings it refuses, the host PIDs it gives simulated
processes, and what it serves as NVML's view when there is nothing to simulate."""

from __future__ import annotations

import itertools

import pytest
from structlog.testing import capture_logs

from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.shm import layout
from vgpu_agent.simulation.demo import DemoWorkloads, run_demo_workloads
from vgpu_agent.simulation.shimfile import host_pid_candidates


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"report_every_s": 0}, "report_every_s"), ({"tick_s": -1}, "tick_s"),
     ({"duration_s": 0}, "duration_s")],
)
async def test_bad_demo_settings_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be > 0"):
        await run_demo_workloads(list, **kwargs)


def fake_proc(tmp_path, pid_max, running=()):
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    if pid_max is not None:
        (tmp_path / "sys" / "kernel" / "pid_max").write_text(f"{pid_max}\n")
    for pid in running:
        (tmp_path / str(pid)).mkdir()
    return str(tmp_path)


def test_host_pids_start_where_the_kernel_never_hands_one_out(tmp_path):
    root = fake_proc(tmp_path, 32768, running=(32768,))  # not a real pid: above pid_max
    assert list(itertools.islice(host_pid_candidates(root), 3)) == [32768, 32769, 32770]


def test_without_room_above_pid_max_the_highest_unused_pids_are_taken(tmp_path):
    top = layout.PID_MAX - 1
    root = fake_proc(tmp_path, layout.PID_MAX, running=(top, top - 2))
    assert list(itertools.islice(host_pid_candidates(root), 3)) == [top - 1, top - 3, top - 4]


@pytest.mark.parametrize("content", [None, "many\n"])
def test_an_unreadable_pid_max_counts_as_the_largest(tmp_path, content):
    root = fake_proc(tmp_path, None, running=(layout.PID_MAX - 1,))
    if content is not None:
        (tmp_path / "sys" / "kernel" / "pid_max").write_text(content)
    assert next(host_pid_candidates(root)) == layout.PID_MAX - 2


def test_every_candidate_is_a_pid_the_region_abi_accepts(tmp_path):
    root = fake_proc(tmp_path, layout.PID_MAX - 5)
    pids = list(itertools.islice(host_pids := host_pid_candidates(root), 10))
    assert pids[:5] == list(range(layout.PID_MAX - 5, layout.PID_MAX))
    assert all(0 < p < layout.PID_MAX for p in pids)
    assert pids[5] == layout.PID_MAX - 6  # then downwards from below pid_max
    assert next(host_pids) not in pids


def test_the_demo_serves_samples_through_the_agents_backend_and_withdraws_them():
    backend = SimBackend("1xA100-80GB")
    backend.start()
    installed = []
    original = backend.set_sample_source

    def record(source):
        installed.append(source)
        original(source)

    backend.set_sample_source = record
    with capture_logs():
        demo = DemoWorkloads(list, backend, clock=lambda: 5_000_000_000)
        demo.step()
    assert installed == [demo.samples]
    assert backend.process_utilization(backend.uuids[0], 0) == []  # no allocation, no process
    demo.close()
    assert installed == [demo.samples, None]


def test_without_a_backend_the_demo_says_what_the_agent_will_not_see():
    with capture_logs() as logs:
        DemoWorkloads(list)
    assert [e["event"] for e in logs] == ["demo_without_backend"]


def test_an_unreadable_allocation_list_is_logged_and_the_demo_goes_on():
    calls = {"n": 0}

    def regions():
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("state dir gone")
        return []

    with capture_logs() as logs:
        demo = DemoWorkloads(regions)
        demo.step()
        demo.step()
    assert calls["n"] == 2
    assert [e["event"] for e in logs].count("demo_regions_unavailable") == 1

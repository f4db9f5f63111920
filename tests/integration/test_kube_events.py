"""GPU health changes become Kubernetes Events on the node."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from pathlib import Path

import pytest

from tests.fakes.kubeapi import NODE, Change, wired
from vgpu_agent.kube.events import NodeRef, health_event, health_message

UUID = "GPU-00000001-0000-0000-0000-000000000000"


def test_message_names_uuid_xid_and_error() -> None:
    assert (
        health_message(Change(UUID, False, "XID critical error", 79))
        == f"GPU {UUID} is unhealthy: XID 79: XID critical error"
    )
    assert health_message(Change(UUID, True, "no errors for 300s")) == (
        f"GPU {UUID} is healthy again: no errors for 300s"
    )
    assert len(health_message(Change(UUID, False, "x" * 5000))) == 1024


def test_event_body_refers_to_the_node() -> None:
    now = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
    body = health_event(Change(UUID, False, "lost", None), NodeRef("n1", "uid-1"), "ns", now, 7)
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n1",
        "uid": "uid-1",
    }
    assert body["type"] == "Warning" and body["reason"] == "GpuUnhealthy"
    assert body["metadata"]["namespace"] == "ns"
    assert body["metadata"]["name"].startswith("n1.") and body["metadata"]["name"].endswith(".7")
    assert body["firstTimestamp"] == "2026-05-01T12:00:00Z"
    with pytest.raises(ValueError, match="time zone"):
        health_event(Change(UUID, True), NodeRef("n1", "u"), "ns", dt.datetime(2026, 1, 1), 0)


async def test_unhealthy_and_recovered_become_events(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.node.on_health_change(Change(UUID, False, "XID critical error", 79))
        w.node.on_health_change(Change(UUID, True, "no errors for 300s", None))
        await w.api.wait_for(lambda: len(w.api.all_events()) == 2)

        node_uid = w.api.nodes[NODE]["metadata"]["uid"]
        down, up = sorted(w.api.events["vgpu-system"].values(), key=lambda e: e["metadata"]["name"])
        assert down["type"] == "Warning" and down["reason"] == "GpuUnhealthy"
        assert UUID in down["message"] and "XID 79" in down["message"]
        assert up["type"] == "Normal" and up["reason"] == "GpuHealthy"
        for event in (down, up):
            assert event["involvedObject"]["uid"] == node_uid
            assert event["involvedObject"]["kind"] == "Node"
            assert event["source"] == {"component": "vgpu-agent", "host": NODE}


async def test_events_keep_their_order_and_time_of_report(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.fail(503, times=3, method="POST")
        for n in range(5):
            w.node.on_health_change(Change(UUID, n % 2 == 1, f"step {n}", 79))
        await w.api.wait_for(lambda: len(w.api.all_events()) == 5)
        posts = [r.body["message"] for r in w.api.requests if r.status == 201]
        assert [m.rsplit(": ", 1)[1] for m in posts] == [f"step {n}" for n in range(5)]


async def test_health_change_from_another_thread(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        await asyncio.sleep(0)  # let run() start and remember its loop
        thread = threading.Thread(
            target=w.node.on_health_change, args=(Change(UUID, False, "lost", None),)
        )
        thread.start()
        thread.join()
        await w.api.wait_for(lambda: len(w.api.all_events()) == 1)


async def test_lost_answer_retry_does_not_duplicate_event(tmp_path: Path) -> None:
    async with wired(tmp_path, request_timeout=0.2) as w:
        # The server creates the event but the answer arrives after the client gave up.
        w.api.stall(0.5, method="POST", handled=True)
        w.node.on_health_change(Change(UUID, False, "lost", None))
        await w.api.wait_for(
            lambda: [r.status for r in w.api.requests if r.method == "POST"] == [201, 409],
            within=5,
        )
        assert len(w.api.all_events()) == 1
        await asyncio.sleep(0.1)
        assert w.node.queued_events == 0


async def test_rejected_event_is_dropped_and_later_ones_still_sent(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.fail(422, method="POST")
        w.node.on_health_change(Change(UUID, False, "first", None))
        w.node.on_health_change(Change(UUID, True, "second", None))
        await w.api.wait_for(lambda: len(w.api.all_events()) == 1)
        (event,) = w.api.all_events()
        assert event["message"].endswith("second")


async def test_event_storm_is_paced_by_the_token_bucket(tmp_path: Path) -> None:
    # two at once, then one per 400 ms: slow enough that a loaded machine's scheduling delays
    # (tens of ms) cannot be mistaken for pacing, nor hide the burst
    async with wired(tmp_path, events_per_second=2.5, event_burst=2) as w:
        for n in range(6):
            w.node.on_health_change(Change(UUID, n % 2 == 1, f"flap {n}", 79))
        await w.api.wait_for(lambda: len(w.api.all_events()) == 6, within=10)
        posts = [r.at for r in w.api.requests if r.method == "POST"]
        assert posts[1] - posts[0] < 0.2  # the burst: not paced
        assert posts[-1] - posts[0] >= 4 / 2.5 * 0.9  # four paced at 400 ms


async def test_the_health_monitors_change_objects_are_accepted(tmp_path: Path) -> None:
    from vgpu_agent.gpu.healthstate import HealthChange

    async with wired(tmp_path) as w:
        w.node.on_health_change(HealthChange(UUID, False, "XID critical error", 48))
        await w.api.wait_for(lambda: len(w.api.all_events()) == 1)
        (event,) = w.api.all_events()
        assert "XID 48" in event["message"] and UUID in event["message"]

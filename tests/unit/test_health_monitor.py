"""HealthMonitor over the simulated backend: XIDs and failing checks reach subscribers,
recovery happens, and the waiter thread stops when the monitor is cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.model import GpuError, XidEvent
from vgpu_agent.gpu.sim import SimBackend

IGNORED = frozenset({13, 31, 43, 45, 68, 109})


@pytest.fixture
def backend():
    b = SimBackend("2xA100-80GB")
    b.start()
    yield b
    b.shutdown()


async def running(monitor: HealthMonitor) -> asyncio.Task[None]:
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.05)  # let the waiter thread start
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def waiter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpu-xid-waiter"]


async def test_critical_xid_reaches_subscribers_fast(backend):
    # checks every 30 s: the change can only come through the XID waiter thread
    monitor = HealthMonitor(backend, backend.discover().gpus, IGNORED, 60.0, 30.0)
    changes = monitor.subscribe()
    task = await running(monitor)
    uuid = backend.uuids[1]
    begin = time.monotonic()
    backend.inject_xid(uuid, 79)
    change = await asyncio.wait_for(changes.get(), 2.0)
    assert time.monotonic() - begin < 0.5
    assert (change.uuid, change.healthy, change.xid) == (uuid, False, 79)
    assert monitor.healthy() == {backend.uuids[0]: True, uuid: False}
    assert monitor.xid_counts[uuid] == 1
    await stop(task)


async def test_ignored_xid_changes_nothing(backend):
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 60.0, 0.05)
    changes = monitor.subscribe()
    task = await running(monitor)
    backend.inject_xid(backend.uuids[0], 43)
    backend.inject_xid(backend.uuids[0], 79)  # a marker that must arrive first
    change = await asyncio.wait_for(changes.get(), 2.0)
    assert change.xid == 79
    assert monitor.xid_counts[backend.uuids[0]] == 1
    await stop(task)


async def test_lost_gpu_turns_unhealthy_and_recovers(backend):
    uuid = backend.uuids[0]
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 0.2, check_interval_s=0.02)
    changes = monitor.subscribe()
    task = await running(monitor)
    backend.set_lost(uuid)
    lost = await asyncio.wait_for(changes.get(), 2.0)
    assert not lost.healthy and "GPU is lost" in lost.reason
    backend.set_lost(uuid, False)
    back = await asyncio.wait_for(changes.get(), 2.0)
    assert back.healthy and back.uuid == uuid
    assert monitor.healthy()[uuid]
    await stop(task)


async def test_no_recovery_when_disabled(backend):
    uuid = backend.uuids[0]
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 0.0, check_interval_s=0.01)
    task = await running(monitor)
    backend.inject_xid(uuid, 79)
    await asyncio.sleep(0.3)
    assert monitor.healthy()[uuid] is False
    await stop(task)


async def test_xids_for_unwatched_gpus_are_dropped(backend):
    watched, other = backend.uuids
    monitor = HealthMonitor(backend, [watched], IGNORED, 60.0, 0.05)
    changes = monitor.subscribe()
    task = await running(monitor)
    backend.inject_xid(other, 79)
    backend.inject_xid(watched, 79)
    change = await asyncio.wait_for(changes.get(), 2.0)
    assert change.uuid == watched
    assert other not in monitor.healthy()
    await stop(task)


async def test_cancel_stops_the_waiter_thread(backend):
    before = len(waiter_threads())
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 60.0, 0.05)
    task = await running(monitor)
    assert len(waiter_threads()) == before + 1
    await stop(task)
    assert len(waiter_threads()) == before


class FlakyWaits(SimBackend):
    """wait_xid fails a few times (as a broken event set would), then works."""

    def __init__(self, failures: int):
        super().__init__("1xA100-80GB")
        self.failures = failures
        self.calls = 0

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise GpuError("nvmlEventSetWait failed: Unknown Error", call="nvmlEventSetWait")
        return super().wait_xid(timeout_ms)


async def test_failed_waits_are_retried_with_backoff():
    backend = FlakyWaits(failures=2)
    backend.start()
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 60.0, 0.05)
    changes = monitor.subscribe()
    task = await running(monitor)
    await asyncio.sleep(0.4)  # backoff 0.1 s then 0.2 s
    backend.inject_xid(backend.uuids[0], 79)
    change = await asyncio.wait_for(changes.get(), 2.0)
    assert change.xid == 79
    assert monitor.wait_errors == 2
    assert backend.calls < 20  # backed off, did not spin
    await stop(task)


async def test_listeners_are_called_and_a_failing_listener_hurts_no_one(backend):
    monitor = HealthMonitor(backend, backend.uuids, IGNORED, 60.0, 0.05)
    seen = []

    def broken(change):
        raise RuntimeError("listener bug")

    monitor.add_listener(broken)
    monitor.add_listener(seen.append)
    queue = monitor.subscribe()
    task = await running(monitor)
    backend.inject_xid(backend.uuids[0], 79)
    await asyncio.wait_for(queue.get(), 2.0)
    assert [c.xid for c in seen] == [79]
    await stop(task)


def test_rejects_a_non_positive_check_interval(backend):
    with pytest.raises(ValueError, match="check interval"):
        HealthMonitor(backend, backend.uuids, IGNORED, 60.0, 0)

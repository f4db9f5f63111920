"""Watches GPU health: XID events from a waiter thread plus periodic NVML queries.

The decisions live in the pure `HealthTracker`; this module only feeds it. One daemon thread
blocks in `backend.wait_xid` and hands each event to the event loop with `call_soon_threadsafe`
(so an XID reaches subscribers within milliseconds); every `check_interval_s` all GPUs are queried
in one worker thread. Subscribers get every `HealthChange` on their own queue.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from vgpu_agent.gpu.healthstate import HealthChange, HealthTracker
from vgpu_agent.gpu.model import GpuBackend, GpuError, GpuInfo, XidEvent

__all__ = ["HealthChange", "HealthMonitor", "HealthTracker"]

log = structlog.get_logger(__name__)

MAX_WAIT_BACKOFF_S = 5.0


class HealthMonitor:
    def __init__(
        self,
        backend: GpuBackend,
        gpus: Iterable[GpuInfo | str],
        ignored_xids: frozenset[int],
        recovery_period_s: float,
        check_interval_s: float = 1.0,
        *,
        xid_wait_ms: int = 500,  # an XID ends the wait at once; the timeout only paces stopping
        clock: Callable[[], float] = time.monotonic,
    ):
        if check_interval_s <= 0:
            raise ValueError(f"check interval {check_interval_s!r} s must be > 0")
        self.backend = backend
        self.uuids = [g.uuid if isinstance(g, GpuInfo) else g for g in gpus]
        self.tracker = HealthTracker(ignored_xids, recovery_period_s)
        for uuid in self.uuids:
            self.tracker.track(uuid)
        self.check_interval_s = check_interval_s
        self.xid_wait_ms = xid_wait_ms
        self.wait_errors = 0  # failed wait_xid calls, for the metrics
        self._known = set(self.uuids)
        self._clock = clock
        self._queues: list[asyncio.Queue[HealthChange]] = []
        self._listeners: list[Callable[[HealthChange], None]] = []

    # ---- what others read --------------------------------------------------------------------

    def healthy(self) -> dict[str, bool]:
        return self.tracker.healthy()

    @property
    def xid_counts(self) -> dict[str, int]:
        return self.tracker.xid_counts()

    def reason(self, uuid: str) -> str:
        return self.tracker.reason(uuid)

    def subscribe(self) -> asyncio.Queue[HealthChange]:
        """A queue that receives every health change from now on."""
        queue: asyncio.Queue[HealthChange] = asyncio.Queue()
        self._queues.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[HealthChange]) -> None:
        if queue in self._queues:
            self._queues.remove(queue)

    def add_listener(self, callback: Callable[[HealthChange], None]) -> None:
        """Call `callback(change)` on the event loop for every health change."""
        self._listeners.append(callback)

    # ---- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch until cancelled; the waiter thread is stopped and joined on the way out."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        exited = asyncio.Event()
        waiter = threading.Thread(
            target=self._wait_loop, args=(loop, stop, exited), name="gpu-xid-waiter", daemon=True
        )
        waiter.start()
        log.info("health_monitor_started", gpus=len(self.uuids), interval_s=self.check_interval_s)
        try:
            while True:
                await self.check_now()
                await asyncio.sleep(self.check_interval_s)
        finally:
            stop.set()
            # the thread leaves within one wait_xid timeout; wait for it without blocking the loop
            try:
                await asyncio.wait_for(exited.wait(), 2 * self.xid_wait_ms / 1000 + 1.0)
            except TimeoutError:
                log.warning("xid_waiter_still_running", timeout_ms=self.xid_wait_ms)
            else:
                # its last act was posting `exited`: only the thread's own teardown is left
                waiter.join(0.1)

    async def check_now(self) -> list[HealthChange]:
        """Query every GPU once (in a worker thread) and apply the results."""
        results = await asyncio.to_thread(self._check_all)
        changes: list[HealthChange] = []
        now = self._clock()
        for uuid, ok, error in results:
            changes += self.tracker.on_check(uuid, ok, error, now)
        self._publish(changes)
        return changes

    def _check_all(self) -> list[tuple[str, bool, str | None]]:
        results: list[tuple[str, bool, str | None]] = []
        for uuid in self.uuids:
            try:
                self.backend.check(uuid)
                results.append((uuid, True, None))
            except GpuError as err:
                results.append((uuid, False, str(err)))
            except Exception as err:  # a bug in a backend must not stop health checking
                log.exception("gpu_check_crashed", uuid=uuid)
                results.append((uuid, False, repr(err)))
        return results

    def _wait_loop(
        self, loop: asyncio.AbstractEventLoop, stop: threading.Event, exited: asyncio.Event
    ) -> None:
        try:
            self._wait_until_stopped(loop, stop)
        finally:
            self._post(loop, lambda _: exited.set(), None)

    def _wait_until_stopped(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        backoff = 0.1
        while not stop.is_set():
            try:
                event = self.backend.wait_xid(self.xid_wait_ms)
            except Exception as err:
                self.wait_errors += 1
                log.warning(
                    "xid_wait_failed",
                    error=str(err),
                    call=getattr(err, "call", ""),
                    retry_in_s=backoff,
                )
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_WAIT_BACKOFF_S)
                continue
            backoff = 0.1
            if event is not None and not self._post(loop, self._on_xid, event):
                return

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], arg: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True

    def _on_xid(self, event: XidEvent) -> None:
        if event.uuid not in self._known:
            log.info("xid_on_unwatched_gpu", uuid=event.uuid, xid=event.xid)
            return
        ignored = event.xid in self.tracker.ignored_xids
        emit = log.info if ignored else log.warning
        emit("gpu_xid", uuid=event.uuid, xid=event.xid, ignored=ignored)
        self._publish(self.tracker.on_xid(event.uuid, event.xid, self._clock()))

    def _publish(self, changes: list[HealthChange]) -> None:
        for change in changes:
            emit = log.info if change.healthy else log.warning
            emit(
                "gpu_health",
                uuid=change.uuid,
                healthy=change.healthy,
                reason=change.reason,
                xid=change.xid,
            )
            for queue in self._queues:
                queue.put_nowait(change)
            for callback in self._listeners:
                try:
                    callback(change)
                except Exception:
                    log.exception("health_listener_failed", uuid=change.uuid)

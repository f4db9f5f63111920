"""Runs the backstop (`backstop.py`): every `interval_s`, NVML's per-process memory and the
controller's measured SM share of each container, judged against its limits.

NVML's process list and the host evidence are read, and every container judged, in a worker
thread (the loop only reports what was found); processes are attributed
by an `Attributor` of the watch's own (the controller's keeps per-tick state). A breach is
counted, logged and handed to `on_breach` (the agent reports it on the pod, and may evict).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import structlog

from vgpu_agent.shm.api import RegionHandle, RegionUsage
from vgpu_agent.throttle.backstop import Backstop, BackstopParams, Breach, Key
from vgpu_agent.throttle.identity import Attributor

log = structlog.get_logger(__name__)

# A round every 2 s: a breach is found within 2 s rather than 1 (the backstop reports or evicts
# after the fact either way), and the SM window's average is judged on 15 samples instead of
# 30. At 144 busy devices, rounds every 2 s rather than every second save the settled agent a
# fifth of a point of a core (BENCHMARKS.md).
ROUND_S = 2.0


class ProcessSource(Protocol):
    def running_processes(self, uuid: str) -> list[tuple[int, int | None]]: ...


class StatusLike(Protocol):
    @property
    def limit(self) -> float: ...

    @property
    def policy(self) -> str: ...

    @property
    def measured_util(self) -> float | None: ...


# (used bytes, processes) per container device; None where NVML could not say
_Memory = dict[Key, tuple[int, int] | None]


class BackstopWatch:
    def __init__(
        self,
        backend: ProcessSource,
        regions: Callable[[], Iterable[RegionHandle]],
        status: Callable[[], Mapping[tuple[str, int], StatusLike]],
        attributor: Attributor,
        on_breach: Callable[[Breach], None] | None = None,
        *,
        interval_s: float = ROUND_S,
        params: BackstopParams | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not interval_s > 0:
            raise ValueError(f"backstop interval must be > 0 s, got {interval_s!r}")
        self.backend = backend
        self.regions = regions
        self.status = status
        self.attributor = attributor
        self.on_breach = on_breach
        self.interval_s = interval_s
        self.backstop = Backstop(params)
        self.clock = clock
        self.breaches: dict[str, int] = {"memory": 0, "sm": 0}
        self.nvml_errors = 0

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the watch must outlive anything one round throws
                log.exception("backstop_round_failed")
            await asyncio.sleep(self.interval_s)

    async def check(self) -> list[Breach]:
        regions = list(self.regions())
        status = self.status()  # taken on the loop, where the controller changes it
        # NVML's process lists and the judgement of every container device run in a worker
        # thread: on the loop they would hold Allocate and scrapes up for milliseconds at 144.
        # No containers, no NVML to read: an idle agent does not wake a worker thread.
        if regions:
            found = await asyncio.to_thread(self._round, regions, status)
        else:
            self.attributor.forget_except(set(), ())  # what `_memory` would have forgotten
            found = self._judge(regions, {}, status)
        for breach in found:
            self.breaches[breach.kind] += 1
            log.warning("backstop_breach", alloc_id=breach.alloc_id, dev=breach.dev,
                        kind=breach.kind, measured=round(breach.measured, 1),
                        allowed=round(breach.allowed, 1), detail=breach.describe())
            if self.on_breach is not None:
                try:
                    self.on_breach(breach)
                except Exception:
                    log.exception("backstop_breach_handler_failed", alloc_id=breach.alloc_id)
        return found

    def _round(
        self, regions: list[RegionHandle], status: Mapping[tuple[str, int], StatusLike]
    ) -> list[Breach]:
        return self._judge(regions, self._memory(regions), status)

    def _judge(
        self,
        regions: list[RegionHandle],
        memory: _Memory,
        status: Mapping[tuple[str, int], StatusLike],
    ) -> list[Breach]:
        """Every container device against its limits; only this watch's own round runs it."""
        found: list[Breach] = []
        keys: list[Key] = []
        for region in regions:
            for dev in range(len(region.device_uuids)):
                key = (region.alloc_id, dev)
                keys.append(key)
                reading = memory.get(key)
                if reading is not None:
                    breach = self.backstop.memory(key, reading[0], reading[1],
                                                  int(region.memory_limit(dev)))
                    if breach is not None:
                        found.append(breach)
        now = self.clock()
        for key, s in status.items():
            breach = self.backstop.sm(key, now, s.measured_util, s.limit, s.policy == "strict")
            if breach is not None:
                found.append(breach)
        self.backstop.forget_except(keys)
        return found

    def _memory(self, regions: list[RegionHandle]) -> _Memory:
        """In the worker thread: per container device, what its processes hold per NVML."""
        by_uuid: dict[str, list[tuple[RegionHandle, int]]] = defaultdict(list)
        for region in regions:
            for dev, uuid in enumerate(region.device_uuids):
                by_uuid[uuid].append((region, dev))
        out: _Memory = {}
        live: set[int] = set()
        for uuid, devices in by_uuid.items():
            try:
                procs = self.backend.running_processes(uuid)
            except Exception as err:
                self.nvml_errors += 1
                log.warning("backstop_nvml_failed", uuid=uuid, error=str(err))
                continue
            live.update(pid for pid, _ in procs)
            owners = self.attributor.owners(((r, RegionUsage()) for r, _ in devices),
                                            [pid for pid, _ in procs])
            used: dict[str, list[int]] = defaultdict(list)
            unknown: set[str] = set()
            for pid, mem in procs:
                alloc_id = owners.get(pid)
                if alloc_id is None:
                    continue
                if mem is None:
                    unknown.add(alloc_id)  # NVML cannot say (some vGPU/MIG setups)
                else:
                    used[alloc_id].append(mem)
            for region, dev in devices:
                alloc_id = region.alloc_id
                if alloc_id in unknown:
                    out[(alloc_id, dev)] = None
                else:
                    values = used.get(alloc_id, [])
                    out[(alloc_id, dev)] = (sum(values), len(values))
        self.attributor.forget_except(live, (r.alloc_id for r in regions))
        return out

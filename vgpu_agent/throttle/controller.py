"""The core-throttle loop: every tick, measure each container on each GPU and write its token rate.

Per tick and physical GPU: NVML per-process SM samples since the last tick, host PIDs mapped to
regions through the shim's process slots (falling back to the PID's cgroup), tokens spent and
time waited from the regions' usage; `control.control_step` turns these into rates, written with
`set_rate` where they changed. Every region's heartbeat is refreshed every tick. A failing
region or GPU is logged and counted; the loop goes on.

Where a GPU cannot report per-process utilization (NVML_ERROR_NOT_SUPPORTED) the law runs open
loop: it sees no utilization, so rates stay at the bound derived from what each container spent
while unthrottled (never above the limit, possibly below it). That is logged once per GPU and
exposed in `open_loop_gpus`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from vgpu_agent.gpu.model import GpuError, ProcessSample
from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy, RegionHandle, RegionUsage
from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    ControlParams,
    Decision,
    LoopState,
    Observation,
    control_step,
)

log = structlog.get_logger(__name__)

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED


class UtilizationSource(Protocol):
    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]: ...


class PidResolver(Protocol):
    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None:
        """The alloc_id of host `pid`, given the host PIDs already known per allocation."""


class CgroupPidResolver:
    """Assigns an unknown host PID to the allocation whose known processes share its cgroup.

    The shim cannot always learn its host PID (no access to the host's PID namespace); a sibling
    process that did tells us which container cgroup is the allocation's.
    """

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root

    def cgroup_of(self, pid: int) -> str | None:
        try:
            with open(os.path.join(self.proc_root, str(pid), "cgroup"), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError):
            return None
        # cgroup v2 has one "0::<path>" line; with v1, any controller's path names the container.
        paths = sorted(line.split(":", 2)[2] for line in lines if line.count(":") >= 2)
        paths = [p for p in paths if p not in ("", "/")]
        return "\n".join(paths) or None

    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None:
        wanted = self.cgroup_of(pid)
        if wanted is None:
            return None
        for other, alloc_id in known.items():
            if self.cgroup_of(other) == wanted:
                return alloc_id
        return None


class NamespacePidResolver:
    """Maps a host PID to the allocation whose shim slot holds the same process.

    Inside a container the shim sees only its own pid namespace, so its slots carry the
    in-container pid and the process start time, rarely the host pid. The host's /proc tells,
    for a host pid, the pid in its innermost namespace (last `NSpid` field) and the same start
    time (`stat` field 22): the pair names the slot. Needs the host's /proc (hostPID, or the
    host's /proc mounted and `proc_root` pointing at it).
    """

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self._seen: dict[int, tuple[int, int] | None] = {}

    def identity(self, host_pid: int) -> tuple[int, int] | None:
        """(pid in its innermost namespace, start time) of a host pid, None if unreadable."""
        if host_pid in self._seen:
            return self._seen[host_pid]
        found: tuple[int, int] | None = None
        base = os.path.join(self.proc_root, str(host_pid))
        try:
            with open(os.path.join(base, "status"), encoding="utf-8") as f:
                nspid = next((ln for ln in f if ln.startswith("NSpid:")), "")
            with open(os.path.join(base, "stat"), encoding="utf-8") as f:
                stat = f.read()
            inner = int(nspid.split()[-1])
            # the command name (field 2) may hold spaces: count fields after its ')'
            start = int(stat.rsplit(")", 1)[1].split()[19])
            found = (inner, start)
        except (OSError, ValueError, IndexError, StopIteration, UnicodeDecodeError):
            found = None
        self._seen[host_pid] = found
        return found

    def forget_except(self, live: Iterable[int]) -> None:
        """Drop cached pids that stopped appearing in samples (their numbers may be reused)."""
        keep = set(live)
        self._seen = {pid: v for pid, v in self._seen.items() if pid in keep}

    def resolve(self, host_pid: int, slots: Mapping[tuple[int, int], str]) -> str | None:
        ident = self.identity(host_pid)
        return slots.get(ident) if ident is not None else None


@dataclass(frozen=True)
class DeviceStatus:
    """What the controller last decided for one device of one allocation (for metrics)."""

    alloc_id: str
    dev: int
    uuid: str
    limit: float
    policy: CorePolicy
    target: float
    measured_util: float | None
    rate: int
    burst: int
    rate_limited: bool
    open_loop: bool


@dataclass
class _Counters:
    previous: tuple[int, int, int] | None = None  # tokens spent, launches, wait ns (cumulative)


class ThrottleController:
    def __init__(
        self,
        backend: UtilizationSource,
        regions: Callable[[], Iterable[RegionHandle]],
        tick_s: float = 0.1,
        default_policy: CorePolicy = "work-conserving",
        pid_resolver: PidResolver | None = None,
        proc_root: str = "/proc",
        params: ControlParams | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ):
        if not tick_s > 0:
            raise ValueError(f"tick must be > 0 s, got {tick_s!r}")
        if default_policy not in CORE_POLICIES:
            raise ValueError(f"default core policy must be one of {CORE_POLICIES}, got "
                             f"{default_policy!r}")
        self.backend = backend
        self.regions = regions
        self.tick_s = tick_s
        self.default_policy: CorePolicy = default_policy
        self.pid_resolver: PidResolver = pid_resolver or CgroupPidResolver(proc_root)
        self.ns_resolver = NamespacePidResolver(proc_root)
        self._sampled_pids: set[int] = set()
        self.params = params or ControlParams(spend_window_s=max(0.4, 4 * tick_s))
        self.clock = clock
        self.ticks = 0
        self.errors: dict[str, int] = defaultdict(int)
        self._states: dict[str, dict[str, LoopState]] = {}  # uuid -> key -> state
        self._counters: dict[str, _Counters] = {}  # key -> cumulative counters
        self._since_us: dict[str, int] = {}
        self._open_loop: set[str] = set()
        self._status: dict[tuple[str, int], DeviceStatus] = {}
        self._last_tick_ns: int | None = None

    # -- read-only views for metrics ---------------------------------------------------------
    @property
    def status(self) -> Mapping[tuple[str, int], DeviceStatus]:
        """Per (alloc_id, region device index): the last decision."""
        return dict(self._status)

    @property
    def open_loop_gpus(self) -> frozenset[str]:
        return frozenset(self._open_loop)

    @property
    def error_counts(self) -> Mapping[str, int]:
        return dict(self.errors)

    def _failed(self, kind: str, event: str, **context: object) -> None:
        """Count a failure; the first of each kind is logged with its traceback, later ones
        without (a broken region fails every tick, and its log should not drown the rest)."""
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            log.exception(event, **context)
        else:
            log.warning(event, failures=self.errors[kind], **context)

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick until cancelled; a slow tick shortens the next sleep rather than drifting."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.tick()
            except Exception:  # the loop must survive anything one tick throws
                self._failed("tick", "throttle_tick_failed")
            next_at = max(next_at + self.tick_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def tick(self) -> None:
        now_ns = self.clock()
        dt_s = self.tick_s if self._last_tick_ns is None else (now_ns - self._last_tick_ns) / 1e9
        self._last_tick_ns = now_ns
        self.ticks += 1
        try:
            regions = list(self.regions())
        except Exception:
            self._failed("list_regions", "throttle_list_regions_failed")
            return
        # Reading `state` files is file I/O (a pread per region): keep it off the event loop.
        by_gpu = await asyncio.to_thread(self._gather, regions)
        for uuid, entries in by_gpu.items():
            samples = await self._samples(uuid)
            try:
                self._steer_gpu(uuid, entries, samples, max(dt_s, 1e-3))
            except Exception:
                self._failed("gpu", "throttle_gpu_failed", uuid=uuid)
        for region in regions:
            try:
                region.beat(now_ns)
            except Exception:
                self._failed("beat", "throttle_beat_failed", alloc_id=_alloc_id(region))
        self._forget(by_gpu)
        if self._sampled_pids:  # ticks without new samples say nothing about who is alive
            self.ns_resolver.forget_except(self._sampled_pids)
            self._sampled_pids = set()

    def _gather(
        self, regions: list[RegionHandle]
    ) -> dict[str, list[tuple[RegionHandle, int, RegionUsage]]]:
        by_gpu: dict[str, list[tuple[RegionHandle, int, RegionUsage]]] = defaultdict(list)
        for region in regions:
            try:
                usage = region.usage()
                uuids = region.device_uuids
            except Exception:
                self._failed(
                    "region_usage", "throttle_region_unreadable", alloc_id=_alloc_id(region)
                )
                continue
            if usage.corrupt:
                self.errors["region_corrupt"] += 1
                continue
            for dev, uuid in enumerate(uuids):
                by_gpu[uuid].append((region, dev, usage))
        return by_gpu

    async def _samples(self, uuid: str) -> list[ProcessSample] | None:
        since = self._since_us.get(uuid, 0)
        try:
            samples = await asyncio.to_thread(self.backend.process_utilization, uuid, since)
        except GpuError as e:
            if e.code == NVML_ERROR_NOT_SUPPORTED:
                if uuid not in self._open_loop:
                    self._open_loop.add(uuid)
                    log.warning("throttle_open_loop", uuid=uuid,
                                reason="no per-process utilization on this GPU")
            else:
                self.errors["nvml"] += 1
                log.warning("throttle_nvml_failed", uuid=uuid, call=e.call, code=e.code,
                            error=str(e))
            return None
        except Exception:
            self._failed("nvml", "throttle_nvml_failed", uuid=uuid)
            return None
        if samples:
            self._since_us[uuid] = max(since, *(s.timestamp_us for s in samples))
        return samples

    def _utilization(
        self,
        entries: list[tuple[RegionHandle, int, RegionUsage]],
        samples: list[ProcessSample] | None,
    ) -> dict[str, float] | None:
        """SM percent per alloc_id from this tick's samples; None when nothing new arrived."""
        if not samples:
            return None
        known: dict[int, str] = {}
        slots: dict[tuple[int, int], str] = {}
        for region, _, usage in entries:
            for proc in usage.processes:
                if proc.host_pid > 0:
                    known[proc.host_pid] = region.alloc_id
                if proc.start_time > 0:
                    slots[(proc.pid, proc.start_time)] = region.alloc_id
        per_pid: dict[int, list[int]] = defaultdict(list)
        for s in samples:
            per_pid[s.pid].append(s.sm_util)
        self._sampled_pids.update(per_pid)
        util = {region.alloc_id: 0.0 for region, _, _ in entries}
        for pid, values in per_pid.items():
            alloc_id = known.get(pid)
            if alloc_id is None and slots:
                alloc_id = self.ns_resolver.resolve(pid, slots)
            if alloc_id is None:
                try:
                    alloc_id = self.pid_resolver(pid, known)
                except Exception:
                    self._failed("pid_resolver", "throttle_pid_resolver_failed", pid=pid)
                    alloc_id = None
            if alloc_id in util:
                util[alloc_id] += min(100.0, max(0.0, sum(values) / len(values)))
        return util

    def _observe(
        self, key: str, region: RegionHandle, dev: int, usage: RegionUsage, dt_s: float,
        util: float | None,
    ) -> Observation:
        spent_now = usage.tokens_spent[dev] if dev < len(usage.tokens_spent) else 0
        launches_now = sum(p.launches[dev] for p in usage.processes if dev < len(p.launches))
        wait_now = sum(p.wait_ns[dev] for p in usage.processes if dev < len(p.wait_ns))
        counters = self._counters.setdefault(key, _Counters())
        now = (spent_now, launches_now, wait_now)
        deltas = [0, 0, 0]  # first sight (or agent restart): only a baseline
        if counters.previous is not None:
            # Totals drop when the shim reclaims a dead process's slot: count nothing then.
            deltas = [max(0, a - b) for a, b in zip(now, counters.previous, strict=True)]
        counters.previous = now
        rate, burst = region.rate(dev)
        if rate == 0 and burst == 0:
            rate = burst = UNLIMITED_RATE  # never configured: the shim does not throttle
        policy = region.policy(dev)
        if policy not in CORE_POLICIES:
            policy = self.default_policy
        return Observation(
            key=key,
            limit=min(100.0, max(1e-6, float(region.core_limit(dev)))),
            policy=policy,
            priority=region.priority,
            spent=deltas[0],
            launches=deltas[1],
            waited_s=deltas[2] / 1e9,
            util=util,
            rate=rate,
            burst=burst,
        )

    def _steer_gpu(
        self,
        uuid: str,
        entries: list[tuple[RegionHandle, int, RegionUsage]],
        samples: list[ProcessSample] | None,
        dt_s: float,
    ) -> None:
        utils = self._utilization(entries, samples)
        observations: list[Observation] = []
        handles: dict[str, tuple[RegionHandle, int]] = {}
        for region, dev, usage in entries:
            key = f"{region.alloc_id}/{dev}"
            try:
                obs = self._observe(key, region, dev, usage, dt_s,
                                    None if utils is None else utils[region.alloc_id])
            except Exception:
                self._failed(
                    "region_read", "throttle_region_read_failed", alloc_id=region.alloc_id, dev=dev
                )
                continue
            observations.append(obs)
            handles[key] = (region, dev)
        states = self._states.setdefault(uuid, {})
        decisions = control_step(observations, states, dt_s, self.params)
        self._states[uuid] = {key: d.state for key, d in decisions.items()}
        for obs in observations:
            region, dev = handles[obs.key]
            self._apply(uuid, region, dev, obs, decisions[obs.key])

    def _apply(self, uuid: str, region: RegionHandle, dev: int, obs: Observation,
               decision: Decision) -> None:
        try:
            if region.rate(dev) != (decision.rate, decision.burst):
                region.set_rate(dev, decision.rate, decision.burst)
        except Exception:
            self._failed("set_rate", "throttle_set_rate_failed", alloc_id=region.alloc_id, dev=dev)
        self._status[(region.alloc_id, dev)] = DeviceStatus(
            alloc_id=region.alloc_id,
            dev=dev,
            uuid=uuid,
            limit=obs.limit,
            policy=obs.policy,
            target=decision.target,
            measured_util=decision.state.util,
            rate=decision.rate,
            burst=decision.burst,
            rate_limited=decision.hungry,
            open_loop=uuid in self._open_loop,
        )

    def _forget(self, by_gpu: Mapping[str, list[tuple[RegionHandle, int, RegionUsage]]]) -> None:
        live = {
            f"{region.alloc_id}/{dev}" for entries in by_gpu.values() for region, dev, _ in entries
        }
        for uuid in list(self._states):
            if uuid not in by_gpu:
                del self._states[uuid]
        self._counters = {k: v for k, v in self._counters.items() if k in live}
        self._status = {k: v for k, v in self._status.items() if f"{k[0]}/{k[1]}" in live}


def _alloc_id(region: RegionHandle) -> str:
    try:
        return region.alloc_id
    except Exception:
        return "?"

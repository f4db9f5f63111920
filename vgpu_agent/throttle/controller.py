"""The core-throttle loop: every tick, measure each container on each GPU and write its token rate.

Per tick and physical GPU: NVML per-process SM samples since the last tick, host PIDs attributed
to regions on host evidence (`identity.Attributor`: what the shim's slots claim is only checked,
never believed; a cgroup sibling of a proven process is the fallback), tokens spent and
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
from vgpu_agent.throttle.attribution import HostEvidence
from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    ControlParams,
    Decision,
    LoopState,
    Observation,
    control_step,
)
from vgpu_agent.throttle.identity import Attributor, ProcEvidence

log = structlog.get_logger(__name__)

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED


class UtilizationSource(Protocol):
    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]: ...


class PidResolver(Protocol):
    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None:
        """The alloc_id of host `pid`, given the host PIDs the host proved per allocation."""


class CgroupPidResolver:
    """Assigns a host PID the host could not show to the allocation whose proven processes
    share its cgroup: a sibling whose mount table proved its container tells which container
    cgroup is the allocation's (`known` holds only proven pids, never claimed ones).
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
    priority: int = 0


class _Device:
    """One device of one allocation as the loop follows it from tick to tick.

    Its identity and limits are read once (only the agent writes them, when it creates the
    region); the counters are the cumulative totals of the previous tick.
    """

    __slots__ = ("alloc_id", "dev", "key", "last", "limits", "previous", "region", "seen", "uuid")

    def __init__(self, region: RegionHandle, dev: int, alloc_id: str, uuid: str,
                 previous: tuple[int, int, int] | None):
        self.region = region
        self.dev = dev
        self.key = f"{alloc_id}/{dev}"
        self.alloc_id = alloc_id
        self.uuid = uuid
        self.limits: tuple[float, CorePolicy, int] | None = None  # limit, policy, priority
        self.previous = previous  # tokens spent, launches, wait ns (cumulative)
        # the last decision, kept raw: `DeviceStatus` is built only when someone asks
        self.last: tuple[Observation, Decision, bool] | None = None
        self.seen = 0  # the tick that last read the device


# Per GPU: the devices on it with their region's usage, in region order.
_Entries = list[tuple[_Device, RegionUsage]]
# What the worker thread read: entries per GPU, and per GPU the samples or what prevented them.
_Reading = tuple[dict[str, _Entries], dict[str, list[ProcessSample] | BaseException]]


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
        evidence: HostEvidence | None = None,
        container_region_dir: str = "/run/vgpu",
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
        self.attributor = Attributor(
            evidence or ProcEvidence(proc_root, container_region_dir),
            self.ns_resolver,
            fallback=self.pid_resolver,
            on_error=self._resolver_failed,
        )
        self._sampled_pids: set[int] = set()
        self.params = params or ControlParams(spend_window_s=max(0.4, 4 * tick_s))
        self.clock = clock
        self.ticks = 0
        self.errors: dict[str, int] = defaultdict(int)
        self._states: dict[str, dict[str, LoopState]] = {}  # uuid -> key -> state
        self._devices: dict[str, _Device] = {}  # key -> device followed
        # id(region) -> (region, its devices): the region is held so that its id stays its own
        self._by_region: dict[int, tuple[RegionHandle, list[_Device]]] = {}
        self._since_us: dict[str, int] = {}
        self._open_loop: set[str] = set()
        self._last_tick_ns: int | None = None

    # -- read-only views for metrics ---------------------------------------------------------
    @property
    def status(self) -> Mapping[tuple[str, int], DeviceStatus]:
        """Per (alloc_id, region device index): the last decision."""
        out: dict[tuple[str, int], DeviceStatus] = {}
        for d in list(self._devices.values()):
            if d.last is None:
                continue
            obs, decision, open_loop = d.last
            out[(d.alloc_id, d.dev)] = DeviceStatus(
                alloc_id=d.alloc_id,
                dev=d.dev,
                uuid=d.uuid,
                limit=obs.limit,
                policy=obs.policy,
                target=decision.target,
                measured_util=decision.state.util,
                rate=decision.rate,
                burst=decision.burst,
                rate_limited=decision.hungry,
                open_loop=open_loop,
                priority=obs.priority,
            )
        return out

    @property
    def open_loop_gpus(self) -> frozenset[str]:
        return frozenset(self._open_loop)

    @property
    def error_counts(self) -> Mapping[str, int]:
        return dict(self.errors)

    def _failed(
        self, kind: str, event: str, error: BaseException | None = None, **context: object
    ) -> None:
        """Count a failure; the first of each kind is logged with its traceback, later ones
        without (a broken region fails every tick, and its log should not drown the rest).
        `error` is the exception when it was caught elsewhere (in the worker thread)."""
        self.errors[kind] += 1
        if self.errors[kind] == 1:
            if error is None:
                log.exception(event, **context)
            else:
                log.error(event, exc_info=error, **context)
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
        # Reading `state` files (a pread per region) and NVML are blocking: both go to one
        # worker thread per tick, as one hop costs less than one per GPU.
        by_gpu, sampled = await asyncio.to_thread(self._read, regions)
        # A region collected while the worker read it is closed now: skipped, not an error.
        regions = [r for r in regions if not getattr(r, "closed", False)]
        for uuid, entries in by_gpu.items():
            entries[:] = [e for e in entries if not getattr(e[0].region, "closed", False)]
            samples = self._samples(uuid, sampled[uuid])
            try:
                self._steer_gpu(uuid, entries, samples, max(dt_s, 1e-3))
            except Exception:
                self._failed("gpu", "throttle_gpu_failed", uuid=uuid)
        for region in regions:
            try:
                region.beat(now_ns)
            except Exception:
                self._failed("beat", "throttle_beat_failed", alloc_id=_alloc_id(region))
        self._forget(regions, by_gpu)
        if self._sampled_pids:  # ticks without new samples say nothing about who is alive
            self.ns_resolver.forget_except(self._sampled_pids)
            self.attributor.end_tick(self._sampled_pids, regions)
            self._sampled_pids = set()

    def _read(self, regions: list[RegionHandle]) -> _Reading:
        """In the worker thread: every region's usage, then every GPU's new samples."""
        by_gpu = self._gather(regions)
        sampled: dict[str, list[ProcessSample] | BaseException] = {}
        for uuid in by_gpu:
            try:
                sampled[uuid] = self.backend.process_utilization(uuid, self._since_us.get(uuid, 0))
            except Exception as e:  # judged on the event loop, with the others
                sampled[uuid] = e
        return by_gpu, sampled

    def _gather(self, regions: list[RegionHandle]) -> dict[str, _Entries]:
        by_gpu: dict[str, _Entries] = defaultdict(list)
        tick = self.ticks
        for region in regions:
            if getattr(region, "closed", False):
                continue
            try:
                usage = region.usage()
                devices = self._devices_of(region)
            except Exception:
                self._failed(
                    "region_usage", "throttle_region_unreadable", alloc_id=_alloc_id(region)
                )
                continue
            if usage.corrupt:
                self.errors["region_corrupt"] += 1
                continue
            for device in devices:
                device.seen = tick
                by_gpu[device.uuid].append((device, usage))
        return by_gpu

    def _devices_of(self, region: RegionHandle) -> list[_Device]:
        """The region's devices, looked up once per region object."""
        known = self._by_region.get(id(region))
        if known is not None and known[0] is region:
            return known[1]
        alloc_id = region.alloc_id
        devices = []
        for dev, uuid in enumerate(region.device_uuids):
            before = self._devices.get(f"{alloc_id}/{dev}")
            # The same allocation reopened keeps its counters (the totals did not restart).
            device = _Device(region, dev, alloc_id, uuid,
                             before.previous if before is not None else None)
            if before is not None:
                device.last = before.last
            devices.append(device)
        for device in devices:
            self._devices[device.key] = device
        self._by_region[id(region)] = (region, devices)
        return devices

    def _samples(
        self, uuid: str, outcome: list[ProcessSample] | BaseException
    ) -> list[ProcessSample] | None:
        """This tick's samples of one GPU, None when NVML gave none; failures counted."""
        if isinstance(outcome, GpuError):
            if outcome.code == NVML_ERROR_NOT_SUPPORTED:
                if uuid not in self._open_loop:
                    self._open_loop.add(uuid)
                    log.warning("throttle_open_loop", uuid=uuid,
                                reason="no per-process utilization on this GPU")
            else:
                self.errors["nvml"] += 1
                log.warning("throttle_nvml_failed", uuid=uuid, call=outcome.call,
                            code=outcome.code, error=str(outcome))
            return None
        if isinstance(outcome, BaseException):
            self._failed("nvml", "throttle_nvml_failed", error=outcome, uuid=uuid)
            return None
        if outcome:
            since = self._since_us.get(uuid, 0)
            self._since_us[uuid] = max(since, *(s.timestamp_us for s in outcome))
        return outcome

    def _utilization(
        self, entries: _Entries, samples: list[ProcessSample] | None
    ) -> dict[str, float] | None:
        """SM percent per alloc_id from this tick's samples; None when nothing new arrived."""
        if not samples:
            return None
        util = {device.alloc_id: 0.0 for device, _ in entries}
        per_pid: dict[int, list[int]] = defaultdict(list)
        for s in samples:
            per_pid[s.pid].append(s.sm_util)
        self._sampled_pids.update(per_pid)
        owners = self.attributor.owners(((d.region, u) for d, u in entries), per_pid)
        for pid, values in per_pid.items():
            found = owners.get(pid)
            if found in util:
                util[found] += min(100.0, max(0.0, sum(values) / len(values)))
        return util

    def _resolver_failed(self, pid: int) -> None:
        self._failed("pid_resolver", "throttle_pid_resolver_failed", pid=pid)

    def _limits(self, device: _Device) -> tuple[float, CorePolicy, int]:
        """(limit, policy, priority) of a device. The limit is read from its region the first
        time (it never changes); policy and priority every tick, since the agent rewrites them
        in `control` when the pod's annotations change (see `throttle/regionpolicy.py`)."""
        region, dev = device.region, device.dev
        policy, priority = region.policy(dev), region.priority
        limits = device.limits
        if limits is None or limits[2] != priority or limits[1] != policy:
            if policy not in CORE_POLICIES:
                policy = self.default_policy
            limit = (
                limits[0] if limits is not None
                else min(100.0, max(1e-6, float(region.core_limit(dev))))
            )
            limits = device.limits = (limit, policy, priority)
        return limits

    def _observe(
        self, device: _Device, usage: RegionUsage, util: float | None
    ) -> tuple[Observation, tuple[int, int]]:
        """The device's tick for the law, and the (rate, burst) found written in its region."""
        dev = device.dev
        spent_now = usage.tokens_spent[dev] if dev < len(usage.tokens_spent) else 0
        if dev < len(usage.launches) and dev < len(usage.wait_ns):
            # the shim's device totals: no slot needs reading for the law
            launches_now, wait_now = usage.launches[dev], usage.wait_ns[dev]
        else:
            launches_now = wait_now = 0
            for p in usage.processes:
                if dev < len(p.launches):
                    launches_now += p.launches[dev]
                if dev < len(p.wait_ns):
                    wait_now += p.wait_ns[dev]
        previous = device.previous
        device.previous = (spent_now, launches_now, wait_now)
        if previous is None:  # first sight (or agent restart): only a baseline
            spent = launches = wait = 0
        else:
            # Totals drop when the shim reclaims a dead process's slot: count nothing then.
            spent = max(0, spent_now - previous[0])
            launches = max(0, launches_now - previous[1])
            wait = max(0, wait_now - previous[2])
        # Read once: it is the rate in force for the law, and what the write compares with (a
        # rate changed behind the agent's back, or left by its previous run, is seen and fixed).
        written = device.region.rate(dev)
        rate, burst = written
        if rate == 0 and burst == 0:
            rate = burst = UNLIMITED_RATE  # never configured: the shim does not throttle
        limit, policy, priority = self._limits(device)
        obs = Observation(
            device.key, limit, policy, priority, spent, launches, wait / 1e9, util, rate, burst
        )
        return obs, written

    def _steer_gpu(
        self, uuid: str, entries: _Entries, samples: list[ProcessSample] | None, dt_s: float
    ) -> None:
        utils = self._utilization(entries, samples)
        observations: list[Observation] = []
        steered: list[tuple[_Device, tuple[int, int]]] = []
        for device, usage in entries:
            try:
                obs, written = self._observe(
                    device, usage, None if utils is None else utils[device.alloc_id]
                )
            except Exception:
                self._failed("region_read", "throttle_region_read_failed",
                             alloc_id=device.alloc_id, dev=device.dev)
                continue
            observations.append(obs)
            steered.append((device, written))
        decisions = control_step(observations, self._states.get(uuid, {}), dt_s, self.params)
        self._states[uuid] = {key: d.state for key, d in decisions.items()}
        open_loop = uuid in self._open_loop
        for obs, (device, written) in zip(observations, steered, strict=True):
            decision = decisions[obs.key]
            self._apply(device, written, decision)
            device.last = (obs, decision, open_loop)

    def _apply(self, device: _Device, written: tuple[int, int], decision: Decision) -> None:
        if written[0] == decision.rate and written[1] == decision.burst:
            return
        try:
            device.region.set_rate(device.dev, decision.rate, decision.burst)
        except Exception:
            self._failed("set_rate", "throttle_set_rate_failed", alloc_id=device.alloc_id,
                         dev=device.dev)

    def _forget(self, regions: list[RegionHandle], by_gpu: Mapping[str, _Entries]) -> None:
        """Drop what belongs to regions gone and devices not read this tick."""
        for uuid in list(self._states):
            if uuid not in by_gpu:
                del self._states[uuid]
        tick = self.ticks
        if any(d.seen != tick for d in self._devices.values()):
            # Unreadable this tick, or gone: the next reading is a new baseline.
            self._devices = {k: d for k, d in self._devices.items() if d.seen == tick}
            self._by_region = {
                k: v for k, v in self._by_region.items() if v[1] and v[1][0].seen == tick
            }
        elif len(self._by_region) > len(regions):
            present = {id(region) for region in regions}
            self._by_region = {k: v for k, v in self._by_region.items() if k in present}


def _alloc_id(region: RegionHandle) -> str:
    try:
        return region.alloc_id
    except Exception:
        return "?"

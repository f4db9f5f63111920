"""The metric families, built from a `Snapshot` of the caches and the agent's counters.

A scrape has two halves: `gather_snapshot` runs on the event loop and only takes what the caches
and the other parts of the agent already hold (references, identities, the controller's last
decisions); `PendingSnapshot.complete` works out the per-container devices from that, and
`build_families` turns the snapshot into metric families; both run in a worker thread together
with the text encoding, so neither the formatting nor a slow client holds up the loop.

The families a scrape encodes are the lean `exposition.Family` (points, no per-sample objects)
with label sets kept across scrapes by `exposition.LabelSets`; `families` gives the same in
prometheus_client's form.

Names follow Prometheus conventions (base units, `_bytes`, `_seconds_total`, `_ratio`), all with
the `vgpu_` prefix. With `hami=True` the names HAMi's dashboards query are emitted as well.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from vgpu_agent import __version__
from vgpu_agent.deviceplugin.ids import DeviceIdError, SliceId, parse_device_id
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.metrics.exposition import Family, Labels, LabelSets, encode
from vgpu_agent.metrics.poller import GpuSample, RegionSample
from vgpu_agent.metrics.sources import Identity, MetricsSources, ThrottleStatus
from vgpu_agent.throttle.soloturn import PERIODS_NEEDED, SOLO_TURN_MOST_S

GPU_LABELS = ("node", "gpu_uuid", "gpu_index", "model")
CONTAINER_LABELS = ("namespace", "pod", "container", "gpu_uuid", "gpu_index")
HAMI_HOST_LABELS = ("node", "device_index", "device_uuid", "device_type")
HAMI_CONTAINER_LABELS = ("namespace", "pod", "container", "vdevice_index", "device_uuid")
HAMI_LEGACY_HOST_LABELS = ("nodeid", "deviceidx", "deviceuuid", "devicetype")
HAMI_LEGACY_CONTAINER_LABELS = ("podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid")
ALLOCATE_RESULTS = ("ok", "invalid", "error")
# Allocate is a local call (region files, a few syscalls): buckets from 1 ms to 10 s
ALLOCATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


# ---------------------------------------------------------------------------------- snapshot


@dataclass(slots=True)
class ContainerDevice:
    """One device of one identified container, with everything its series need.

    Read-only by convention, not frozen: a scrape builds one per container device, and a
    frozen dataclass's `__init__` costs four times as much."""

    identity: Identity
    alloc_id: str
    dev: int  # index inside the container
    gpu: GpuInfo | None  # None when the region names a GPU this node does not have
    uuid: str
    memory_limit: int
    core_limit: float  # percent
    rate: int
    burst: int
    usage_known: bool  # False: state unreadable or corrupt, only the limits are known
    policy: str = "off"  # as written in `control`
    memory_used: int = 0  # every kind together
    memory_context: int = 0  # of memory_used: contexts, heap and stack (ABI 1.1 regions)
    memory_module: int = 0  # of memory_used: loaded modules and libraries
    memory_pool: int = 0  # of memory_used: held by stream-ordered pools
    memory_spilled: int = 0  # of the data: served by managed (host-backed) memory, card full
    graphs_unpriced: int = 0  # executable graphs charged the graph_cost floor (ABI 1.1 regions)
    launches: int = 0
    wait_ns: int = 0
    last_launch_ns: int = 0  # CLOCK_MONOTONIC ns, 0 = never
    utilization: float | None = None  # percent, from the throttle controller
    open_loop: bool | None = None
    paused: bool | None = None  # for a neighbour's turn alone (None: the controller does not say)
    priority: int = 0
    policy_source: str = ""  # "pod", "claim" (DRA) or "default" ("" when the agent does not say)


@dataclass(frozen=True)
class Snapshot:
    node: str
    gpus: tuple[GpuInfo, ...]
    gpu_samples: Mapping[str, GpuSample]
    healthy: Mapping[str, bool] | None
    xid_counts: Mapping[str, int] | None
    slices_per_gpu: int
    slices_allocated: Mapping[str, int]
    containers: tuple[ContainerDevice, ...]
    regions_by_state: Mapping[str, int]
    region_events: Mapping[str, int]
    region_read_errors: int
    nvml_errors: Mapping[str, int]
    registered: bool | None = None
    registrations: int | None = None
    kubelet_restarts: int | None = None
    pod_resources_failures: int | None = None
    task_restarts: Mapping[str, int] = field(default_factory=dict)
    task_cpu: Mapping[str, float] = field(default_factory=dict)
    now_ns: int = 0  # CLOCK_MONOTONIC, for launch ages
    # DRA: which container uses which claim (namespace, pod, container; claim ns, name, uid)
    claims: tuple[tuple[Identity, tuple[str, str, str]], ...] = ()
    time_sliced: frozenset[str] | None = None  # None: no throttle controller
    phase_changes: Mapping[str, int] | None = None
    only_strangers: frozenset[str] | None = None  # GPUs whose use NVML gives only to strangers
    uncharged: Mapping[str, float] | None = None  # use charged to nobody, per time-sliced GPU
    solo_turns: Mapping[str, int] | None = None  # turns alone given, per GPU
    unmeasured: Mapping[str, int] | None = None  # per time-sliced GPU: without a figure
    sample_periods: Mapping[str, float] | None = None  # NVML's sample period, s, per GPU read
    poll_periods: Mapping[str, int] | None = None  # sample periods between two asks, per GPU
    # per GPU asked: NVML's per-process utilization calls and their seconds (None: no controller)
    nvml_calls: Mapping[str, tuple[int, float]] | None = None
    throttle_ticks: int | None = None


# The rate the throttle controller writes for devices it does not limit; not worth a series.
_UNLIMITED_RATE = 1 << 52


@lru_cache(maxsize=4096)
def _slice_of(device_id: str) -> SliceId | None:
    """The slice a device-plugin ID names; None for other IDs (DRA's). Cached: a region's IDs
    never change, and every scrape looks at all of them."""
    try:
        return parse_device_id(device_id)
    except DeviceIdError:
        return None


MEMORY_KINDS = ("data", "context", "module", "pool")


def memory_split(entry: ContainerDevice) -> tuple[int, int, int, int]:
    """The container's memory in bytes per `MEMORY_KINDS`; data is what the other kinds leave
    of the total."""
    context, module, pool = entry.memory_context, entry.memory_module, entry.memory_pool
    return max(0, entry.memory_used - (context + module + pool)), context, module, pool


def memory_by_kind(entry: ContainerDevice) -> dict[str, int]:
    """`memory_split` by kind name."""
    return dict(zip(MEMORY_KINDS, memory_split(entry), strict=True))


def container_devices(
    identity: Identity,
    region: RegionSample,
    by_uuid: Mapping[str, GpuInfo],
    throttle: Mapping[tuple[str, int], ThrottleStatus],
    policy_source: str = "",
) -> list[ContainerDevice]:
    out: list[ContainerDevice] = []
    seen: set[str] = set()
    usage = region.usage
    known = usage is not None and not usage.corrupt
    processes = usage.processes if usage is not None else ()
    totals = (usage.memory_used, usage.memory_context, usage.memory_module, usage.memory_pool,
              usage.memory_spilled, usage.graphs_unpriced, usage.launches, usage.wait_ns
              ) if usage is not None else None
    for dev, limits in enumerate(region.devices):
        uuid = limits.uuid
        if uuid in seen:  # a region names each GPU once; never emit a series twice
            continue
        seen.add(uuid)
        status = throttle.get((region.alloc_id, dev))
        launches = wait_ns = last_launch_ns = 0
        for p in processes:
            if dev < len(p.launches):
                launches += p.launches[dev]
                wait_ns += p.wait_ns[dev]
                last_launch_ns = max(last_launch_ns, p.last_launch_ns[dev])
        used, context, module, pool, spilled, unpriced, launched, waited = (
            (0, 0, 0, 0, 0, 0, 0, 0) if totals is None
            else [values[dev] if dev < len(values) else 0 for values in totals]
        )
        # The shim's device totals are cumulative: a process's counts stay in them when its
        # slot is reclaimed (the slot's are zeroed), so the live slots' sums alone fall when a
        # process ends, which Prometheus takes for a counter reset. Never below those sums.
        launches, wait_ns = max(launches, launched), max(wait_ns, waited)
        out.append(
            ContainerDevice(
                identity=identity,
                alloc_id=region.alloc_id,
                dev=dev,
                gpu=by_uuid.get(uuid),
                uuid=uuid,
                memory_limit=limits.memory_limit,
                core_limit=limits.core_limit,
                rate=status.rate if status is not None else limits.rate,
                burst=limits.burst,
                usage_known=known,
                policy=limits.policy,
                memory_used=used,
                memory_context=context,
                memory_module=module,
                memory_pool=pool,
                memory_spilled=spilled,
                graphs_unpriced=unpriced,
                launches=launches,
                wait_ns=wait_ns,
                last_launch_ns=last_launch_ns,
                utilization=status.measured_util if status is not None else None,
                open_loop=status.open_loop if status is not None else None,
                paused=status.paused if status is not None else None,
                priority=region.priority,
                policy_source=policy_source,
            )
        )
    return out


@dataclass(frozen=True)
class PendingSnapshot:
    """What `gather_snapshot` took on the loop; `complete()` (pure, for a worker thread) works
    out the container devices from it. Everything here is immutable or a private copy."""

    snapshot: Snapshot  # every field but `containers`
    chosen: tuple[tuple[Identity, RegionSample, str], ...]  # (identity, region, policy source)
    throttle: Mapping[tuple[str, int], ThrottleStatus]

    def complete(self) -> Snapshot:
        by_uuid = {gpu.uuid: gpu for gpu in self.snapshot.gpus}
        containers: list[ContainerDevice] = []
        for identity, region, source in self.chosen:
            containers += container_devices(identity, region, by_uuid, self.throttle, source)
        return replace(self.snapshot, containers=tuple(containers))


def take_snapshot(
    sources: MetricsSources,
    gpu_samples: Mapping[str, GpuSample],
    regions: Sequence[RegionSample],
    region_read_errors: int = 0,
    now_ns: int | None = None,
) -> Snapshot:
    """Copy what a scrape needs and work it out, all at once (`gather_snapshot` and
    `complete`)."""
    return gather_snapshot(sources, gpu_samples, regions, region_read_errors, now_ns).complete()


def gather_snapshot(
    sources: MetricsSources,
    gpu_samples: Mapping[str, GpuSample],
    regions: Sequence[RegionSample],
    region_read_errors: int = 0,
    now_ns: int | None = None,
) -> PendingSnapshot:
    """Take what a scrape needs. Runs on the loop; reads only memory the agent already holds
    and calls every source there (they are not for worker threads)."""
    gpus = tuple(sources.gpus())
    throttle = dict(sources.throttle_status()) if sources.throttle_status else {}
    slices: dict[str, set[int]] = {}
    chosen: dict[Identity, RegionSample] = {}
    states = {"active": 0, "corrupt": 0, "unreadable": 0, "unidentified": 0}
    for region in regions:
        for device_id in region.device_ids:
            slice_id = _slice_of(device_id)
            if slice_id is not None:
                slices.setdefault(slice_id.uuid, set()).add(slice_id.number)
        if region.usage is None:
            states["unreadable"] += 1
        elif region.usage.corrupt:
            states["corrupt"] += 1
        else:
            states["active"] += 1
        identity = sources.identity(region.alloc_id)
        if identity is None:
            states["unidentified"] += 1
            continue
        # A container seen in two regions holds only the newer one (the older awaits GC): one
        # allocation per container start, and its devices are the container's devices.
        if identity not in chosen or chosen[identity].seq < region.seq:
            chosen[identity] = region

    source_of = sources.policy_source
    picked = tuple(
        (identity, region, source_of(region.alloc_id) if source_of is not None else "")
        for identity, region in chosen.items()
    )
    claim_of = dict(sources.claims()) if sources.claims else {}
    claims = tuple(
        (identity, claim_of[region.alloc_id])
        for identity, region in chosen.items()
        if region.alloc_id in claim_of
    )

    registration = sources.registration() if sources.registration else None
    tasks = sources.tasks() if sources.tasks else None
    snapshot = Snapshot(
        node=sources.node,
        gpus=gpus,
        gpu_samples=gpu_samples,
        healthy=dict(sources.healthy()) if sources.healthy else None,
        xid_counts=dict(sources.xid_counts()) if sources.xid_counts else None,
        slices_per_gpu=sources.slices_per_gpu,
        slices_allocated={uuid: len(ids) for uuid, ids in slices.items()},
        containers=(),
        regions_by_state=states,
        region_events=dict(sources.region_events()),
        region_read_errors=region_read_errors,
        nvml_errors=dict(sources.nvml_errors()),
        registered=registration.registered if registration is not None else None,
        registrations=registration.registrations if registration is not None else None,
        kubelet_restarts=registration.kubelet_restarts if registration is not None else None,
        pod_resources_failures=(
            sources.pod_resources_failures() if sources.pod_resources_failures else None
        ),
        task_restarts=dict(tasks.restarts) if tasks is not None else {},
        task_cpu=dict(tasks.cpu_seconds) if tasks is not None else {},
        now_ns=time.monotonic_ns() if now_ns is None else now_ns,
        claims=claims,
        time_sliced=(frozenset(sources.time_sliced_gpus()) if sources.time_sliced_gpus
                     else None),
        phase_changes=dict(sources.phase_changes()) if sources.phase_changes else None,
        only_strangers=(frozenset(sources.use_only_strangers_gpus())
                        if sources.use_only_strangers_gpus else None),
        uncharged=(dict(sources.use_charged_to_nobody()) if sources.use_charged_to_nobody
                   else None),
        solo_turns=dict(sources.solo_turns()) if sources.solo_turns else None,
        unmeasured=dict(sources.unmeasured()) if sources.unmeasured else None,
        sample_periods=dict(sources.sample_periods()) if sources.sample_periods else None,
        poll_periods=dict(sources.poll_periods()) if sources.poll_periods else None,
        nvml_calls=(dict(sources.nvml_utilization_calls()) if sources.nvml_utilization_calls
                    else None),
        throttle_ticks=sources.throttle_ticks() if sources.throttle_ticks else None,
    )
    return PendingSnapshot(snapshot, picked, throttle)


# ---------------------------------------------------------------------------------- families


def _gauge(name: str, doc: str, labels: Sequence[str]) -> Family:
    return Family("gauge", name, doc, labels)


def _counter(name: str, doc: str, labels: Sequence[str]) -> Family:
    return Family("counter", name, doc, labels)


def _put(family: Family, labels: Labels, value: float) -> None:
    """Add a point whose label set is shared with the entity's other families (and, through
    `LabelSets`, kept from scrape to scrape)."""
    family.points.append((labels, value))


def build_families(
    snap: Snapshot, hami: bool = False, labels: LabelSets | None = None
) -> list[Family | Metric]:
    """Every family of the agent's own metrics for one scrape, lean (what `encode` takes).
    `labels` keeps label sets across scrapes; without it every set is built anew. Pure apart
    from that memo, whose entries depend only on their keys."""
    sets = labels if labels is not None else LabelSets()
    groups: list[Iterator[Family | Metric]] = [
        _gpu_families(snap, sets),
        _container_families(snap, sets),
        _claim_families(snap),
        _agent_families(snap, sets),
    ]
    if hami:
        groups.append(_hami_families(snap, sets))
    # a family without samples is left out: it would only add HELP/TYPE lines
    return [
        family
        for group in groups
        for family in group
        if (family.points if isinstance(family, Family) else family.samples)
    ]


def families(snap: Snapshot, hami: bool = False) -> list[Metric]:
    """The same families in prometheus_client's form. Pure."""
    return [f.metric() if isinstance(f, Family) else f for f in build_families(snap, hami)]


def _gpu_labels(sets: LabelSets, snap: Snapshot, gpu: GpuInfo) -> Labels:
    return sets.get(GPU_LABELS, (snap.node, gpu.uuid, str(gpu.index), gpu.name))


def _gpu_families(snap: Snapshot, sets: LabelSets) -> Iterator[Family]:
    mem_total = _gauge("vgpu_gpu_memory_total_bytes", "GPU memory in total.", GPU_LABELS)
    mem_used = _gauge("vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML).", GPU_LABELS)
    util = _gauge(
        "vgpu_gpu_utilization_ratio", "Fraction of time the GPU ran kernels (NVML).", GPU_LABELS
    )
    temp = _gauge("vgpu_gpu_temperature_celsius", "GPU temperature.", GPU_LABELS)
    power = _gauge("vgpu_gpu_power_watts", "GPU power draw.", GPU_LABELS)
    stale = _gauge(
        "vgpu_gpu_readings_stale",
        "1 when the last NVML poll of the GPU failed; its live readings are then absent.",
        GPU_LABELS,
    )
    failures = _counter(
        "vgpu_gpu_poll_failures", "NVML polls of the GPU that failed.", GPU_LABELS
    )
    healthy = _gauge("vgpu_gpu_healthy", "1 when the GPU is healthy, 0 when not.", GPU_LABELS)
    xids = _counter(
        "vgpu_gpu_critical_xid_events", "Critical XID events reported for the GPU.", GPU_LABELS
    )
    slices_total = _gauge("vgpu_gpu_slices", "vGPU slices the GPU is split into.", GPU_LABELS)
    slices_alloc = _gauge(
        "vgpu_gpu_slices_allocated", "Slices of the GPU held by allocations.", GPU_LABELS
    )
    time_sliced = _gauge(
        "vgpu_gpu_nvml_time_sliced",
        "1 while the throttle reads the GPU's NVML samples as time-sliced (each period whole to "
        "one process, the use split out by tokens spent); also 1 with one process on the GPU.",
        GPU_LABELS,
    )
    only_strangers = _gauge(
        "vgpu_gpu_nvml_use_only_strangers",
        "1 while the GPU's busy NVML samples have gone only to processes no container claims, "
        "while containers spend tokens, for 10 s or more (an MPS server, if the driver counts "
        "its clients' work as its own; or a process outside the cluster): none of its "
        "containers can be measured (throttle_use_only_strangers in the log).",
        GPU_LABELS,
    )
    phase_changes = _counter(
        "vgpu_gpu_throttle_phase_changes",
        "Changes of phase (a container's SM time per token moving threefold or more) found on "
        "the time-sliced GPU.",
        GPU_LABELS,
    )
    uncharged = _gauge(
        "vgpu_gpu_throttle_uncharged_use_percent",
        "Points of the time-sliced GPU's use, at the last batch of NVML samples, that its "
        "containers' tokens do not explain (at what each one's bought while alone) and that no "
        "container was charged: NVML counting the GPU busy beyond the work (or a few points of "
        "a figure taken light). 0 when all of it was charged.",
        GPU_LABELS,
    )
    solo_turns = _counter(
        "vgpu_gpu_throttle_solo_turns",
        "Turns alone given on the time-sliced GPU: every other container paused for under 2 s "
        "so that one never seen alone could be measured (throttle_solo_turns).",
        GPU_LABELS,
    )
    unmeasured = _gauge(
        "vgpu_gpu_throttle_unmeasured_containers",
        "Containers spending on the time-sliced GPU at its last batch of NVML samples without "
        "a figure of their own (never seen alone there, or their figure in doubt): their "
        "shares rest on the costs their sample periods show until a turn alone measures them. "
        "Absent for GPUs not read as time-sliced.",
        GPU_LABELS,
    )
    sample_period = _gauge(
        "vgpu_gpu_nvml_sample_period_seconds",
        "NVML's sample period on the GPU as the throttle reads it from the samples' stamps: the "
        f"time one reading describes. On a time-sliced GPU a turn alone needs {PERIODS_NEEDED} "
        f"periods within {SOLO_TURN_MOST_S:g} s ({SOLO_TURN_MOST_S / PERIODS_NEEDED:.3f} s or "
        "less); above that none is given and the shares rest on the periods alone "
        "(throttle_solo_turns_impossible in the log).",
        GPU_LABELS,
    )
    poll_periods = _gauge(
        "vgpu_gpu_nvml_poll_periods",
        "NVML sample periods between two of the throttle's asks for the GPU's per-process "
        "samples while it steers the GPU fast: throttle_nvml_poll_periods where the containers' "
        "estimates are tight, 1 while one is learning (new, or re-learning a change of phase), "
        "its kernels changed, or two containers or more share the GPU time-sliced.",
        GPU_LABELS,
    )
    nvml_calls = _counter(
        "vgpu_gpu_nvml_process_utilization_calls",
        "NVML per-process utilization calls the throttle made for the GPU (one every "
        "vgpu_gpu_nvml_poll_periods sample periods while it steers the GPU fast, fewer while "
        "calm; failed calls included).",
        GPU_LABELS,
    )
    nvml_seconds = _counter(
        "vgpu_gpu_nvml_process_utilization_call_seconds",
        "Seconds those calls took, wall time (about 2 ms a call on an H200, nearly all of it "
        "CPU): what the throttle's samples cost the node, beside process_cpu_seconds_total.",
        GPU_LABELS,
    )
    for gpu in snap.gpus:
        labels = _gpu_labels(sets, snap, gpu)
        _put(mem_total, labels, gpu.memory_total)
        if snap.nvml_calls is not None:
            made, seconds = snap.nvml_calls.get(gpu.uuid, (0, 0.0))
            _put(nvml_calls, labels, made)
            _put(nvml_seconds, labels, seconds)
        _put(slices_total, labels, snap.slices_per_gpu)
        _put(slices_alloc, labels, snap.slices_allocated.get(gpu.uuid, 0))
        if snap.time_sliced is not None:
            _put(time_sliced, labels, 1 if gpu.uuid in snap.time_sliced else 0)
        if snap.only_strangers is not None:
            _put(only_strangers, labels, 1 if gpu.uuid in snap.only_strangers else 0)
        if snap.phase_changes is not None:
            _put(phase_changes, labels, snap.phase_changes.get(gpu.uuid, 0))
        if snap.solo_turns is not None:
            _put(solo_turns, labels, snap.solo_turns.get(gpu.uuid, 0))
        if snap.unmeasured is not None and gpu.uuid in snap.unmeasured:
            _put(unmeasured, labels, snap.unmeasured[gpu.uuid])
        if snap.sample_periods is not None and gpu.uuid in snap.sample_periods:
            _put(sample_period, labels, snap.sample_periods[gpu.uuid])
        if snap.poll_periods is not None and gpu.uuid in snap.poll_periods:
            _put(poll_periods, labels, snap.poll_periods[gpu.uuid])
        if snap.uncharged is not None and gpu.uuid in snap.uncharged:
            _put(uncharged, labels, snap.uncharged[gpu.uuid])
        if snap.healthy is not None and gpu.uuid in snap.healthy:
            _put(healthy, labels, 1 if snap.healthy[gpu.uuid] else 0)
        if snap.xid_counts is not None:
            _put(xids, labels, snap.xid_counts.get(gpu.uuid, 0))
        sample = snap.gpu_samples.get(gpu.uuid)
        if sample is None:
            continue
        _put(stale, labels, 1 if sample.stale else 0)
        _put(failures, labels, sample.failures)
        if sample.stale or sample.readings is None:
            continue
        r = sample.readings
        if r.memory_used is not None:
            _put(mem_used, labels, r.memory_used)
        if r.utilization is not None:
            _put(util, labels, r.utilization)
        if r.temperature_c is not None:
            _put(temp, labels, r.temperature_c)
        if r.power_w is not None:
            _put(power, labels, r.power_w)
    yield from (mem_total, mem_used, util, temp, power, stale, failures, healthy, xids)
    yield from (slices_total, slices_alloc, time_sliced, only_strangers, sample_period,
                poll_periods, phase_changes, uncharged, solo_turns, unmeasured, nvml_calls,
                nvml_seconds)


_KIND_LABELS = (*CONTAINER_LABELS, "kind")
_POLICY_LABELS = (*CONTAINER_LABELS, "policy", "policy_source")
_PRIORITY_LABELS = (*CONTAINER_LABELS, "policy_source")


def _container_values(entry: ContainerDevice) -> tuple[str, ...]:
    index = str(entry.gpu.index) if entry.gpu is not None else ""
    return (*entry.identity, entry.uuid, index)


_CONTAINER_GROUP = "container"  # a `LabelSets.group` key's tag: no (names, values) key has one


class _ContainerSets(NamedTuple):
    """Every label set of one container device's series, looked up once per scrape."""

    base: Labels
    kinds: tuple[Labels, ...]  # per `MEMORY_KINDS`
    # the policy's and the priority's, with `policy_source`; None where the agent does not
    # say the source
    sourced: tuple[Labels, Labels] | None


def _container_sets(sets: LabelSets, entry: ContainerDevice) -> _ContainerSets:
    values = _container_values(entry)
    source = entry.policy_source
    return _ContainerSets(
        base=sets.new(CONTAINER_LABELS, values),
        kinds=tuple(sets.new(_KIND_LABELS, (*values, kind)) for kind in MEMORY_KINDS),
        sourced=(sets.new(_POLICY_LABELS, (*values, entry.policy, source)),
                 sets.new(_PRIORITY_LABELS, (*values, source))) if source else None,
    )


def launch_age_s(snap: Snapshot, entry: ContainerDevice) -> float | None:
    if not entry.usage_known or entry.last_launch_ns <= 0:
        return None
    return max(0.0, (snap.now_ns - entry.last_launch_ns) / 1e9)


def _container_families(snap: Snapshot, sets: LabelSets) -> Iterator[Family]:
    L = CONTAINER_LABELS
    mem_limit = _gauge(
        "vgpu_container_memory_limit_bytes", "GPU memory the container may use (0: no limit).", L
    )
    mem_used = _gauge(
        "vgpu_container_memory_used_bytes",
        "GPU memory the container holds (shim's account), by kind: data (allocations), context "
        "(contexts, device heap and stack), module (loaded code), pool (held by memory pools).",
        _KIND_LABELS,
    )
    mem_spilled = _gauge(
        "vgpu_container_memory_spilled_bytes",
        "Of the container's data memory, what the card could not hold and the shim served "
        "from managed memory (host memory charged to the container; memory_oversubscription: "
        "spill).",
        L,
    )
    core_limit = _gauge(
        "vgpu_container_core_limit_ratio", "Share of the GPU's SM time the container is given.", L
    )
    core_util = _gauge(
        "vgpu_container_core_utilization_ratio",
        "Share of the GPU's SM time the container used (NVML per-process samples).",
        L,
    )
    waited = _counter(
        "vgpu_container_token_wait_seconds", "Time the container's launches waited for tokens.", L
    )
    launches = _counter("vgpu_container_kernel_launches", "Kernel launches by the container.", L)
    unpriced = _counter(
        "vgpu_container_graphs_unpriced",
        "Executable CUDA graphs the shim could not price from their kernel nodes (each launch of "
        "one costs at least the device's graph_cost).",
        L,
    )
    rate = _gauge(
        "vgpu_container_token_refill_rate",
        "Tokens per second the container's bucket refills at (absent when unlimited).",
        L,
    )
    age = _gauge(
        "vgpu_container_last_launch_age_seconds", "Time since the container's last launch.", L
    )
    open_loop = _gauge(
        "vgpu_container_throttle_open_loop",
        "1 while the container's rate is not steered by measured use (no per-process NVML "
        "samples on its GPU, or it spent while its GPU's use went only to processes of no "
        "container).",
        L,
    )
    paused = _gauge(
        "vgpu_container_throttle_paused",
        "1 while the container's launches are paused for a neighbour's turn alone on a "
        "time-sliced GPU (under 2 s; throttle_solo_turns).",
        L,
    )
    # The policy's own series carry `policy_source`: on the others a label that changes when
    # the pod becomes known would cut their counters into two series.
    policy_info = _gauge(
        "vgpu_container_core_policy_info",
        "1 for the core policy in force; policy_source: pod (its annotations) or default (node).",
        _POLICY_LABELS,
    )
    priority = _gauge(
        "vgpu_container_priority",
        "Priority in force when the GPU is oversubscribed (larger first); policy_source as above.",
        _PRIORITY_LABELS,
    )
    # Bound appends and one label lookup per container device: this loop is most of a scrape.
    put_limit, put_core_limit = mem_limit.points.append, core_limit.points.append
    put_rate, put_util = rate.points.append, core_util.points.append
    put_open, put_paused = open_loop.points.append, paused.points.append
    put_used, put_spilled = mem_used.points.append, mem_spilled.points.append
    put_waited, put_launches = waited.points.append, launches.points.append
    put_unpriced, put_age = unpriced.points.append, age.points.append
    put_policy, put_priority = policy_info.points.append, priority.points.append
    for entry in snap.containers:
        source = entry.policy_source
        gpu = entry.gpu
        # the key holds everything `_container_sets` builds the sets from
        group = sets.group(
            (_CONTAINER_GROUP, *entry.identity, entry.uuid, -1 if gpu is None else gpu.index,
             entry.policy if source else "", source),
            _container_sets, sets, entry,
        )
        labels = group.base
        if group.sourced is not None:
            policy_labels, priority_labels = group.sourced
            put_policy((policy_labels, 1))
            put_priority((priority_labels, entry.priority))
        put_limit((labels, entry.memory_limit))
        put_core_limit((labels, entry.core_limit / 100.0))
        if 0 < entry.rate < _UNLIMITED_RATE:
            put_rate((labels, entry.rate))
        if entry.utilization is not None:
            put_util((labels, max(0.0, min(100.0, entry.utilization)) / 100.0))
        if entry.open_loop is not None:
            put_open((labels, 1 if entry.open_loop else 0))
        if entry.paused is not None:
            put_paused((labels, 1 if entry.paused else 0))
        if not entry.usage_known:
            continue
        data, context, module, pool = memory_split(entry)
        data_labels, context_labels, module_labels, pool_labels = group.kinds
        put_used((data_labels, data))
        put_used((context_labels, context))
        put_used((module_labels, module))
        put_used((pool_labels, pool))
        put_spilled((labels, entry.memory_spilled))
        put_waited((labels, entry.wait_ns / 1e9))
        put_launches((labels, entry.launches))
        put_unpriced((labels, entry.graphs_unpriced))
        launch_age = launch_age_s(snap, entry)
        if launch_age is not None:
            put_age((labels, launch_age))
    yield from (mem_limit, mem_used, mem_spilled, core_limit, core_util, waited, launches)
    yield from (unpriced, rate, age, open_loop, paused)
    yield from (policy_info, priority)


def _claim_families(snap: Snapshot) -> Iterator[Metric]:
    """DRA: the claim behind each container's limits, to join with the container series."""
    info = InfoMetricFamily(
        "vgpu_container_claim",
        "The DRA ResourceClaim a container's GPU share was prepared for.",
        labels=["namespace", "pod", "container"],
    )
    for identity, (claim_ns, claim_name, claim_uid) in snap.claims:
        info.add_metric(
            list(identity),
            {"claim_namespace": claim_ns, "claim_name": claim_name, "claim_uid": claim_uid},
        )
    yield info


def _node_family(
    kind: str, name: str, doc: str, value: float, node: str, sets: LabelSets
) -> Family:
    family = (_counter if kind == "counter" else _gauge)(name, doc, ["node"])
    _put(family, sets.get(("node",), (node,)), value)
    return family


def _agent_families(snap: Snapshot, sets: LabelSets) -> Iterator[Family | Metric]:
    """The agent's own state; every series carries `node` so one dashboard covers a cluster."""
    node = snap.node
    build = InfoMetricFamily("vgpu_build", "The agent's version.", labels=["node"])
    build.add_metric([node], {"version": __version__, "python_version": platform.python_version()})
    yield build
    if snap.registered is not None:
        yield _node_family(
            "gauge",
            "vgpu_plugin_registered",
            "1 while the device plugin is registered with the kubelet.",
            1 if snap.registered else 0,
            node,
            sets,
        )
    if snap.registrations is not None:
        yield _node_family(
            "counter",
            "vgpu_plugin_registrations",
            "Successful registrations with the kubelet.",
            snap.registrations,
            node,
            sets,
        )
    if snap.kubelet_restarts is not None:
        yield _node_family(
            "counter",
            "vgpu_kubelet_restarts",
            "Kubelet restarts the agent noticed.",
            snap.kubelet_restarts,
            node,
            sets,
        )
    if snap.pod_resources_failures is not None:
        yield _node_family(
            "counter",
            "vgpu_pod_resources_failures",
            "Failed PodResources List calls (container labels then keep their last known values).",
            snap.pod_resources_failures,
            node,
            sets,
        )
    if snap.throttle_ticks is not None:
        yield _node_family(
            "counter",
            "vgpu_throttle_ticks",
            "Ticks of the core-throttle controller: each steers the GPUs due, one every "
            "throttle_tick_seconds while shares change, fewer while all is calm.",
            snap.throttle_ticks,
            node,
            sets,
        )
    yield _node_family(
        "counter",
        "vgpu_region_read_errors",
        "Regions whose control file could not be read by the metrics.",
        snap.region_read_errors,
        node,
        sets,
    )
    by_key: list[tuple[str, str, str, str, Mapping[str, int] | Mapping[str, float]]] = [
        ("vgpu_nvml_errors", "NVML calls that failed, by call.", "call", "counter",
         snap.nvml_errors),
        ("vgpu_region_events",
         "Region lifecycle events: created, adopted after a restart, removed by GC, corrupt; "
         "identity_rejected: process claims in `state` the host refuted; tokens_overclaimed: "
         "ticks a device's `state` claimed more tokens than its bucket let through; "
         "use_over_target: readings of a strict container's own use above its target, each "
         "the twelfth or later in a row, not following the law's falling k; "
         "state_replaced, files_truncated: container files replaced or grown past their size.",
         "event", "counter", snap.region_events),
        ("vgpu_regions", "Allocation regions on the node, by state.", "state", "gauge",
         snap.regions_by_state),
        ("vgpu_task_restarts", "Restarts of the agent's supervised tasks.", "task", "counter",
         snap.task_restarts),
        ("vgpu_task_cpu_seconds",
         "CPU of the event loop's thread spent in each supervised task's own steps (between "
         "two of its awaits), restarts included; what it hands to worker threads is not in it.",
         "task", "counter", snap.task_cpu),
    ]
    for name, doc, key, kind, counts in by_key:
        family = (_counter if kind == "counter" else _gauge)(name, doc, ["node", key])
        names = ("node", key)
        for item, count in sorted(counts.items()):
            _put(family, sets.get(names, (node, item)), count)
        yield family


def _hami_families(snap: Snapshot, sets: LabelSets) -> Iterator[Family]:
    """The names and labels HAMi's exporter uses, current (v2.9+) and legacy."""
    host_mem = _gauge(
        "hami_host_gpu_memory_used_bytes", "GPU memory in use (HAMi name).", HAMI_HOST_LABELS
    )
    host_util = _gauge(
        "hami_host_gpu_utilization_ratio", "GPU utilization (HAMi name).", HAMI_HOST_LABELS
    )
    old_mem = _gauge("HostGPUMemoryUsage", "GPU memory in use, bytes (HAMi legacy name).",
                     HAMI_LEGACY_HOST_LABELS)
    old_util = _gauge("HostCoreUtilization", "GPU utilization, percent (HAMi legacy name).",
                      HAMI_LEGACY_HOST_LABELS)
    for gpu in snap.gpus:
        sample = snap.gpu_samples.get(gpu.uuid)
        if sample is None or sample.stale or sample.readings is None:
            continue
        values = (snap.node, str(gpu.index), gpu.uuid, gpu.name)
        labels = sets.get(HAMI_HOST_LABELS, values)
        old = sets.get(HAMI_LEGACY_HOST_LABELS, values)
        if sample.readings.memory_used is not None:
            _put(host_mem, labels, sample.readings.memory_used)
            _put(old_mem, old, sample.readings.memory_used)
        if sample.readings.utilization is not None:
            _put(host_util, labels, sample.readings.utilization)
            _put(old_util, old, sample.readings.utilization * 100.0)
    yield from (host_mem, host_util, old_mem, old_util)

    C, OC = HAMI_CONTAINER_LABELS, HAMI_LEGACY_CONTAINER_LABELS
    vmem_used = _gauge("hami_vgpu_memory_used_bytes", "vGPU memory in use (HAMi name).", C)
    vmem_limit = _gauge("hami_vgpu_memory_limit_bytes", "vGPU memory limit (HAMi name).", C)
    dev_mem = _gauge(
        "hami_container_device_memory_bytes", "Container GPU memory (HAMi name).", C
    )
    dev_util = _gauge(
        "hami_container_device_utilization_ratio", "Container GPU utilization (HAMi name).", C
    )
    last_kernel = _gauge(
        "hami_container_last_kernel_elapsed_seconds",
        "Time since the container's last kernel launch (HAMi name).",
        C,
    )
    old_used = _gauge("vGPU_device_memory_usage_in_bytes", "vGPU memory in use (legacy).", OC)
    old_limit = _gauge("vGPU_device_memory_limit_in_bytes", "vGPU memory limit (legacy).", OC)
    old_cutil = _gauge(
        "Device_utilization_desc_of_container", "Container GPU utilization, percent (legacy).", OC
    )
    for entry in snap.containers:
        hami_values = (*entry.identity, str(entry.dev), entry.uuid)
        labels = sets.get(C, hami_values)
        old = sets.get(OC, hami_values)
        _put(vmem_limit, labels, entry.memory_limit)
        _put(old_limit, old, entry.memory_limit)
        if entry.utilization is not None:
            percent = max(0.0, min(100.0, entry.utilization))
            _put(dev_util, labels, percent / 100.0)
            _put(old_cutil, old, percent)
        if not entry.usage_known:
            continue
        _put(vmem_used, labels, entry.memory_used)
        _put(dev_mem, labels, entry.memory_used)
        _put(old_used, old, entry.memory_used)
        launch_age = launch_age_s(snap, entry)
        if launch_age is not None:
            _put(last_kernel, labels, launch_age)
    yield from (vmem_used, vmem_limit, dev_mem, dev_util, last_kernel, old_used, old_limit)
    yield old_cutil


# ---------------------------------------------------------------------------------- agent events


class AgentInstruments:
    """Metrics the agent updates as things happen (Allocate calls), plus the process's own
    figures (CPU, memory, GC). A private registry: no module-level state."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=True)
        self.allocations = Counter(
            "vgpu_allocate_requests",
            "Allocate calls by result (ok, invalid, error).",
            ["node", "result"],
            registry=self.registry,
        )
        self.allocate_seconds = Histogram(
            "vgpu_allocate_duration_seconds",
            "Time to answer an Allocate call.",
            ["node"],
            buckets=ALLOCATE_BUCKETS,
            registry=self.registry,
        )
        self._latency = self.allocate_seconds.labels(node)
        for result in ALLOCATE_RESULTS:
            self.allocations.labels(node, result)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def on_result(self, result: str, seconds: float) -> None:
        """The device plugin's hook, called once per Allocate."""
        self.allocations.labels(self.node, result if result in ALLOCATE_RESULTS else "error").inc()
        self._latency.observe(max(0.0, seconds))


def render_exposition(
    snap: Snapshot,
    instruments: AgentInstruments,
    hami: bool,
    encoder: Callable[[Collector], bytes],
    openmetrics: bool,
    labels: LabelSets | None = None,
    between: Callable[[], object] | None = None,
) -> bytes:
    """The body of one scrape: the snapshot's families with the lean encoder, then the
    instruments (histogram, process figures) with prometheus_client's `encoder`, which for
    OpenMetrics also writes the closing `# EOF`. `labels`: label sets kept across scrapes;
    `between` is called between the steps (see `http._render_body`)."""
    if labels is not None:
        labels.rotate()
    built = build_families(snap, hami, labels)
    if between is not None:
        between()
    body = encode(built, openmetrics)
    if between is not None:
        between()
    return body + encoder(instruments.registry)


class ScrapeView:
    """What one scrape exposes: the snapshot's families, then the instruments'. Anything with a
    `collect()` is what prometheus_client's encoders take."""

    def __init__(self, snap: Snapshot, instruments: AgentInstruments, hami: bool = False):
        self.snap = snap
        self.instruments = instruments
        self.hami = hami

    def collect(self) -> Iterator[Metric]:
        yield from families(self.snap, self.hami)
        yield from self.instruments.registry.collect()

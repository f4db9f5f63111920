"""The core-throttle loop: every tick, measure each container on each GPU and write its token rate.

Per tick and physical GPU: NVML per-process SM samples since the last tick, host PIDs attributed
to regions on host evidence (`identity.Attributor`: a process's mount table shows its region's
`control`; what the shim's slots claim is only checked, never believed; a cgroup sibling of a
proven process is the fallback), tokens spent,
launches and time waited from the header of each region's `state` (the lean read: one pread,
no slot decoded; tokens believed up to what the bucket let through, `audit.py`, and waits only
beside spending near the rate, `WAIT_SPEND_FRACTION`); the law turns these into rates, written
with `set_rate` where they changed, a container caught overclaiming never above its cap
(`audit.LiarCap`).
The law is `nativelaw.control_step_native`, all containers of a GPU in one call, in C where the
extension was built (`fastlaw.control_step_gpu` in Python otherwise); both decide exactly as
the reference `control.control_step` (which `law=` can select, as the tests do). The steering
around it, per device, is `_observe` and `_settle`; `_steerc.c` does what they do for the
devices on the common path where it was built (`native_steering`) and hands them the rest.
The slots (what the container claims runs in it) are read only when a sample names a process
the controller cannot yet place, at most once a second per GPU; on a time-sliced GPU, which
names one process a period, a process named again within a minute is the one placed before if
its start time says so (`placements.HeldPlacements`). A failing region or GPU is logged and
counted; the loop goes on.

What a tick costs, and how often it runs:

- The regions are read on the loop, `READ_CHUNK` at a time with a yield between chunks:
  a header and a `control` cost a few microseconds, less than what a worker thread reading
  them costs the process (the thread's wake-ups, and the GIL passed back and forth at each
  read's system call). NVML is asked in a worker thread while its calls are slow (the last
  tick that asked it took over `inline_read_s` per call times the GPUs, so that a tick that
  asked one GPU cannot put the next, which asks all, on the loop; a real driver's calls take
  about 2 ms each, and one in trouble may hang), inline while they cost less than the hop.
- NVML is asked once every `nvml_poll_periods` of a GPU's sample periods (the agent's default,
  2, halves a real driver's calls), but every period while that GPU's samples are worth most
  (`SampleClock.every_period`): a container's estimate is loose (`_loose`: only the cold-start
  bound, a far reading awaiting the next, or its share uncertain by more than LOOSE_POINTS),
  its launches came to cost other tokens (`_kernels_changed`: a change of phase NVML shows a
  period or two later), or two containers or more spend on a time-sliced GPU (whose periods
  read together lose who was given which).
- Every region's heartbeat is refreshed every `heartbeat_s`, not every tick (and every tick
  where ticks are further apart).
- Each GPU keeps its own tick (`_Pace`): a GPU whose containers change is steered every
  `tick_s` while a calm one beside it is read, asked and steered at its own slower pace, so that
  a node pays for what changes, not for all it holds. The loop wakes when the first GPU is due
  and steers every GPU due within half a `tick_s` (GPUs on one pace share ticks); a region not
  seen before brings its GPUs' tick at once, and a region gone brings the tick of the GPU it
  left. A region is read when one of its devices' GPUs is due. (`tick` without `paced`, as the
  simulator's unpaced runs call it, steers every GPU.) A GPU at its longest interval
  (`max_tick_s` where something is lent, `unlent_tick_s` where not: below) is due on that
  interval's grid of the clock (`on_grid`), so that GPUs which settled at different moments
  share their ticks: a node of settled GPUs ticks once per interval, not once per GPU, and
  pays a tick's fixed part (the regions listed, paces, heartbeats, figures) that much less.
- A GPU's tick slows down while nothing changes on it: after `calm_ticks` * `tick_s` seconds of
  calm ticks in a row the interval grows by one `tick_s`, and by one more per further such span,
  up to `max_tick_s` (counted in time, not ticks: with the defaults 0.1 s, 0.2 s after 1 s of
  calm, 0.4 s after 3 s); the first tick that sees a change goes back to `tick_s`. A tick is calm
  when no container came or went, no target moved by more than `calm_target_points`, and no rate
  by more than `calm_rate_fraction` (noisy NVML samples keep nudging the rates a little), and no
  reading is far off awaiting the next to confirm it (`LoopState.surprise`). Where
  `calm_pooled_at` (`CALM_POOLED_AT`, 8) containers or more spend on a GPU whose use is split
  (time-sliced), the rates count together: calm unless they moved by more than
  `calm_rate_fraction` on average, each against its own. There each share is an estimate
  whose noise grows with the crowd: on the bench's node of 18 such containers a GPU, some rate
  moved by more than 2 % in about a quarter of the ticks, and held its GPU at `tick_s`. A
  tick calm only so (some rate moved alone) lets the GPU slow to `max_tick_s`, not further:
  allowed 2 s, ten containers' p99 errors rose further (simulated). With fewer than
  `calm_pooled_at`, each rate counts alone: a pair's or a trio's moves are the law following
  real differences, and pooled they cost accuracy (BENCHMARKS.md, "Calm on a crowded
  time-sliced GPU").
  The calm tick may grow further, to `unlent_tick_s` (by default `UNLENT_TICK_S`, 2 s, which
  the defaults reach after 19 s of calm; the agent's `throttle_settled_tick_seconds`), where
  nothing is lent: on that GPU no container runs above its limit, the limits fit in the GPU
  (both to `_SHARE_EPS`, a hundredth of a point: limits kept in parts per million leave equal
  slices a hair off 100 %), none is `off`
  (its use could grow into the others' at any moment) and each has a rate (a container not
  yet throttled runs unthrottled once it spends). Then a container that wakes needs nobody's
  rate lowered: its own rate already allows its share, so the slower tick costs only how soon
  spare share is lent, never a guarantee, as long as tokens buy what they did: an application
  whose phase changes so that its tokens buy more SM time takes from its neighbours until the
  next tick's samples show it (only NVML tells what a token buys). The kernels launched mostly
  change with the phase, and with them the tokens a launch costs: until the next tick, each
  device that launched `WATCH_LAUNCHES` times or more at the last tick (on a GPU with others
  on it, or strict) has its header read every `LAUNCH_LOOKS` * `max_tick_s`, and launches
  that cost `LAUNCH_COST_MOVE` times more or less than at the last tick bring the tick at
  once, and ticks of `max_tick_s` from there until calm again (NVML's samples may show the change a
  second later; a phase whose kernels keep their grids waits for the next tick; a tenant
  flipping its kernels holds its GPU at `max_tick_s` ticks, as a lending GPU ticks). It may
  also grow where the only reclaim to come is an idle container waking (one whose share is
  lent to others, or which has no rate yet): until the next tick, each such container's
  header is read every `max_tick_s` too (`watch_s`, `watched_woke`), and one that spent for
  more than its demand at the last tick brings the next tick at once, as soon as `max_tick_s`
  ticks would have seen it (where another GPU keeps the loop ticking faster, the look comes at
  its ticks, once in `max_tick_s`, and brings the waking container's GPU only). Limits that
  do not fit, an `off` container, a device not observed keep the tick at `max_tick_s`: only a
  tick sees those coming. A region that cannot be read is not known to be any of that: while
  one fails, the tick of its GPUs (of every GPU where they cannot be told) grows to
  `max_tick_s` at most (and a header corrupt for good is not a change every tick: its devices
  are followed once it reads).
  What counts is what the law decides, not why: a container that spends about its rate flips
  between waiting for tokens and not from tick to tick, which moves its target only where the
  allocation depends on it (lending), and then the target says so.
- Without regions a tick reads nothing and asks NVML nothing, and the loop then sleeps until a
  region is added (`wake`, which the agent calls from the region store) or `idle_tick_s` passed:
  an idle agent's controller wakes once in `idle_tick_s`, not ten times a second. A region
  added also ends a calm tick's sleep (no sooner than `tick_s` after the last tick began):
  Allocate comes before the container starts, so it is followed, and watched if it stays
  idle, before its first launch, however slow the calm tick was.
- On the loop, the tick holds it for one GPU's steering at a time (it yields between GPUs), so
  an Allocate or a scrape waits for a fraction of a tick, not for all of it.
- Per device, the law's input is built from one read per region of `state`'s header
  (`Region.counters`) and one of `control` (`Region.controls`: rates, policies, priority),
  without re-checking values that are valid by construction (see `_steer_gpu`).

Where a GPU cannot report per-process utilization (NVML_ERROR_NOT_SUPPORTED) the law runs open
loop: it sees no utilization, so rates stay at the bound derived from what each container spent
while unthrottled (never above the limit, possibly below it). That is logged once per GPU and
exposed in `open_loop_gpus`. The GPUs whose samples are read as time-sliced (each period whole
to one process; see `_utilization`) are in `time_sliced_gpus`, and the changes of phase the
split found on each GPU are counted in `phase_changes`. Where the split shares a GPU's use
among two containers or more, the law takes its shares as estimates, not samples: a far-off
one is followed at once (`ControlParams.confirm_surprises` off), not held until the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import structlog

from vgpu_agent import native
from vgpu_agent.gpu.model import GpuError, ProcessSample
from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy, ProcessUsage, RegionHandle, RegionUsage
from vgpu_agent.shm.headerread import NATIVE_READ, NOT_BATCH_READ_REASON, NOT_NATIVE_READ_REASON
from vgpu_agent.shm.layout import MAX_WAIT_NS
from vgpu_agent.throttle.attribution import HostEvidence
from vgpu_agent.throttle.audit import (
    JITTER_S,
    LIAR_HOLD_S,
    LIAR_MARGIN_POINTS,
    OVERUSE_ENDS,
    OVERUSE_HOLD_S,
    OVERUSE_READINGS,
    Bucket,
    LaunchDebt,
    LiarCap,
    OveruseWatch,
    believed_spend,
    dear_launches,
)
from vgpu_agent.throttle.control import (
    FULL_SHARE,
    UNLIMITED_RATE,
    ControlParams,
    Decision,
    LoopState,
    Observation,
)
from vgpu_agent.throttle.figurefile import FigureFile, Figures
from vgpu_agent.throttle.identity import (
    Attributor,
    CgroupPidResolver,
    NamespacePidResolver,
    PidResolver,
    ProcEvidence,
)
from vgpu_agent.throttle.nativelaw import NATIVE, NOT_NATIVE_REASON, control_step_native
from vgpu_agent.throttle.placements import HeldPlacements
from vgpu_agent.throttle.sampleclock import SampleClock
from vgpu_agent.throttle.strangers import StrangerWatch
from vgpu_agent.throttle.timesliced import (
    NATIVE_SPLIT,
    NOT_NATIVE_SPLIT_REASON,
    PER_PROCESS_HOLD_S,
    SHARED_PERIODS,
    TimeSlicedSplit,
    read_as_periods,
)
from vgpu_agent.throttle.turnkeeper import TurnKeeper

# One tick of the law for one GPU's containers: `control.control_step`'s signature.
Law = Callable[
    [list[Observation], Mapping[str, LoopState], float, ControlParams], dict[str, Decision]
]

log = structlog.get_logger(__name__)

# Observations are built as the plain tuples they are (see `_steer_gpu`): without the checks
# `Observation.__new__` makes of values that come from elsewhere.
_new = tuple.__new__
# Points of share within which a target is at its limit, not above it, and limits adding up
# to 100 % fit the GPU. Limits are kept in parts per million, so a GPU cut into 18 (or 3)
# equal slices has limits adding up to a hair under 100 % (or over it): a hair lent, or
# over-committed, would count as lending and keep the tick fast forever (BENCHMARKS.md). A
# loan this small is no share anyone could measure (NVML reads whole percents).
_SHARE_EPS = 0.01

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED
# The calm tick where nothing is lent (see the module note): only how soon spare share is lent
# waits on it; at 144 busy devices 2 s rather than 1 s saves the settled agent half a point of
# a core (BENCHMARKS.md).
UNLENT_TICK_S = 2.0


def unlent_tick(tick_s: float, max_tick_s: float, ceiling_s: float = UNLENT_TICK_S) -> float:
    """The calm tick where nothing is lent: `ceiling_s` (the operator's
    `throttle_settled_tick_seconds`), never below `max_tick_s`; a tick kept fast on purpose
    (`max_tick_s` at `tick_s`) stays fast."""
    return max(max_tick_s, ceiling_s) if max_tick_s > tick_s else tick_s


# Where this many containers or more spend on a GPU whose use is split (time-sliced), a tick is
# calm unless their rates together moved by `calm_rate_fraction` (see the module note)
CALM_POOLED_AT = 8
# A launch whose tokens moved by this factor either way, since the last tick, over at least
# WATCH_LAUNCHES launches, brings its GPU's tick between slow ticks (`_woke_among`): the
# kernels launched changed, and what a token buys may have changed with them (a phase change
# of four times halved or doubled a launch's tokens in the bench's applications).
LAUNCH_COST_MOVE = 1.5
WATCH_LAUNCHES = 8
# ... and each such device is read at one look in this many (the idle ones at every look): at
# 144 busy container-devices a look at all of them every 0.4 s took 0.4-0.5 % of a core
# (BENCHMARKS.md)
LAUNCH_LOOKS = 2


class UtilizationSource(Protocol):
    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]: ...


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
    # paused for a neighbour's turn alone (`throttle/soloturn.py`): rate and burst above are
    # what it gets back at the turn's end; until then the shim admits none of its launches
    paused: bool = False


class _Device:
    """One device of one allocation as the loop follows it from tick to tick.

    Its identity and limits are read once (only the agent writes them, when it creates the
    region); the counters are the cumulative totals of the previous tick.
    """

    __slots__ = ("alloc_id", "bucket", "dev", "key", "last", "launch_debt", "liar_cap", "limited",
                 "limits", "long_hold", "looked", "overclaimed", "overuse", "overused",
                 "paused", "previous", "read_ns", "region", "seen", "turn", "uuid")

    def __init__(self, region: RegionHandle, dev: int, alloc_id: str, uuid: str,
                 previous: tuple[int, int, int] | None):
        self.region = region
        self.dev = dev
        self.key = f"{alloc_id}/{dev}"
        # which looks read it while it is watched only for its launches (`_woke_among`): fixed
        # per device, so that other GPUs joining or leaving the watched list never skip it;
        # a checksum, not `hash`, so that a simulated node looks the same from run to run
        self.turn = zlib.crc32(self.key.encode())
        self.alloc_id = alloc_id
        self.uuid = uuid
        # limit, policy in force, and the policy and priority it was found from in `control`
        self.limits: tuple[float, CorePolicy, str, int] | None = None
        self.previous = previous  # tokens spent, launches, wait ns (cumulative)
        # when `previous` was read at the earliest (the controller's clock)
        self.read_ns: int | None = None
        # (read_ns it followed, tokens spent, launches) when last looked at between slow
        # ticks for its launch cost (`_woke_among`), None until then
        self.looked: tuple[int | None, int, int] | None = None
        # the last decision, kept raw: `DeviceStatus` is built only when someone asks
        self.last: tuple[Observation, Decision, bool] | None = None
        self.seen = 0  # the tick that last read the device
        # upper bound of the shim's token balance after the last tick, None while unlimited
        self.bucket: Bucket | None = None
        self.limited = False  # whether the rate read at the last tick limited the shim
        self.overclaimed = False  # logged once
        self.liar_cap: LiarCap | None = None  # while it is caught overclaiming (`audit`)
        self.launch_debt = LaunchDebt(MAX_WAIT_NS)  # launch debts forgiven (`audit`)
        self.overuse = OveruseWatch()  # its own use against its target (`audit`)
        self.overused = False  # logged once
        # its cap held OVERUSE_HOLD_S: the overuse watch fired while its claims were believed
        self.long_hold = False
        # paused for a neighbour's turn alone (`throttle/soloturn.py`): its claims not judged
        self.paused = False


# One device looked at between slow ticks: (device, tokens per percent, demand, tokens per
# launch). An idle one wakes its GPU when it spends for more than its demand (math.inf: it is
# not watched for that); a launching one when its tokens per launch move (0.0: not watched so).
_Watch = tuple[_Device, float, float, float]


class _Pace:
    """One GPU's own tick: how long its interval is, how long it has been calm, when it is
    due next and when it was last steered, and its idle containers to watch meanwhile."""

    __slots__ = ("calm_s", "due_ns", "interval_s", "steered_ns", "watching")

    def __init__(self, tick_s: float) -> None:
        self.interval_s = tick_s
        self.calm_s = 0.0  # seconds of calm ticks in a row (their planned intervals)
        self.due_ns = 0
        self.steered_ns = 0
        self.watching: list[_Watch] = []


class _Layout:
    """The regions of a tick's list by GPU (their indices), mapped again only when the list or
    what is known of its regions changes: a tick that steers one GPU of eight reads its regions
    without looking at the others'."""

    __slots__ = ("fresh", "key", "on_gpu", "present", "unknown")

    def __init__(self, key: list[int]) -> None:
        self.key = key  # the ids of the regions listed, in order
        self.present: set[str] = set()  # GPUs with a device of some region
        self.on_gpu: dict[str, list[int]] = {}  # GPU -> indices of the regions on it
        self.fresh: set[str] = set()  # GPUs of regions not seen before
        self.unknown: list[int] = []  # regions not seen before (read whatever is due)


# What one tick reads of a region: the counters of `state` (tokens spent, launches, ns waited per
# device, flattened), and of `control` the (rate, burst) per device (flattened), the policies and
# the priority in force; and when the counters were read (a moment between these two clocks).
_RegionReading = tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...], int, int, int]
# Per GPU: the devices on it with their region's reading, in region order.
_Entries = list[tuple[_Device, _RegionReading]]
# A GPU's new samples, or what prevented them.
_Sampled = list[ProcessSample] | BaseException
# What a GPU's steering left for its pace: whether it changed, whether it may have to reclaim,
# its devices to watch between slow ticks, and its devices to watch for their launches' cost
# where its next tick is far enough for a look between (`_pace`).
_Steered = tuple[bool, bool, list[_Watch], list[tuple[_Device, int, int]]]


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
        heartbeat_s: float = 1.0,
        max_tick_s: float | None = None,
        calm_ticks: int = 10,
        inline_read_s: float = 0.001,
        law: Law = control_step_native,
        evidence: HostEvidence | None = None,
        container_region_dir: str = "/run/vgpu",
        idle_tick_s: float | None = None,
        unlent_tick_s: float | None = None,
        nvml_poll_periods: int = 1,
        figure_file: FigureFile | None = None,
        solo_turns: bool = True,
        solo_turn_spare_priority: int | None = None,
        figure_max_age_s: float = 0.0,
    ):
        if not tick_s > 0:
            raise ValueError(f"tick must be > 0 s, got {tick_s!r}")
        max_tick_s = 4 * tick_s if max_tick_s is None else max_tick_s
        if not tick_s <= max_tick_s or not heartbeat_s > 0 or calm_ticks < 1:
            raise ValueError(
                f"need tick_s <= max_tick_s, heartbeat_s > 0 and calm_ticks >= 1, got "
                f"{tick_s!r}, {max_tick_s!r}, {heartbeat_s!r}, {calm_ticks!r}")
        if unlent_tick_s is None:
            unlent_tick_s = unlent_tick(tick_s, max_tick_s)
        if not max_tick_s <= unlent_tick_s < math.inf:
            raise ValueError(f"unlent tick must be finite and >= max_tick_s ({max_tick_s!r} s), "
                             f"got {unlent_tick_s!r}")
        idle_tick_s = max(2.0, unlent_tick_s) if idle_tick_s is None else idle_tick_s
        if not max_tick_s <= idle_tick_s < math.inf:
            raise ValueError(f"idle tick must be finite and >= max_tick_s ({max_tick_s!r} s), "
                             f"got {idle_tick_s!r}")
        if not (type(nvml_poll_periods) is int and 1 <= nvml_poll_periods <= 10):
            raise ValueError(f"NVML poll periods must be an integer from 1 to 10, got "
                             f"{nvml_poll_periods!r}")
        # NVML is asked once every this many of its sample periods (it keeps the samples in
        # between, and a call costs about 2 ms of CPU on an H200 however many it returns)
        self.nvml_poll_periods = nvml_poll_periods
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
        # per GPU: the host pids its last samples named (who is alive, `Attributor.end_tick`)
        self._sampled_pids: dict[str, set[int]] = {}
        self._sampled_now = False  # some GPU was sampled this tick
        self.params = params or ControlParams()
        # the law's tuning where a time-sliced GPU's use is split among containers
        self._split_params = replace(self.params, confirm_surprises=False)
        self.law = law
        if law is control_step_native and not NATIVE:
            log.warning("throttle_law_not_native", reason=NOT_NATIVE_REASON, law="python")
        # the common path of each device's steering in C where it was built (see `_steer_gpu`)
        self.native_steering = NATIVE_STEERING
        if not NATIVE_STEERING:
            log.warning("throttle_steering_not_native", reason=NOT_NATIVE_STEERING_REASON,
                        steering="python")
        if not NATIVE_READ:
            log.warning("throttle_read_not_native", reason=NOT_NATIVE_READ_REASON, read="python")
        elif NOT_BATCH_READ_REASON is not None:
            log.warning("throttle_batch_read_not_native", reason=NOT_BATCH_READ_REASON,
                        read="one region a call")
        if not NATIVE_SPLIT:
            log.warning("throttle_split_not_native", reason=NOT_NATIVE_SPLIT_REASON,
                        split="python")
        self.clock = clock
        self.ticks = 0
        self.errors: dict[str, int] = defaultdict(int)
        self._states: dict[str, dict[str, LoopState]] = {}  # uuid -> key -> state
        self._devices: dict[str, _Device] = {}  # key -> device followed
        # `status` as built since the last tick: the backstop asks every round and each
        # scrape asks too, and it only changes when a tick ends
        self._status: Mapping[tuple[str, int], DeviceStatus] | None = None
        # id(region) -> (region, its devices): the region is held so that its id stays its own
        self._by_region: dict[int, tuple[RegionHandle, list[_Device]]] = {}
        self._sample_clock = SampleClock(tick_s, nvml_poll_periods)
        # per GPU: the newest stamp that carried samples of two processes or more (else None:
        # the driver gives each period to one process, see `_utilization`)
        self._shared_us: dict[str, int] = {}
        self._sliced: dict[str, TimeSlicedSplit] = {}  # per time-sliced GPU (`_utilization`)
        # GPUs said to count busy beyond the work (for good: how the GPU counts, or a figure
        # taken light); turns alone come sooner there
        self._beyond_work_logged: set[str] = set()
        self._phase_changes_before: dict[str, int] = {}  # found by splits since dropped
        self._now_ns = 0
        # per GPU: host pid -> (alloc_id, stamp, SM percent) of its last sample
        self._recent: dict[str, dict[int, tuple[str, int, float]]] = {}
        # per time-sliced GPU: placements kept between the periods their processes are given
        self._held = HeldPlacements(self.ns_resolver.start_time)
        self._open_loop: set[str] = set()
        self.heartbeat_ns = round(heartbeat_s * 1e9)
        self._last_beat_ns: int | None = None
        self.max_tick_s, self.calm_ticks, self.inline_read_s = max_tick_s, calm_ticks, inline_read_s
        self.calm_target_points, self.calm_rate_fraction = 0.5, 0.02
        self.calm_pooled_at = CALM_POOLED_AT
        self.unlent_tick_s = unlent_tick_s
        self.interval_s = tick_s  # until the next tick: until the first GPU is due
        self._paces: dict[str, _Pace] = {}  # per GPU: its own tick (see the module note)
        self._due_now: set[str] = set()  # GPUs a watched device woke: due at the next tick
        # GPUs a device's launch costs woke: ticked at `max_tick_s` from there (see `_pace`)
        self._quicken: set[str] = set()
        self._present: set[str] = set()  # GPUs some region has a device on, as of this tick
        self._layout: _Layout | None = None  # the last tick's regions by GPU
        self._remapped = True  # this tick's regions were not the last tick's
        # the GPUs of a region that could not be read this tick (all of them where its own
        # cannot be told): they may have to reclaim in a way only a tick sees
        self._unsure: set[str] | None = set()
        self._unread: list[RegionHandle] = []  # the regions that could not be read this tick
        # The GPU being steered: whether it may have to reclaim so (see the note), its devices
        # to look at between slow ticks (`watched_woke`, as `_Watch`: idle ones of a GPU that
        # lends or has one not yet throttled, for their spending; launching ones of a GPU
        # that does not lend, for their launches' cost: the devices steered, of which
        # `_pace` watches those where the GPU's next tick is far enough for a look between),
        # and whether it saw a change.
        self._lent = False
        self._watching: list[_Watch] = []
        self._launching: list[tuple[_Device, int, int]] = []
        self._changed = False
        # the watched devices of the GPUs whose next tick is further than `max_tick_s`
        self._watched: list[_Watch] = []
        self._looked_ns = 0  # when they were last looked at
        self._looks = 0  # times they were looked at
        self._inline = False  # whether the last reads were cheap enough to do on the loop
        self.hops = 0  # ticks whose reads went to a worker thread
        # per GPU: NVML's per-process utilization calls made, and the seconds they took
        self._nvml_calls: dict[str, tuple[int, float]] = {}
        self.idle_tick_s = idle_tick_s
        self._idle = False  # the last tick found no region: sleep until `wake` or idle_tick_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None
        # id(region) -> (region, its processes as last read): read when a sample needs them
        self._procs: dict[int, tuple[RegionHandle, tuple[ProcessUsage, ...]]] = {}
        self._procs_read_ns: dict[str, int] = {}  # per GPU: when its slots were last read
        # per GPU: host pid -> when to try again to place it (samples of no known container)
        self._strangers: dict[str, dict[int, int]] = {}
        self._stranger_watch = StrangerWatch()  # GPUs whose use goes only to strangers
        # What time-sliced splits learned of containers alone, kept across agent restarts:
        # the figures of the last run not yet taken by a split, and those last saved.
        self._figure_file = figure_file
        self._restored: Figures = {}
        if figure_file is not None:
            self._restored = figure_file.load()
            if self._restored:
                log.info("throttle_figures_restored", path=str(figure_file.path),
                         gpus=len(self._restored),
                         figures=sum(len(held) for held in self._restored.values()))
        self._figures_saved: Figures = dict(self._restored)
        self._figures_saved_ns: int | None = None
        # per time-sliced GPU: turns alone for containers never seen alone (`soloturn`)
        self.solo_turns = solo_turns
        self._turnkeeper = TurnKeeper(self.params, self._apply, solo_turn_spare_priority,
                                      figure_max_age_s)

    # -- read-only views for metrics ---------------------------------------------------------
    @property
    def status(self) -> Mapping[tuple[str, int], DeviceStatus]:
        """Per (alloc_id, region device index): the last decision (built once per tick; the
        mapping is shared, not to be changed)."""
        if self._status is None:
            self._status = self._build_status()
        return self._status

    def _build_status(self) -> Mapping[tuple[str, int], DeviceStatus]:
        out: dict[tuple[str, int], DeviceStatus] = {}
        # (a container that spent while the GPU's use went only to strangers was steered by no
        # measurement either: its own series says so, not its idle neighbours')
        unmeasured = {uuid: self._stranger_watch.unmeasured(uuid)
                      for uuid in self._stranger_watch.reported}
        for d in list(self._devices.values()):
            if d.last is None:
                continue
            obs, decision, open_loop = d.last
            open_loop = open_loop or d.alloc_id in unmeasured.get(d.uuid, ())
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
                paused=d.paused,
            )
        return out

    @property
    def open_loop_gpus(self) -> frozenset[str]:
        return frozenset(self._open_loop)

    @property
    def time_sliced_gpus(self) -> frozenset[str]:
        """GPUs whose NVML samples are read as time-sliced now: each period whole to one
        process, the use split out by tokens (with one process running the two readings
        agree, and it is read so until a stamp with two processes that both used the GPU
        shows otherwise)."""
        return frozenset(self._sliced)

    @property
    def use_only_strangers_gpus(self) -> frozenset[str]:
        """GPUs whose busy NVML samples have gone only to processes no container claims,
        while containers spent, for longer than the hold (`throttle/strangers.py`): none of
        their containers can be measured."""
        return self._stranger_watch.reported

    @property
    def phase_changes(self) -> Mapping[str, int]:
        """Per GPU, the changes of phase the time-sliced split found since start."""
        found = dict(self._phase_changes_before)
        for uuid, split in self._sliced.items():
            found[uuid] = found.get(uuid, 0) + split.restarts
        return found

    @property
    def use_charged_to_nobody(self) -> Mapping[str, float]:
        """Per time-sliced GPU, the points of its use at the last batch of samples that its
        containers' tokens did not explain (at what each one's bought alone) and that nobody
        was charged (`TimeSlicedSplit`); 0 where all of it was charged."""
        return {uuid: split.uncharged for uuid, split in self._sliced.items()}

    @property
    def nvml_sample_periods(self) -> Mapping[str, float]:
        """Per GPU read so far, NVML's sample period in seconds as its stamps show it (the
        evidence a reading stands for; on a time-sliced GPU, whether a turn alone fits:
        `soloturn.turn_fits`)."""
        return self._sample_clock.periods_s()

    @property
    def nvml_poll_periods_now(self) -> Mapping[str, int]:
        """Per GPU read so far, NVML's sample periods between two asks now: `nvml_poll_periods`
        where its estimates are tight, 1 where it is asked every period (see the module note)."""
        return self._sample_clock.poll_periods_now()

    @property
    def nvml_utilization_calls(self) -> Mapping[str, tuple[int, float]]:
        """Per GPU asked so far, NVML's per-process utilization calls made (failed ones too) and
        the seconds they took: on a real driver, what the samples cost the node."""
        return dict(self._nvml_calls)

    @property
    def solo_turns_given(self) -> Mapping[str, int]:
        """Per GPU, the turns alone given since start (`throttle/soloturn.py`)."""
        return dict(self._turnkeeper.given)

    @property
    def unmeasured_containers(self) -> Mapping[str, int]:
        """Per time-sliced GPU, the containers spending at its last batch of samples without a
        trusted figure of their own (never seen alone, or their figure in doubt): their shares
        rest on the costs their periods show until a turn alone measures them."""
        sliced, awaiting = self._sliced, self._turnkeeper.awaiting
        return {uuid: count for uuid, count in list(awaiting.items()) if uuid in sliced}

    @property
    def solo_turn_spare_priority(self) -> int | None:
        """Containers of this priority or more are never paused for a turn alone (None:
        none)."""
        return self._turnkeeper.spare_priority

    @solo_turn_spare_priority.setter
    def solo_turn_spare_priority(self, at_least: int | None) -> None:
        self._turnkeeper.spare_priority = at_least

    @property
    def figure_max_age_s(self) -> float:
        """A trusted figure this old is measured afresh in a turn alone (0: never by age)."""
        return self._turnkeeper.figure_max_age_s

    def _new_split(self, uuid: str) -> TimeSlicedSplit:
        split = self._sliced[uuid] = TimeSlicedSplit()
        split.adopt(self._restored.pop(uuid, {}))
        return split

    async def _save_figures(self, regions: list[RegionHandle], now_ns: int) -> None:
        """Every FIGURES_SAVE_S at most, the splits' figures (and those restored for GPUs not
        split yet, of containers still here) to the figure file, where they moved."""
        if self._figure_file is None or (
                self._figures_saved_ns is not None
                and now_ns - self._figures_saved_ns < FIGURES_SAVE_S * 1e9):
            return
        self._figures_saved_ns = now_ns
        here = {_alloc_id(region) for region in regions}
        figures: Figures = {uuid: {a: f for a, f in held.items() if a in here}
                            for uuid, held in self._restored.items()}
        figures |= {uuid: split.figures() for uuid, split in self._sliced.items()}
        figures = {uuid: held for uuid, held in figures.items() if held}
        if not _figures_moved(self._figures_saved, figures):
            return
        try:
            await asyncio.to_thread(self._figure_file.save, figures)
        except Exception:
            self._failed("figures_save", "throttle_figures_save_failed",
                         path=str(self._figure_file.path))
            return
        self._figures_saved = figures

    def _drop_split(self, uuid: str) -> None:
        split = self._sliced.pop(uuid, None)
        if split is not None and split.restarts:
            self._phase_changes_before[uuid] = (
                self._phase_changes_before.get(uuid, 0) + split.restarts)

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
    def wake(self) -> None:
        """A region was added: tick now, whether the loop sleeps for want of regions or
        between calm ticks (a new container is followed before it launches), though no sooner
        than `tick_s` after the last tick. Safe from any thread (regions may be built in a
        worker thread)."""
        loop, woken = self._loop, self._woken
        if loop is None or woken is None:
            return  # not running yet: the first tick comes at once anyway
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            woken.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(woken.set)

    async def run(self) -> None:
        """Tick until cancelled; a slow tick shortens the next sleep rather than drifting.
        Without regions it sleeps until `wake` (or `idle_tick_s`, should a wake be missed)."""
        loop = self._loop = asyncio.get_running_loop()
        woken = self._woken = asyncio.Event()
        next_at = loop.time()
        try:
            while True:
                woken.clear()  # a region added during the tick ends the sleep at once
                started = loop.time()
                try:
                    await self.tick(paced=True)
                except Exception:  # the loop must survive anything one tick throws
                    self._failed("tick", "throttle_tick_failed")
                    self._status = None  # whatever the tick decided before it failed
                if self._idle:
                    await _nap(woken, self.idle_tick_s)
                    next_at = loop.time()
                    continue
                next_at = max(next_at + self.interval_s, loop.time())
                # A region added (`wake`) or an idle container that spent ends the sleep: a
                # new container is followed before it launches, however slow the calm tick ...
                watch_s = self.watch_s
                while watch_s is not None and next_at - loop.time() > watch_s:
                    if await _nap(woken, watch_s) or await self._watched_woke_in_chunks():
                        next_at = loop.time()
                        break
                if next_at > loop.time() and await _nap(woken, next_at - loop.time()):
                    next_at = loop.time()
                # ... but no sooner than `tick_s` after the last tick began (a kubelet adding
                # containers one after another must not tick the controller at its pace)
                if started + self.tick_s > loop.time():
                    await asyncio.sleep(started + self.tick_s - loop.time())
        finally:
            self.end_turns()  # no container is left paused by a turn alone
            self._loop = self._woken = None

    async def tick(self, paced: bool = False) -> None:
        """Steer the GPUs: each whose own next tick has come where `paced` (as `run` ticks),
        every one otherwise (a tick at a fixed rate, as the simulator's unpaced runs)."""
        if paced and self._watched \
                and self.clock() - self._looked_ns >= self.max_tick_s * 1e9 * (1 - 1e-9):
            # the watched containers of GPUs not due are looked at as between ticks (before
            # the tick's clock is read: the look's reads take time too); unpaced, every GPU is
            # steered now
            await self._watched_woke_in_chunks()
        now_ns = self._now_ns = self.clock()
        self.ticks += 1
        try:
            regions = list(self.regions())
        except Exception:
            self._failed("list_regions", "throttle_list_regions_failed")
            return
        self._idle = not regions
        self._unsure, self._unread = set(), []
        due, to_read = self._due_gpus(regions, now_ns, paced)
        by_gpu: dict[str, _Entries] = defaultdict(list)
        for start in range(0, len(to_read), READ_CHUNK):
            if start:
                await asyncio.sleep(0)  # Allocate and scrapes wait for a chunk's reads at most
            self._gather(to_read[start : start + READ_CHUNK], by_gpu, due)
        sampled: dict[str, _Sampled] = {}
        if by_gpu:
            # NVML's calls block (about 2 ms each on a real driver, longer when it is in
            # trouble): in a worker thread while they are slow, inline while they cost less
            # than the hop.
            # (The worker is handed the GPUs' names only: it may drop its arguments a while
            # after its result is back, and would hold the tick's readings that long.)
            uuids = tuple(by_gpu)
            if self._inline:
                sampled, took = self._sample(uuids)
            else:
                self.hops += 1
                sampled, took = await asyncio.to_thread(self._sample, uuids)
            calls = self._nvml_calls  # (counted here, on the loop: the worker only reports)
            for uuid, seconds in took.items():
                made, spent_s = calls.get(uuid, (0, 0.0))
                calls[uuid] = (made + 1, spent_s + seconds)
        steered: dict[str, _Steered] = {}
        for n, (uuid, entries) in enumerate(by_gpu.items()):
            if n:
                # One GPU at a time on the loop: Allocate and scrapes wait for one GPU's
                # steering at most, not for the whole tick's.
                await asyncio.sleep(0)
            # A region collected meanwhile is closed now: skipped, not an error.
            entries[:] = [e for e in entries if not e[0].region.closed]
            samples = self._samples(uuid, sampled[uuid])
            pace = self._paces.get(uuid)
            dt_s = self.tick_s if pace is None else (now_ns - pace.steered_ns) / 1e9
            unsure = self._unsure
            self._changed, self._watching, self._launching = False, [], []
            self._lent = unsure is None or uuid in unsure
            try:
                self._steer_gpu(uuid, entries, samples, max(dt_s, 1e-3))
            except Exception:
                self._lent = True  # not known: watched as closely as a lending GPU
                self._failed("gpu", "throttle_gpu_failed", uuid=uuid)
            steered[uuid] = (self._changed, self._lent, self._watching, self._launching)
        regions = [r for r in regions if not r.closed]
        if self._last_beat_ns is None or now_ns - self._last_beat_ns >= self.heartbeat_ns:
            self._last_beat_ns = now_ns
            for region in regions:
                try:
                    region.beat(now_ns)
                except Exception:
                    self._failed("beat", "throttle_beat_failed", alloc_id=_alloc_id(region))
        changed = self._forget(regions, by_gpu, due, to_read)
        if self._sampled_now:  # ticks without new samples say nothing about who is alive
            self._sampled_now = False
            live = set().union(*self._sampled_pids.values())
            self.ns_resolver.forget_except(live)
            # each region's slot reads sized by the processes placed in it (on host evidence)
            placed: dict[str, int] = defaultdict(int)
            for recent in self._recent.values():
                for alloc_id, _, _ in recent.values():
                    placed[alloc_id] += 1
            self.attributor.end_tick(live, regions, placed)
        self._status = None  # built afresh from this tick's decisions when next asked
        self._pace(now_ns, due, steered, changed)
        await self._save_figures(regions, now_ns)

    def _due_gpus(self, regions: list[RegionHandle], now_ns: int, paced: bool
                  ) -> tuple[set[str], list[RegionHandle]]:
        """The GPUs this tick steers, and the regions it reads for them. Unless `paced`, all.
        Paced: each GPU whose own next tick has come (within half a `tick_s`, so that GPUs on
        one pace share ticks) or that ticks at `tick_s`, the GPUs of a region not seen before,
        those an idle container woke on; every region with a device on one of them. Sets
        `_present`."""
        key = [id(region) for region in regions]
        layout = self._layout
        self._remapped = layout is None or layout.key != key
        if layout is None or self._remapped:
            layout = self._layout = self._map_regions(regions, key)
        present = self._present = layout.present
        due, self._due_now = self._due_now, set()
        if paced:
            paces, fast_s = self._paces, self.tick_s * (1 + 1e-9)
            soon_ns = now_ns + round(self.tick_s * 5e8)
            for uuid in present:
                pace = paces.get(uuid)
                if pace is None or pace.interval_s <= fast_s or pace.due_ns <= soon_ns:
                    due.add(uuid)
        else:
            due |= present
        if layout.unknown:
            due |= layout.fresh
            self._layout = None  # known once read: mapped afresh at the next tick
        if present <= due:
            return due, regions
        chosen = set(layout.unknown)
        for uuid in due:
            chosen.update(layout.on_gpu.get(uuid, ()))
        return due, [regions[n] for n in sorted(chosen)]

    def _map_regions(self, regions: list[RegionHandle], key: list[int]) -> _Layout:
        """Which regions have a device on which GPU, as far as the devices are known."""
        layout = _Layout(key)
        for n, region in enumerate(regions):
            if region.closed:
                continue
            known = self._by_region.get(id(region))
            if known is None or known[0] is not region:
                # New (or reopened): read now, and its GPUs steered with it. One whose devices
                # cannot be told is read all the same (the read reports it).
                try:
                    uuids = set(region.device_uuids)
                except Exception:
                    uuids = set()
                layout.fresh |= uuids
                layout.present |= uuids
                layout.unknown.append(n)
                continue
            for device in known[1]:
                layout.present.add(device.uuid)
                on_gpu = layout.on_gpu.setdefault(device.uuid, [])
                if not on_gpu or on_gpu[-1] != n:
                    on_gpu.append(n)
        return layout

    def _pace(self, now_ns: int, due: set[str],
              steered: Mapping[str, _Steered],
              changed: set[str]) -> None:
        """Each GPU's interval to its next tick (see the module note), and the loop's: until
        the first GPU is due."""
        paces = self._paces
        for uuid in [u for u in paces if u not in self._present]:
            del paces[uuid]
        quicken, self._quicken = self._quicken & due, self._quicken - due
        # the calm a GPU's interval is `max_tick_s` at (the steps below, the other way)
        quick_calm_s = (max(1.0, self.max_tick_s / self.tick_s) - 1) \
            * self.calm_ticks * self.tick_s
        share_ns = round(self.tick_s * 5e8)  # GPUs due within it share a tick (`_due_gpus`)
        beyond_ns = now_ns + round(self.max_tick_s * 1e9)  # a look between ticks before it
        for uuid in due & self._present:
            # a GPU none of whose devices could be steered is not known to be calm
            gpu_changed, lent, watching, launching = steered.get(uuid, (False, True, [], []))
            pace = paces.get(uuid)
            if pace is None:
                pace = paces[uuid] = _Pace(self.tick_s)
            pace.calm_s = 0.0 if gpu_changed or uuid in changed else pace.calm_s + pace.interval_s
            if uuid in quicken:
                # Its launches cost other tokens: a change of phase that NVML's next samples
                # will show, maybe after this tick's (a second apart on some GPUs). Ticks of
                # `max_tick_s` until then, as where something is lent; no faster (a tenant
                # flipping its kernels must not buy its GPU fast ticks).
                pace.calm_s = min(pace.calm_s, quick_calm_s)
            # a hair under the span, so that float sums of intervals reach it on time
            steps = int(pace.calm_s / (self.calm_ticks * self.tick_s) + 1e-9)
            ceiling = self.max_tick_s if lent else self.unlent_tick_s
            wanted_s = self.tick_s * (1 + steps)
            pace.interval_s = min(ceiling, wanted_s)
            interval_ns = round(pace.interval_s * 1e9)
            if wanted_s >= ceiling * (1 - 1e-9) and ceiling > self.tick_s * (1 + 1e-9):
                pace.due_ns = on_grid(now_ns, interval_ns, share_ns)
            else:
                pace.due_ns = now_ns + interval_ns
            pace.steered_ns = now_ns
            if launching and pace.due_ns > beyond_ns:
                _watch_launch_costs(watching, launching)
            pace.watching = watching
        for uuid in changed - due:
            # a container gone from a GPU not steered this tick: its share is to be lent
            pace = paces.get(uuid)
            if pace is not None:
                pace.calm_s, pace.interval_s = 0.0, self.tick_s
                pace.due_ns = min(pace.due_ns, now_ns + round(self.tick_s * 1e9))
        first_ns = min([pace.due_ns for pace in paces.values()], default=None)
        self.interval_s = (self.tick_s if first_ns is None
                           else max(0.0, (first_ns - now_ns) / 1e9))
        self._watched = [w for pace in paces.values() if pace.due_ns > beyond_ns
                         for w in pace.watching]

    @property
    def watch_s(self) -> float | None:
        """How often, until the next tick, the watched devices should be looked at
        (`watched_woke`); None when there is nothing to look at or the next tick comes as soon."""
        return self.max_tick_s if self._watched and self.interval_s > self.max_tick_s else None

    def watched_woke(self) -> bool:
        """Whether a container that was idle at the last tick (its share lent to others, or
        not yet throttled) has spent since for more than its demand then, or one that launched
        now launches at another cost (`_launch_cost_moved`): the next tick should come now, so
        that what is lent comes back, and a change of phase is steered, as soon as at
        `max_tick_s` ticks. One header read per watched device; a region that cannot be read
        says yes (the tick will see)."""
        self._looks += 1
        return self._woke_among(self._watched)

    async def _watched_woke_in_chunks(self) -> bool:
        """`watched_woke` on the loop, yielding between chunks of reads as the tick does: a node
        of watched containers must not hold Allocate and scrapes for all their reads at once."""
        watched, woke = self._watched, False
        self._looks += 1
        for start in range(0, len(watched), READ_CHUNK):
            if start:
                await asyncio.sleep(0)
            woke = self._woke_among(watched[start : start + READ_CHUNK]) or woke
        return woke

    def _woke_among(self, watched: list[_Watch]) -> bool:
        """Whether any of `watched` woke (an idle one spent for more than its demand, a
        launching one's launches cost other tokens); the GPU of each that did is due at the
        next tick. A device watched only for its launches is read at one look in
        `LAUNCH_LOOKS`, its own turn among them (`_Device.turn`)."""
        now = self._looked_ns = self.clock()
        woke = self._due_now
        skip = self._looks % LAUNCH_LOOKS
        for device, k, demand, per_launch in watched:
            region = device.region
            if region.closed or device.uuid in woke or (
                    demand == math.inf and device.turn % LAUNCH_LOOKS != skip):
                continue
            previous, read_ns = device.previous, device.read_ns
            try:
                counters = _counters(region, peek=True)
            except Exception:
                woke.add(device.uuid)
                continue
            if counters is None or previous is None or read_ns is None:
                woke.add(device.uuid)
                continue
            at = 3 * device.dev
            if demand < math.inf:
                spent = counters[at] - previous[0]
                seconds = (now - read_ns) / 1e9
                if spent and (spent < 0 or k <= 0 or seconds <= 0
                              or spent / seconds / k > demand):
                    woke.add(device.uuid)
                    continue
            if per_launch > 0 and _launch_cost_moved(device, counters[at], counters[at + 1],
                                                     per_launch):
                woke.add(device.uuid)
                self._quicken.add(device.uuid)
        return bool(woke)

    def _sample(self, uuids: tuple[str, ...]) -> tuple[dict[str, _Sampled], dict[str, float]]:
        """The new samples of every GPU in `uuids`, once their regions were read (in a worker
        thread when slow), and the seconds each GPU's call took (the GPUs asked only)."""
        sampled: dict[str, _Sampled] = {}
        took: dict[str, float] = {}
        clock = self._sample_clock
        for uuid in uuids:
            if not clock.due(uuid, self._now_ns):
                sampled[uuid] = []  # NVML's next period is not over: nothing new to ask for
                continue
            started = time.perf_counter()
            try:
                sampled[uuid] = self.backend.process_utilization(uuid, clock.since_us(uuid))
            except Exception as e:  # judged on the event loop, with the others
                sampled[uuid] = e
            took[uuid] = time.perf_counter() - started
        if took:
            # Cheap only if a tick that asks every GPU would be: a tick that asked one or
            # none says nothing of the next one that asks all (8 GPUs at 2 ms is 16 ms).
            per_call_s = sum(took.values()) / len(took)
            self._inline = per_call_s * len(uuids) < self.inline_read_s
        return sampled, took

    def _gather(self, regions: list[RegionHandle], by_gpu: dict[str, _Entries],
                due: set[str]) -> None:
        """Each region's counters and controls, added to its devices' GPUs in `by_gpu` where
        they are `due`."""
        tick, clock = self.ticks, self.clock
        # On the monotonic clock, the headers and the rates in force in one native call, each
        # header between its own stamps (those it cannot take are read one by one below): a
        # region's Python calls cost the node more than its pread.
        read_all = (getattr(type(regions[0]), "readings_together", None)
                    if regions and clock is time.monotonic_ns else None)
        together: list[Any] = [None] * len(regions)
        if read_all is not None:
            try:
                together = read_all(regions)
            except Exception:  # each read on its own then, its failures its own
                self._failed("region_usage", "throttle_region_batch_read_failed")
        for region, reading in zip(regions, together, strict=True):
            # A region that cannot be read is not steered this tick, and what it does is not
            # known: the tick is kept as short as where something is lent. Its devices are
            # followed only once it reads: a header corrupt for good is no change every tick.
            # (A batch reading is of a region open when read: nothing ran since.)
            if reading is None:
                if region.closed:
                    continue
                reading = self._read_alone(region)
                if reading is None:
                    continue
            elif reading[0] is None:
                self._unsure_of(region)
                self.errors["region_corrupt"] += 1
                continue
            try:
                devices = self._devices_of(region)
            except Exception:
                self._unsure_of(region)
                self._failed(
                    "region_usage", "throttle_region_unreadable", alloc_id=_alloc_id(region)
                )
                continue
            for device in devices:
                device.seen = tick
                if device.uuid in due:
                    by_gpu[device.uuid].append((device, reading))

    def _read_alone(self, region: RegionHandle) -> _RegionReading | None:
        """One region's reading outside a batch: (counters, rates, policies, priority, and the
        clock just before and after its counters were read); None where it could not be read
        (counted, and its GPUs not known to be calm this tick)."""
        # When this region's counters were read (the moment lies between the two stamps), not
        # when the tick's reads began: a reader stalled halfway (a loaded node, a CPU-limited
        # agent) must not make the regions read after the stall look as if they had spent more
        # than their buckets let through.
        clock = self.clock
        try:
            # (`_counters`'s lean read called here: a call less for each region a tick)
            lean = getattr(region, "counters", None)
            read_from = clock()
            counters = lean() if lean is not None else _counters(region)
            read_until = clock()
            if counters is None:
                self._unsure_of(region)
                self.errors["region_corrupt"] += 1
                return None
            devices = len(self._devices_of(region))
        except Exception:
            self._unsure_of(region)
            self._failed(
                "region_usage", "throttle_region_unreadable", alloc_id=_alloc_id(region)
            )
            return None
        try:
            lean = getattr(region, "controls", None)
            rates, policies, priority = (lean() if lean is not None
                                         else _controls(region, devices))
        except Exception:
            if not region.closed:  # collected meanwhile: not an error
                self._unsure_of(region)
                self._failed("region_read", "throttle_region_read_failed",
                             alloc_id=_alloc_id(region))
            return None
        return (counters, rates, policies, priority, read_from, read_until)

    def _unsure_of(self, region: RegionHandle) -> None:
        """A region could not be read: its GPUs are not known to be calm this tick, and its
        devices are dropped at its end (`_forget`)."""
        self._unread.append(region)
        known = self._by_region.get(id(region))
        if known is not None and known[0] is region:
            uuids = {device.uuid for device in known[1]}
        else:
            try:
                uuids = set(region.device_uuids)
            except Exception:
                uuids = set()
        if self._unsure is not None:
            if uuids:
                self._unsure |= uuids
            else:
                self._unsure = None  # whose, not known: every GPU steered this tick

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
                device.last, device.read_ns = before.last, before.read_ns
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
            outcome = self._sample_clock.accepted(uuid, outcome)
        return outcome

    def _resolver_failed(self, pid: int) -> None:
        self._failed("pid_resolver", "throttle_pid_resolver_failed", pid=pid)

    def _utilization(
        self, uuid: str, entries: _Entries, samples: list[ProcessSample] | None,
        spent: Mapping[str, int], dt_s: float = 0.0, untrusted: Collection[str] = (),
        solo: str = "",
    ) -> tuple[Mapping[str, float | None], float, int] | None:
        """SM percent per alloc_id from this tick's samples (None for one that spent while
        none of its processes was listed), the seconds they describe and how many samples per
        process they average; None when nothing new arrived. `spent` is the
        tokens each container is believed to have spent in the tick (`audit.believed_spend`),
        which lasted `dt_s` (the split learns use per token from it; 0: not known);
        `untrusted` those whose claims were lately cut, `solo` the container given a turn
        alone (`TimeSlicedSplit.share`).

        Drivers attribute a sample period in one of two ways, told apart by what they send:
        - per process: each process that ran gets a sample of its own use, all with the
          period's stamp. A process that had samples lately but none in this batch (NVML
          missed it) counts with its last value: a missed sample is not an idle process.
        - time-sliced (seen on an H200, driver 580, two processes without MPS): each period's
          one sample goes to one of the processes that ran, and its value is the whole GPU's
          use in it, whoever did the work; read after several periods, one sample per process
          given any of them, together worth the use over all of them
          (`timesliced.read_as_periods`). `timesliced.TimeSlicedSplit` shares that use out.
        The GPU is read as time-sliced until a stamp with two processes or more that both
        used the GPU is seen, and again PER_PROCESS_HOLD_S (at least SHARED_PERIODS periods)
        after the last such stamp; with one process running the two readings agree. A process
        listed at 0 beside the one that ran proves nothing (the simulated time-sliced driver
        lists them so, and a real one may; taken as proof, the next periods, given whole to one
        process, read as per-process use starved a borrower cut back when its owner woke), and
        it was not given the period.
        A process placed once stays placed while it keeps appearing; only a new one makes the
        controller read slots.
        """
        if not samples:
            return None
        util = {device.alloc_id: 0.0 for device, _ in entries}
        per_pid: dict[int, list[int]] = defaultdict(list)
        at: dict[int, list[tuple[int, int]]] = defaultdict(list)  # stamp -> (pid, value)
        for s in samples:
            per_pid[s.pid].append(s.sm_util)
            at[s.timestamp_us].append((s.pid, s.sm_util))
        self._sampled_pids[uuid] = set(per_pid)
        self._sampled_now = True
        clock = self._sample_clock
        before_us = clock.newest_us(uuid)
        span_s, count = clock.span(uuid, samples, self._now_ns)
        newest = max(at)  # what `span` took as the newest stamp
        period_us = clock.period_us(uuid) or 1_000_000
        # Only two processes that both used the GPU in one period prove per-process samples:
        # a time-sliced driver may list an idle process beside the one it gave the period to.
        shared = [stamp for stamp, seen in at.items() if sum([v > 0 for _, v in seen]) > 1]
        if shared:
            self._shared_us[uuid] = max(shared)
        last_shared = self._shared_us.get(uuid)
        sliced = last_shared is None or newest - last_shared > max(
            SHARED_PERIODS * period_us, PER_PROCESS_HOLD_US)
        if not sliced:
            self._drop_split(uuid)
        recent = self._recent.setdefault(uuid, {})
        unplaced: list[tuple[int, float]] = []
        seen: set[str] = set()  # containers with a process in the samples (or carried)
        held = self._held
        for pid, values in per_pid.items():
            value = min(100.0, max(0.0, sum(values) / len(values)))
            placed = recent.get(pid)
            found = placed[0] if placed is not None else None
            if sliced:
                # named again after the periods others were given: the same process?
                if found is None:
                    found = held.take(uuid, pid, newest)
                else:
                    held.named(uuid, pid, newest)
            if found is not None and found in util:
                util[found] += value
                seen.add(found)
                recent[pid] = (found, newest, value)
            else:
                unplaced.append((pid, value))
        if unplaced:
            for pid, value, found in self._place(uuid, entries, unplaced):
                if found in util:
                    util[found] += value
                    seen.add(found)
                    recent[pid] = (found, newest, value)
                    if sliced:
                        held.keep(uuid, pid, found, newest)
                else:
                    recent.pop(pid, None)
        if sliced:
            held.prune(uuid, newest, util.keys())
        else:
            held.forget(uuid)
        self._watch_strangers(uuid, per_pid, recent, newest, spent)
        # a time-sliced process may go unsampled for several periods while others take them
        stale_us = newest - (SHARED_PERIODS if sliced else 3) * period_us
        for pid, (alloc_id, stamp, value) in list(recent.items()):
            if pid in per_pid:
                continue
            if stamp < stale_us or alloc_id not in util:
                del recent[pid]
            elif not sliced:
                util[alloc_id] += value
                seen.add(alloc_id)
        if sliced:
            owner = {pid: placed[0] for pid, placed in recent.items()}
            split = self._sliced.get(uuid) or self._new_split(uuid)
            # the periods since the last read: more than one where a tick came late or slow
            periods = round((newest - before_us) / period_us) \
                if before_us is not None and newest > before_us else 1
            given, busy = read_as_periods(at, owner, periods)
            if not busy and any(spent.values()):
                # every process listed idle while containers spent: a sample NVML missed (the
                # busy one absent), not an idle GPU; read as idle, its spending k would halve
                return None
            util = split.share(given, busy, spent, dt_s, untrusted, solo,
                               self._per_launch(uuid, spent))
            if split.counts_beyond and split.beyond_work \
                    and uuid not in self._beyond_work_logged:
                self._beyond_work_logged.add(uuid)
                log.warning("throttle_gpu_busy_beyond_work", uuid=uuid,
                            busy=round(split.beyond_work[0], 1),
                            explained=round(split.beyond_work[1], 1),
                            detail="the use the containers' tokens do not explain is charged "
                                   "to nobody")
            for alloc_id in sorted(split.newly_left_out):
                log.warning("throttle_figure_left_out", uuid=uuid, alloc_id=alloc_id,
                            detail="its figure from its turn alone is far heavier than the "
                                   "others' agree on beside the periods: it is charged at "
                                   "least at it, sets nobody else's charge, and is measured "
                                   "afresh once should that last (a change of phase, or "
                                   "kernels run heavier while alone)")
            return util, span_s, count
        # A container that spent, none of whose processes NVML listed (not placed yet, or
        # missed for several periods), was not measured: no reading, rather than a 0 the law
        # would take for a process seen idle. One that spent nothing reads 0: it is idle.
        measured: dict[str, float | None] = dict(util)
        for alloc_id in util.keys() - seen:
            if spent.get(alloc_id, 0) > 0:
                measured[alloc_id] = None
        return measured, span_s, count

    def _watch_strangers(self, uuid: str, per_pid: Mapping[int, list[int]],
                         recent: Mapping[int, tuple[str, int, float]], newest: int,
                         spent: Mapping[str, int]) -> None:
        """Tells the operator, once per episode, of a GPU whose busy samples go only to
        processes no container claims while containers spend (`throttle/strangers.py`)."""
        ours_busy = False
        strangers: list[int] = []
        for pid, values in per_pid.items():
            if max(values) <= 0:
                continue
            placed = recent.get(pid)
            if placed is not None and placed[1] == newest:
                ours_busy = True
            else:
                strangers.append(pid)
        pids = self._stranger_watch.observe(uuid, self._now_ns,
                                            [alloc_id for alloc_id, v in spent.items() if v > 0],
                                            ours_busy, strangers)
        if pids:
            log.warning("throttle_use_only_strangers", uuid=uuid, pids=list(pids),
                        seconds=self._stranger_watch.hold_ns / 1e9,
                        detail="containers spend tokens, but NVML gives this GPU's use only to "
                               "processes no container claims (an MPS server, if the driver "
                               "counts its clients' work as its own; or a process outside "
                               "the cluster): the containers cannot be measured, and their "
                               "rates rest on guesses, not on what they use")

    def _place(
        self, uuid: str, entries: _Entries, unplaced: list[tuple[int, float]]
    ) -> list[tuple[int, float, str | None]]:
        """The containers of processes seen for the first time, on host evidence
        (`Attributor`). The slots, read afresh at most once a second per GPU, only supply the
        claims it checks. A process the host places in no container is not looked at again for
        a few seconds."""
        now = self._now_ns
        strangers = self._strangers.setdefault(uuid, {})
        wanted = [(pid, value) for pid, value in unplaced if strangers.get(pid, 0) <= now]
        if not wanted:
            return []
        fresh = now - self._procs_read_ns.get(uuid, -_SLOTS_EVERY_NS) >= _SLOTS_EVERY_NS
        owners = self.attributor.owners(self._claims(uuid, entries, fresh),
                                        [pid for pid, _ in wanted])
        placed: list[tuple[int, float, str | None]] = []
        for pid, value in wanted:
            found = owners.get(pid)
            if found is None:
                strangers[pid] = now + _STRANGER_RETRY_NS
            else:
                placed.append((pid, value, found))
        return placed

    def _claims(
        self, uuid: str, entries: _Entries, fresh: bool
    ) -> list[tuple[RegionHandle, RegionUsage]]:
        """Each region with the processes its slots claim, as last read (afresh with `fresh`)."""
        if fresh:
            self._procs_read_ns[uuid] = self._now_ns
        out: list[tuple[RegionHandle, RegionUsage]] = []
        for device, _ in entries:
            region = device.region
            cached = self._procs.get(id(region))
            if fresh or cached is None or cached[0] is not region:
                try:
                    usage = region.usage()
                    processes = () if usage.corrupt else usage.processes
                except Exception:
                    self._failed("region_usage", "throttle_region_unreadable",
                                 alloc_id=device.alloc_id)
                    processes = ()
                cached = (region, processes)
                self._procs[id(region)] = cached
            out.append((region, RegionUsage(processes=cached[1])))
        return out

    def _limits(self, device: _Device, policy: str, priority: int) -> tuple[float, CorePolicy]:
        """(limit, policy) of a device, given the policy and priority found in `control`, and
        remembered with them (`_steer_gpu` uses what is remembered while they stand). The
        limit is read from its region the first time (it never changes); the policy may change
        any tick, since the agent rewrites it when the pod's annotations change (see
        `throttle/regionpolicy.py`)."""
        limits = device.limits
        # a policy name from `control`, checked against the allowed ones
        checked = cast(CorePolicy, policy) if policy in CORE_POLICIES else self.default_policy
        limit = (
            limits[0] if limits is not None
            else min(100.0, max(1e-6, float(device.region.core_limit(device.dev))))
        )
        device.limits = (limit, checked, policy, priority)
        return limit, checked

    def _steer_gpu(
        self, uuid: str, entries: _Entries, samples: list[ProcessSample] | None, dt_s: float
    ) -> None:
        """One GPU's tick: observations from what was read, the law, the rates written.

        Per device, `_observe` (before the law) and `_settle` (after it) are the reference;
        where `_steerc` was built, it does what they do for devices on the common path (no
        first sight, no claim cut, no cap, an overuse watch that cannot fire on this reading)
        and hands the others to them, so that every device is steered as they would steer it
        (the tests compare the two).
        """
        # What each device spent, launched and waited since the last tick, as `state` says,
        # the tokens never more than its bucket can have let through (`throttle/audit.py`):
        # each observation's fields, its use and span filled in once measured.
        states = self._states.get(uuid, {})
        fields: list[list[object]] = []
        steered: list[tuple[_Device, int, int]] = []
        spent_by: dict[str, int] = {}
        liars: set[str] = set()
        keeper = self._turnkeeper
        solo = keeper.solo(uuid)
        turning = bool(solo)
        # (a turn alone pauses devices whose claims the audit must not judge: the reference)
        native = self.native_steering and not turning
        if native:
            _steerc.observe(entries, self._observe, states, fields, steered, spent_by, liars)
        else:
            for device, reading in entries:
                self._observe(device, reading, states, fields, steered, spent_by, liars)
        if turning and keeper.past_first_tick(uuid):
            # Past a turn's first tick (which counts what was spent before the pause), a
            # paused device's bucket lets nothing through: what its `state` claims is not
            # believed, and must not make the one measured look shared. (A second line: what
            # the audit's allowance lets a paused claim be believed, 3 tokens at the second
            # tick, falls in the turn's first periods, which the split does not count.)
            for device, _ in entries:
                if device.paused and device.alloc_id != solo:
                    spent_by[device.alloc_id] = 0
        # (on a time-sliced GPU: those lately caught claiming more than their buckets allowed)
        untrusted = [device.alloc_id for device, _ in entries if device.liar_cap is not None
                     or device.key in liars] if uuid in self._sliced else ()
        measured = self._utilization(uuid, entries, samples, spent_by, dt_s, untrusted, solo)
        if solo:
            # the readings of a turn alone say nothing of the shares: the law waits for its end
            self._changed = self._lent = True  # fast ticks until the turn ends and after
            why = keeper.over(uuid, self._sliced.get(uuid), spent_by, self._now_ns)
            if why is not None:
                self._end_turn(uuid, why)
            return
        if measured is not None:
            utils, span_s, count = measured
            for row, (device, _, _) in zip(fields, steered, strict=True):
                row[7], row[10], row[11] = utils[device.alloc_id], span_s, count
        observations: list[Observation] = [_new(Observation, row) for row in fields]
        for key in liars:
            # Its cold-start bound came from a tick no bucket limited, whose claims nothing
            # could check: from a container caught overclaiming, it proves nothing.
            state = states.get(key)
            if state is not None and state.k_floor > 0:
                states[key] = state._replace(k_floor=0.0)
        params = self.params
        sliced = uuid in self._sliced
        spending = sum([1 for spent in spent_by.values() if spent])
        split = sliced and spending > 1
        if split:
            # split shares are estimates, not NVML's skewed samples: a far-off one is the
            # split re-learning (a change of phase found), followed at once
            params = self._split_params
        decisions = self.law(observations, states, dt_s, params)
        learned = self._states[uuid] = {key: d.state for key, d in decisions.items()}
        if self.nvml_poll_periods > 1:
            # (a time-sliced GPU's periods read together lose who was given which: asked every
            # period where two containers or more spend there)
            self._sample_clock.every_period(uuid, split or _loose(learned.values())
                                            or _kernels_changed(observations, states))
        open_loop = uuid in self._open_loop
        # a reclaim may be needed at any moment that only a tick would see (see the module
        # note): a device not observed, limits that do not fit
        hard = self._lent or len(observations) < len(entries) \
            or sum([obs[1] for obs in observations]) > FULL_SHARE + _SHARE_EPS
        # where a GPU's use is split among many, each rate follows its share's noise: the
        # GPU's rates moving together is news, not one of them (see the module note)
        pooled = split and spending >= self.calm_pooled_at
        fraction = math.inf if pooled else self.calm_rate_fraction
        settle = functools.partial(self._settle, uuid, liars, sliced, split, open_loop, fraction)
        if native:
            self._changed, lent = _steerc.settle(
                observations, steered, decisions, liars, settle, self._apply, sliced,
                open_loop, self.calm_target_points, fraction, self._changed, hard)
        else:
            changed, lent = self._changed, hard
            for obs, entry in zip(observations, steered, strict=True):
                changed, lent = settle(obs, entry, decisions[obs[0]], changed, lent)
            self._changed = changed
        # calm as a crowd only: one rate of many moved (see the module note)
        crowd_calm = False
        if pooled and not self._changed:
            self._changed, crowd_calm = _rates_moved(steered, self.calm_rate_fraction)
        if lent and not hard:
            idle = _idle_devices(steered)
            if idle is None:
                self._lent = True
            else:
                self._watching.extend(idle)
        else:
            self._lent = lent
        if crowd_calm:
            self._lent = True  # no slower than `max_tick_s` (see the module note)
        if not self._lent:
            self._launching = steered  # watched for their launches' cost where ticks are slow
        if self.solo_turns and sliced and not liars and keeper.offer(
                uuid, self._sliced[uuid], steered, spent_by, self._now_ns,
                self._sample_clock.period_us(uuid) / 1e6, uuid in self._beyond_work_logged):
            self._changed = True

    def _per_launch(self, uuid: str, spent: Mapping[str, int]) -> dict[str, float] | None:
        """The tokens one launch costs (the law's `cost_per_launch`, the largest of its
        devices on the GPU) of the one container spending on it, which the split may be
        measuring alone; None where more than one spend."""
        lone = [alloc_id for alloc_id, used in spent.items() if used]
        if len(lone) != 1:
            return None
        devices, states = self._devices, self._states.get(uuid, {})
        return {lone[0]: max([state.cost_per_launch for key, state in states.items()
                              if key in devices and devices[key].alloc_id == lone[0]],
                             default=0.0)}

    def end_turns(self) -> None:
        """End every turn alone under way, writing the paused rates back (on stopping)."""
        for uuid in self._turnkeeper.gpus():
            self._end_turn(uuid, "stopping")

    def _end_turn(self, uuid: str, why: str) -> None:
        self._turnkeeper.end(uuid, why, self._now_ns, self._sliced.get(uuid), self._devices,
                             self._states.get(uuid))

    def _observe(self, device: _Device, reading: _RegionReading, states: Mapping[str, LoopState],
                 fields: list[list[object]], steered: list[tuple[_Device, int, int]],
                 spent_by: dict[str, int], liars: set[str]) -> None:
        """One device's observation from its region's reading, appended to `fields` (with the
        rate in force to `steered`), its believed spending added to `spent_by`, and its key
        to `liars` where its claim was cut.

        Built without `Observation`'s checks: every field is made valid here (counters from
        `state`, which a container may fake, only as differences clamped at 0 of values
        `layout.state_counters` bounds, the tokens never more than the bucket let through;
        limits and policies from `control`, which only the agent writes, the policy checked
        against the allowed names).
        """
        counters, rates, policies, priority, read_from, read_until = reading
        dev = device.dev
        at = 3 * dev
        now = counters[at : at + 3]
        if len(now) < 3:
            now = (0, 0, 0)
        previous, previous_ns = device.previous, device.read_ns
        device.previous, device.read_ns = now, read_from  # type: ignore[assignment]
        # The rate in force for the law, and what the write compares with (a rate changed
        # behind the agent's back, or left by its previous run, is seen and fixed).
        written_rate, written_burst = rates[2 * dev], rates[2 * dev + 1]
        rate, burst = written_rate, written_burst
        if rate == 0 and (burst == 0 or not device.paused):
            # never configured: the shim does not throttle; or paused by a turn alone this
            # controller did not start (its predecessor's, killed during it): the law starts
            # it afresh, as if never throttled, and the write ends the pause
            rate = burst = UNLIMITED_RATE
        limits = device.limits
        if limits is not None and limits[2] == policies[dev] and limits[3] == priority:
            limit, policy = limits[0], limits[1]
        else:
            try:
                limit, policy = self._limits(device, policies[dev], priority)
            except Exception:
                self._failed("region_read", "throttle_region_read_failed",
                             alloc_id=device.alloc_id, dev=dev)
                return
        # The rate read now was in force from the last tick's write until this tick's: the
        # time since the last read was wholly limited only if the rate read then limited too
        # (the write comes after the reads, and the shim spends without limit until then).
        # Where it was not, the claim is still held to the bucket (the law must not learn
        # from more), but no container is called a liar for it.
        limited = rate < UNLIMITED_RATE and limit < FULL_SHARE and policies[dev] != "off"
        limited_before, device.limited = device.limited, limited
        if previous is None:  # first sight (or agent restart): only a baseline
            spent = launches = wait = 0
            device.bucket = None
        else:
            # Totals drop when the shim reclaims a dead process's slot: count nothing then.
            spent = max(0, now[0] - previous[0])
            launches = max(0, now[1] - previous[1])
            wait = max(0, now[2] - previous[2])
            # the refill over the longest the time between this device's two reads may
            # have been
            read_dt_s = (self.tick_s if previous_ns is None
                         else (read_until - previous_ns) / 1e9)
            if limited:
                device.launch_debt.repay(rate, read_dt_s)
                claimed = spent
                spent, device.bucket = believed_spend(claimed, device.bucket, rate, burst,
                                                      read_dt_s)
                if not limited_before:
                    # The shim's bucket was full when the rate reached it, and what it
                    # spent before without limit leaves it no debt: from here, the bound
                    # is a full bucket, not what the unlimited spending used up.
                    device.bucket = (float(burst), rate)
                elif spent < claimed and not device.paused:
                    state = states.get(device.key)
                    processes = self._processes_on(device)
                    dear, count = dear_launches(claimed, spent, launches, burst,
                                                state.cost_per_launch if state else 0.0,
                                                processes)
                    # launches' debts, not a lie (`audit.LaunchDebt`): launched after the
                    # last read at the earliest
                    if not device.launch_debt.forgive(dear, burst, self._now_ns,
                                                      previous_ns or self._now_ns,
                                                      processes, count):
                        self._overclaimed(device, claimed, spent, rate, burst, read_dt_s)
                        liars.add(device.key)
            else:
                device.bucket = None  # the shim did not limit (all along): its bucket fills
            if wait and (rate >= UNLIMITED_RATE
                         or spent < WAIT_SPEND_FRACTION * rate * read_dt_s):
                # A shim waits only when its bucket ran dry (or for its turn behind a
                # process that waits so), which takes a rate, and spending near it: waits
                # claimed without are not believed (they would make the container hungry,
                # and it would take loans its neighbours can use while spending none).
                wait = 0
        spent_by[device.alloc_id] = spent_by.get(device.alloc_id, 0) + spent
        fields.append([device.key, limit, policy, priority, spent, launches, wait / 1e9,
                       None, rate, burst, 0.0, 1])
        steered.append((device, written_rate, written_burst))

    def _processes_on(self, device: _Device) -> int:
        """How many of its container's processes the host has placed on the device's GPU
        lately (NVML's pids, placed on host evidence: not the container's word), at least one.
        """
        placed = self._recent.get(device.uuid, {})
        return max(1, sum([1 for alloc_id, _, _ in placed.values()
                           if alloc_id == device.alloc_id]))

    def _settle(self, uuid: str, liars: set[str], sliced: bool, split: bool, open_loop: bool,
                calm_fraction: float, obs: Observation, entry: tuple[_Device, int, int],
                decision: Decision, changed: bool, lent: bool) -> tuple[bool, bool]:
        """One device's decision made final (its cap, the overuse watch) and written where it
        changes what is in force; (changed, lent) as this device leaves them (see the module
        note)."""
        device, written_rate, written_burst = entry
        rate, burst = decision[0], decision[1]
        cap = device.liar_cap
        # a limited container's own use (per-process samples, not a time-sliced GPU's
        # split) against the target its rate in force aimed at, loans included
        util, aimed = obs[7], device.last[1] if device.last is not None else None
        overused = False
        if (util is not None and aimed is not None and not sliced and obs[2] != "off"
                and obs[1] < FULL_SHARE and written_rate > 0):
            overused = device.overuse.read(util, aimed.target, aimed.state.tokens_per_pct)
            if overused:
                self._overused(device, util, aimed.target, written_rate)
                if obs[0] not in liars:  # (one whose claims are cut is held as those are)
                    device.long_hold = True
        if obs[0] in liars or overused:
            if cap is None:
                cap = device.liar_cap = LiarCap(written_rate, self._now_ns)
            cap.caught_ns = self._now_ns
        elif cap is not None and self._now_ns - cap.caught_ns > (
                OVERUSE_HOLD_NS if device.long_hold else LIAR_HOLD_NS):
            cap = device.liar_cap = None
        if cap is not None and obs[2] != "off":  # (off: the law writes no limit)
            if obs[7] is not None:
                cap.read(written_rate, obs[7], decision[2], own=not split)
            if rate > cap.cap:
                # and its k with it, so that the law's next decisions start from there
                scale = cap.cap / rate
                rate, burst = cap.cap, max(1, int(burst * scale))
                decision = decision._replace(
                    rate=rate, burst=burst, state=decision.state._replace(
                        tokens_per_pct=decision.state.tokens_per_pct * scale))
                self._states[uuid][obs[0]] = decision.state
        if burst > written_burst and obs[0] in liars:
            # a bucket deepened for launches its claims say grew, in a tick they were
            # caught overclaiming: the claims are no evidence (a liar's few launches each
            # "cost" what it claimed), so no deeper than the rate's own share of it
            burst = max(written_burst, math.ceil(rate * self.params.burst_s), 1)
            decision = decision._replace(burst=burst)
        if not lent:
            lent = (obs[2] == "off" or decision[2] > obs[1] + _SHARE_EPS
                    or rate >= UNLIMITED_RATE)
        if not changed:
            # news enough to keep the tick fast (see the module note)?
            last = device.last
            changed = (
                last is None
                or abs(last[1].target - decision.target) > self.calm_target_points
                or abs(rate - written_rate) > calm_fraction * written_rate
                # a reading far off, which the next one confirms or dismisses: soon
                or decision.state.surprise != 0
            )
        if rate != written_rate or burst != written_burst:
            self._apply(device, rate, burst)
        device.last = (obs, decision, open_loop)
        return changed, lent

    def _overclaimed(self, device: _Device, claimed: int, believed: int, rate: int, burst: int,
                     interval_s: float) -> None:
        """Counted every time; logged the first time per device (a container may do it every
        tick, and its log should not drown the node's), with what the claim was held to."""
        self.errors["tokens_overclaimed"] += 1
        if not device.overclaimed:
            device.overclaimed = True
            log.warning("throttle_tokens_overclaimed", alloc_id=device.alloc_id, dev=device.dev,
                        claimed=claimed, believed=believed, rate=rate, burst=burst,
                        interval_s=round(interval_s, 4),
                        why="more tokens than the rate and burst in force let through")

    def _overused(self, device: _Device, util: float, target: float, rate: int) -> None:
        """Counted every reading the watch fires; logged the first time per device."""
        self.errors["use_over_target"] += 1
        if not device.overused:
            device.overused = True
            log.warning("throttle_use_over_target", alloc_id=device.alloc_id, dev=device.dev,
                        util=util, target=round(target, 2), rate=rate,
                        why="its use read above its target reading after reading and did not "
                            "follow the law's falling k: its rate does not hold it")

    def _apply(self, device: _Device, rate: int, burst: int) -> None:
        try:
            device.region.set_rate(device.dev, rate, burst)
        except Exception:
            self._failed("set_rate", "throttle_set_rate_failed", alloc_id=device.alloc_id,
                         dev=device.dev)

    def _forget(self, regions: list[RegionHandle], by_gpu: Mapping[str, _Entries],
                due: set[str], read: list[RegionHandle]) -> set[str]:
        """Drop what belongs to regions gone and to regions that could not be `read` this
        tick; the GPUs that lost a device (a change)."""
        present_gpus = self._present
        for uuid in list(self._states):
            if uuid not in present_gpus or (uuid in due and uuid not in by_gpu):
                del self._states[uuid]
                self._sample_clock.every_period(uuid, False)
                self._end_turn(uuid, "not_read")
                self._drop_split(uuid)
                self._turnkeeper.forget(uuid)
                self._stranger_watch.forget(uuid)
        for uuid in [u for u in self._sampled_pids if u not in present_gpus]:
            del self._sampled_pids[uuid]
            self._recent.pop(uuid, None)
            self._held.forget(uuid)
        tick = self.ticks
        layout = self._layout
        if not self._remapped and layout is not None and len(regions) == len(layout.key):
            # the regions as at the last tick, none closed since: only one that could not be
            # read can be lost
            by_region = self._by_region
            lost = [d for region in self._unread
                    for d in by_region.get(id(region), (region, ()))[1] if d.seen != tick]
            present: set[int] | None = None
        else:
            present = {id(region) for region in regions}
            tried = {id(region) for region in read}
            lost = [d for d in self._devices.values()
                    if d.seen != tick and (id(d.region) in tried or id(d.region) not in present)]
        changed = {d.uuid for d in lost}
        if lost:
            # Unreadable this tick, or gone: the next reading is a new baseline.
            gone = {d.key for d in lost}
            self._devices = {k: d for k, d in self._devices.items() if k not in gone}
            self._layout = None
            if present is None:
                present = {id(region) for region in regions}
            self._by_region = {
                k: v for k, v in self._by_region.items()
                if k in present and v[1] and not any([d.key in gone for d in v[1]])
            }
        elif len(self._by_region) > len(regions):
            self._layout = None
            present = {id(region) for region in regions}
            self._by_region = {k: v for k, v in self._by_region.items() if k in present}
        if len(self._procs) > len(self._by_region):
            self._procs = {k: v for k, v in self._procs.items() if k in self._by_region}
        return changed


# Where NVML is asked every few periods (`nvml_poll_periods`), a GPU is asked every period
# while a container's share is uncertain by more than this many points (one standard
# deviation of its `k`, at its target): the settling tolerance's two points. At sigma 8 the
# estimates of three strict containers at 20-50 % came under it 2-4 s after a cold start
# (simulated, two seeds).
LOOSE_POINTS = 2.0
# Regions read between two yields to the loop: 32 headers and controls took about 0.4 ms in
# the agent at 144 busy container-devices (the shims writing the same pages meanwhile).
READ_CHUNK = 32
# The figures of containers alone are saved at most this often, and only where one was added,
# dropped or moved by more than FIGURES_MOVE (a figure averages its batches alone as they come)
FIGURES_SAVE_S = 10.0
FIGURES_MOVE = 0.02
# Waits are believed for a tick in which the container spent at least this part of what its
# rate let through (`_steer_gpu`).
WAIT_SPEND_FRACTION = 0.5


def bind_steering(module: Any) -> str | None:
    """Give the C steering this module's constants and the law's record layouts: None where it
    takes them, else why it cannot (it was built for other fields or constants; what it held
    before, if anything, is kept)."""
    try:
        module.bind(UNLIMITED_RATE, FULL_SHARE, JITTER_S, WAIT_SPEND_FRACTION,
                    LIAR_MARGIN_POINTS, _SHARE_EPS, OVERUSE_READINGS, OVERUSE_ENDS,
                    (*Observation._fields, "|", *Decision._fields, "|", *LoopState._fields))
    except (TypeError, ValueError) as error:  # TypeError: a bind of another signature
        return ("vgpu_agent.throttle._steerc was built from another version of the steering: "
                f"{error}")
    return None


# Not built, or a stale build that would read the law's records by the wrong positions: the
# steering in Python instead, and the controller says why.
_steerc, NOT_NATIVE_STEERING_REASON = native.load("vgpu_agent.throttle._steerc", bind_steering)
# whether `_steer_gpu` runs its common path in C (`_steerc.c`)
NATIVE_STEERING = _steerc is not None
LIAR_HOLD_NS = int(LIAR_HOLD_S * 1e9)
OVERUSE_HOLD_NS = int(OVERUSE_HOLD_S * 1e9)
PER_PROCESS_HOLD_US = int(PER_PROCESS_HOLD_S * 1e6)

_SLOTS_EVERY_NS = 1_000_000_000  # slots read afresh at most this often per GPU
_STRANGER_RETRY_NS = 5_000_000_000  # a process no container claims is looked for again after


async def _nap(woken: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or until `woken` is set; whether it was."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await woken.wait()
    return woken.is_set()


def _loose(states: Iterable[LoopState]) -> bool:
    """Whether a container's estimate is loose enough that NVML's next period is worth asking
    for at once (`SampleClock.every_period`): only the cold-start bound known, a far reading
    awaiting the next, or the share its `k` buys uncertain by more than LOOSE_POINTS. A
    container that never spent (no `k`) has nothing to learn from samples."""
    limit = LOOSE_POINTS * LOOSE_POINTS
    return any([s.tokens_per_pct > 0 and (s.lower_bound or s.surprise != 0
                                          or s.spread * s.target * s.target > limit)
                for s in states])


def _kernels_changed(observations: list[Observation], states: Mapping[str, LoopState]) -> bool:
    """Whether a container's launches cost other tokens this tick than before (LAUNCH_COST_MOVE
    times more or less than the law's `cost_per_launch`, over WATCH_LAUNCHES launches or more):
    most changes of phase change the kernels, and NVML shows what the new ones buy a period or
    two later."""
    for obs in observations:
        state = states.get(obs.key)
        if state is None or state.cost_per_launch <= 0 or obs.launches < WATCH_LAUNCHES:
            continue
        if _cost_moved(obs.spent / obs.launches / state.cost_per_launch):
            return True
    return False


def on_grid(now_ns: int, interval_ns: int, share_ns: int) -> int:
    """When a GPU settled at `interval_ns` is due next: the first multiple of it on the clock
    after `now_ns` + `share_ns` (the window within which GPUs share a tick), so that the GPUs
    settled at one interval are due at the same instants, whenever each settled. The interval
    that gets a GPU onto the grid is shorter than `interval_ns` by up to all but `share_ns`, or
    longer by up to `share_ns`; on the grid (a tick up to `share_ns` late included) each is
    `interval_ns`."""
    return ((now_ns + share_ns) // interval_ns + 1) * interval_ns


def _rates_moved(steered: list[tuple[_Device, int, int]], fraction: float
                 ) -> tuple[bool, bool]:
    """Whether the rates of a GPU's devices, as now written, moved from those in force before
    by more than `fraction` on average, each relative to its own (a rate set or lifted, from
    or to unlimited or the pause, moves by itself); and whether any one of them moved by more
    than `fraction` of its own."""
    moved, counted, one = 0.0, 0, False
    for device, written, _ in steered:
        last = device.last
        if last is None:
            continue
        rate = last[1][0]
        if rate >= UNLIMITED_RATE or written >= UNLIMITED_RATE or written == 0:
            if rate != written:
                return True, True
            continue
        move = abs(rate - written) / written
        moved += move
        counted += 1
        one = one or move > fraction
    return moved > fraction * counted, one


def _idle_devices(steered: list[tuple[_Device, int, int]]
                  ) -> list[_Watch] | None:
    """A lending GPU's devices to watch between slow ticks for their spending: (device, k,
    demand, 0.0) of each that is not waiting for tokens (a lender, or one not yet throttled;
    empty when all wait); None when one is `off` (what it uses is not its tokens' to say:
    only NVML, at a tick)."""
    idle: list[_Watch] = []
    for device, _, _ in steered:
        last = device.last
        if last is None:
            return None
        obs, decision, _ = last
        if obs[2] == "off":
            return None
        if not decision.hungry:
            idle.append((device, decision.state.tokens_per_pct, decision.demand, 0.0))
    return idle


def _watch_launch_costs(watching: list[_Watch], steered: list[tuple[_Device, int, int]]) -> None:
    """Adds to `watching` (or to a device's entry there) the tokens per launch of each device
    that launched at least WATCH_LAUNCHES times since the last tick, where a change of phase
    could take from someone: its GPU has other devices, or its own policy is strict (a limit
    it must not pass even alone). Between slow ticks, launches that cost other tokens bring
    the tick (`_launch_cost_moved`); NVML alone would show the change, at the next tick."""
    if len(steered) < 2 and not any(
            device.last is not None and device.last[0][2] == "strict" for device, _, _ in steered):
        return
    at = {id(w[0]): n for n, w in enumerate(watching)}
    for device, _, _ in steered:
        last = device.last
        if last is None:
            continue
        obs = last[0]
        spent, launches = obs[4], obs[5]
        if launches < WATCH_LAUNCHES or spent <= 0:
            continue
        n = at.get(id(device))
        if n is None:
            watching.append((device, 0.0, math.inf, spent / launches))
        else:
            watched, k, demand, _ = watching[n]
            watching[n] = (watched, k, demand, spent / launches)


def _launch_cost_moved(device: _Device, spent_total: int, launches_total: int,
                       per_launch: float) -> bool:
    """Whether the launches a device made since it was last looked at (or since the last
    tick) cost other tokens than its launches did at the last tick: LAUNCH_COST_MOVE times
    more or less, over at least WATCH_LAUNCHES launches (fewer are kept for the next look).
    Totals that went backwards (the shim reclaimed a dead process's slot) start afresh."""
    looked, previous = device.looked, device.previous
    if looked is not None and looked[0] == device.read_ns:
        since_spent, since_launches = looked[1], looked[2]
    elif previous is not None:
        since_spent, since_launches = previous[0], previous[1]
    else:
        return False
    spent, launches = spent_total - since_spent, launches_total - since_launches
    if spent < 0 or launches < 0:
        device.looked = (device.read_ns, spent_total, launches_total)
        return False
    if launches < WATCH_LAUNCHES:
        return False
    device.looked = (device.read_ns, spent_total, launches_total)
    return _cost_moved(spent / launches / per_launch)


def _cost_moved(ratio: float) -> bool:
    """Whether launches costing `ratio` times what they did are other kernels: LAUNCH_COST_MOVE
    times more or less."""
    return not 1 / LAUNCH_COST_MOVE <= ratio <= LAUNCH_COST_MOVE


def _counters(region: RegionHandle, peek: bool = False) -> tuple[int, ...] | None:
    """The region's per-device (tokens spent, launches, ns waited), None when unreadable.

    From the lean header read where the region has one (`peek`: without its file checks, where
    it has such a read, for the looks between slow ticks); otherwise summed from its usage.
    """
    lean = getattr(region, "peek_counters", None) if peek else None
    if lean is None:
        lean = getattr(region, "counters", None)
    if lean is not None:
        counters: tuple[int, ...] | None = lean()
        return counters
    usage = region.usage()
    if usage.corrupt:
        return None
    out: list[int] = []
    for dev, spent in enumerate(usage.tokens_spent):
        out += (
            spent,
            sum(p.launches[dev] for p in usage.processes if dev < len(p.launches)),
            sum(p.wait_ns[dev] for p in usage.processes if dev < len(p.wait_ns)),
        )
    return tuple(out)


def _controls(
    region: RegionHandle, devices: int
) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    """What the controller needs of `control`: per device (rate, burst) flattened, the
    policies, the priority. One call where the region has the lean read; otherwise asked
    device by device, and checked (a rate is a count of tokens)."""
    lean = getattr(region, "controls", None)
    if lean is not None:
        found: tuple[tuple[int, ...], tuple[str, ...], int] = lean()
        return found
    rates: list[int] = []
    for dev in range(devices):
        rate, burst = region.rate(dev)
        if not (type(rate) is int and type(burst) is int and rate >= 0 and burst >= 0):
            raise ValueError(f"rate and burst of device {dev} of {region.alloc_id!r} must be "
                             f"integers >= 0, got {rate!r}, {burst!r}")
        rates += (rate, burst)
    return tuple(rates), tuple(region.policy(dev) for dev in range(devices)), region.priority


def _figures_moved(saved: Figures, now: Figures) -> bool:
    """Whether figures were added, dropped or moved by more than FIGURES_MOVE since saved."""
    if saved.keys() != now.keys():
        return True
    for uuid, held in now.items():
        before = saved[uuid]
        if before.keys() != held.keys():
            return True
        for alloc_id, (figure, rate) in held.items():
            old_figure, old_rate = before[alloc_id]
            if (abs(figure - old_figure) > FIGURES_MOVE * old_figure
                    or abs(rate - old_rate) > FIGURES_MOVE * old_rate):
                return True
    return False


def _alloc_id(region: RegionHandle) -> str:
    try:
        return region.alloc_id
    except Exception:
        return "?"

"""The core-throttle control law: from measured use to token refill rates, one GPU at a time.

Pure: no I/O, no clocks, no asyncio. `controller.py` feeds it one `Observation` per container
and physical GPU every tick and writes the resulting rates into the regions.

How it works (the note the design asks for)
-------------------------------------------
*Shares.* `allocate` turns limits, policies, priorities and demands into a target share per
container, in percent of the GPU's SM time:

1. Guarantee, by priority: highest priority first, each container gets what it can use of its
   limit (all of it when it is waiting for tokens); when the limits add up to more than the GPU,
   a priority level splits what is left in proportion to its members' limits.
2. Lend: capacity nobody uses goes to waiting `work-conserving` containers in proportion to their
   limits. A `strict` container never gets more than its limit.
3. Reserve: a container keeps a rate for its full guarantee even while idle, so the moment it
   launches again it is served; the next tick sees its spending and takes the loan back.

*Rates.* The shim charges whatever a launch costs (grid blocks x threads), so the law never
assumes a token unit. It learns, per container, `k` = tokens per second that buy one percent of
SM time, from the tokens the container spent divided by the utilization NVML measured, and sets
`rate = k * target`. A change of target is therefore applied in one step (feed-forward), and the
quality of the loop rests on `k` alone, which is a property of the workload, not of the share:

- `k` is learned only from evidence that describes one moment: the spending is steady over
  `spend_window_s` (or the container was held at one rate and waited for tokens all along, so it
  spent exactly that rate, however lumpy its launches) and the last two NVML samples agree, so
  queued work has drained and NVML's averaging window no longer straddles a change. Transients
  never reach the model: this conditional learning is the anti-windup.
- Updates are geometric (`k *= (observed / k) ** gain`): the learned gain is an integral action
  on the multiplicative error, so a workload whose utilization is not exactly proportional to its
  spending still converges to its target at the operating point. No separate PI term: a second
  integrator on the same error only adds overshoot.
- On a full GPU where someone is above target, the others' work queues up and their spending
  overstates their use; there only corrections of `k` downwards are trusted. A container seen
  above its target at a rate held for the whole window proves `k` too high (it cannot have spent
  more than the rate): that correction is always allowed and is what relieves a full GPU.
- Cold start: a container with no model runs unthrottled for one tick; its spending then bounds
  `k` from below (its share was at most 100%, or a little above what NVML's first sample says),
  so the first limited rate stays under the limit; the exact `k` follows within a second.
  Shares under NVML's integer resolution climb by the bound `util + 0.5`. A rate found already
  in force (the agent restarted) is kept until `k` is learned from it.

Kernel length does not matter: long kernels make spending lumpy within a tick, which the burst
(at least two of the largest launches) absorbs and the held-rate evidence averages out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy

# Written for `off` containers (and for ones the law knows nothing about yet): large enough
# that no bucket ever runs dry, small enough that the shim's 64-bit arithmetic cannot overflow.
# It is also the upper bound of every rate and burst the law decides; the lower bounds are
# `ControlParams.min_rate` and 1 token.
UNLIMITED_RATE = 1 << 52

FULL_SHARE = 100.0
_EPS = 1e-9


@dataclass(frozen=True)
class ControlParams:
    """Tuning of the law. Times in seconds, shares in percent of the GPU's SM time."""

    spend_window_s: float = 0.4  # spending must be steady this long before `k` learns from it
    steady_tolerance: float = 0.15  # max relative spread of spending inside that window
    model_gain: float = 0.5  # weight of a new observation in the geometric update of `k`
    min_util_to_learn: float = 3.0  # below this NVML's integer percent is too coarse
    hungry_wait_fraction: float = 0.02  # waiting this fraction of a tick means rate-limited
    hungry_spend_fraction: float = 0.9  # spending this fraction of the rate means rate-limited
    boot_widening: float = 1.25  # margin on the first sample, so the first rate stays below
    over_tolerance: float = 1.0  # points above target that prove `k` too high
    saturation_margin: float = 3.0  # a GPU this close to 100% busy is treated as full
    demand_margin: float = 3.0  # headroom kept for a container that is not rate-limited
    demand_ticks: int = 3  # demand is the peak spending of this many recent ticks
    burst_s: float = 0.02  # bucket depth in seconds of refill
    burst_launches: float = 2.0  # and never less than this many of the largest launches
    min_rate: int = 1  # tokens/s; zero would starve a squeezed-out container forever

    def __post_init__(self) -> None:
        for name in ("spend_window_s", "steady_tolerance", "model_gain", "burst_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ControlParams.{name} must be > 0, got {value!r}")
        if not 0 < self.model_gain <= 1:
            raise ValueError(f"ControlParams.model_gain must be in (0, 1], got {self.model_gain!r}")
        if self.demand_ticks < 1:
            raise ValueError(f"ControlParams.demand_ticks must be >= 1, got {self.demand_ticks!r}")


# The records made per container and tick are named tuples: immutable like frozen dataclasses,
# and several times cheaper to build, which counts at a hundred containers ten times a second.


class _ObservationFields(NamedTuple):
    key: str
    limit: float  # percent, 0 < limit <= 100
    policy: CorePolicy
    priority: int = 0
    spent: int = 0  # tokens spent during the tick (all processes of the container)
    launches: int = 0  # kernel launches during the tick
    waited_s: float = 0.0  # time its processes spent waiting for tokens during the tick
    util: float | None = None  # measured SM percent, None when NVML gave nothing new
    rate: int = UNLIMITED_RATE  # the refill rate that was in force during the tick
    burst: int = UNLIMITED_RATE  # and the burst


class Observation(_ObservationFields):
    """One container on one physical GPU during the tick that just ended; checked when made."""

    __slots__ = ()

    def __new__(
        cls,
        key: str,
        limit: float,
        policy: CorePolicy,
        priority: int = 0,
        spent: int = 0,
        launches: int = 0,
        waited_s: float = 0.0,
        util: float | None = None,
        rate: int = UNLIMITED_RATE,
        burst: int = UNLIMITED_RATE,
    ) -> Observation:
        if not 0 < limit <= FULL_SHARE:
            raise ValueError(f"core limit of {key!r} must be in (0, 100], got {limit!r}")
        if policy not in CORE_POLICIES:
            raise ValueError(
                f"core policy of {key!r} must be one of {CORE_POLICIES}, got {policy!r}"
            )
        made = tuple.__new__(
            cls, (key, limit, policy, priority, spent, launches, waited_s, util, rate, burst)
        )
        if min(spent, launches, waited_s, rate, burst) < 0:
            raise ValueError(f"negative usage figures for {key!r}: {made!r}")
        return made


class LoopState(NamedTuple):
    """What the law remembers about one container between ticks."""

    tokens_per_pct: float = 0.0  # k, tokens/s buying one percent of SM time; 0 = unknown
    lower_bound: bool = False  # k is only the cold-start bound, not yet learned
    spend_history: tuple[float, ...] = ()  # tokens/s per recent tick, newest last
    limited_history: tuple[float, ...] = ()  # rate in force per recent tick when rate-limited,
    # 0 when it was not: a container held at one rate the whole window spends exactly that rate
    cost_per_launch: float = 0.0  # largest recent average cost of one launch
    util: float | None = None  # last measured SM percent
    util_history: tuple[float, ...] = ()  # the last fresh measurements, newest last
    rate_history: tuple[float, ...] = ()  # the rate in force per recent tick
    target: float = 0.0  # the share the rate in force aimed at
    learned: int = 0  # how many observations `k` has been learned from


class Claim(NamedTuple):
    """A container's entry in the share allocation."""

    key: str
    limit: float
    policy: CorePolicy
    priority: int
    hungry: bool  # rate-limited: it would use more than it has
    demand: float  # percent it uses (plus margin) when not hungry


@dataclass(frozen=True)
class Shares:
    guarantee: dict[str, float] = field(default_factory=dict)  # reserved when it asks
    target: dict[str, float] = field(default_factory=dict)  # what it should get now


class Decision(NamedTuple):
    rate: int
    burst: int
    target: float  # percent, what the rate aims at
    hungry: bool
    demand: float
    state: LoopState


def _water_fill(amount: float, weights: Sequence[float], caps: Sequence[float]) -> list[float]:
    """Split `amount` in proportion to `weights`, nobody above their cap; returns the gifts."""
    given = [0.0] * len(caps)
    open_at = [i for i, cap in enumerate(caps) if cap > _EPS and weights[i] > 0]
    while amount > _EPS and open_at:
        total_weight = sum([weights[i] for i in open_at])
        room = min([(caps[i] - given[i]) * total_weight / weights[i] for i in open_at])
        step = min(amount, room)
        for i in open_at:
            given[i] += step * weights[i] / total_weight
        amount -= step
        open_at = [i for i in open_at if caps[i] - given[i] > _EPS]
    return given


def _by_priority(
    priorities: Sequence[int], limits: Sequence[float], wants: Sequence[float], capacity: float
) -> tuple[list[float], list[int] | None]:
    """Highest priority first; within a level, proportional to limits, capped at what each wants.

    Returns what each gets, and the order it was granted in when that is not the claims' order
    (sums follow it, so that the figures do not depend on how the claims were listed).
    """
    levels = set(priorities)
    if len(levels) <= 1:  # the common case: one level, the claims' order
        return _water_fill(capacity, limits, wants), None
    granted = [0.0] * len(priorities)
    order: list[int] = []
    left = capacity
    for level in sorted(levels, reverse=True):
        members = [i for i, priority in enumerate(priorities) if priority == level]
        gifts = _water_fill(left, [limits[i] for i in members], [wants[i] for i in members])
        for i, gift in zip(members, gifts, strict=True):
            granted[i] = gift
        order.extend(members)
        left = max(0.0, left - sum(gifts))
    return granted, order


def allocate(claims: Sequence[Claim], capacity: float = FULL_SHARE) -> Shares:
    """Target shares for the limited containers of one GPU (see the module note).

    `capacity` is what the limited containers may divide: 100 minus what `off` containers use.
    """
    limited = [c for c in claims if c.policy != "off"]
    priorities = [c.priority for c in limited]
    limits = [c.limit for c in limited]
    guarantee, order = _by_priority(priorities, limits, limits, capacity)
    wants = [c.limit if c.hungry else min(c.limit, c.demand) for c in limited]
    used, _ = _by_priority(priorities, limits, wants, capacity)
    spare = capacity - (sum(used) if order is None else sum([used[i] for i in order]))
    lend_caps: list[float] = []
    for c, got in zip(limited, used, strict=True):
        if c.policy == "work-conserving":
            ceiling = math.inf if c.hungry else max(c.demand, got)
        else:
            ceiling = c.limit if c.hungry else min(c.limit, c.demand)
        lend_caps.append(max(0.0, ceiling - got))
    lent = _water_fill(spare, limits, lend_caps)
    return Shares(
        guarantee={c.key: g for c, g in zip(limited, guarantee, strict=True)},
        target={
            c.key: max(g, u + extra)
            for c, g, u, extra in zip(limited, guarantee, used, lent, strict=True)
        },
    )


def _steady(history: Sequence[float], tolerance: float) -> bool:
    mean = sum(history) / len(history)
    return mean > 0 and (max(history) - min(history)) <= 2 * tolerance * mean


def _steady_spend(
    spends: Sequence[float], limited: Sequence[float], window: int, tolerance: float
) -> float | None:
    """The container's long-run spending over the window, when the window shows one.

    Held at one rate and waiting for tokens all along, it spent that rate, however lumpy its
    per-tick spending (a few long kernels per second); otherwise its spending must itself be
    steady.
    """
    if len(spends) < window:
        return None
    if min(limited) > 0 and max(limited) <= min(limited) * (1 + tolerance / 10):
        return sum(limited) / window
    if _steady(spends, tolerance):
        return sum(spends) / window
    return None


# What `_observe` learned about one container, in `LoopState`'s field order less `target`,
# which the allocation decides afterwards: the state is built once, with its target.
_Learned = tuple[
    float, bool, tuple[float, ...], tuple[float, ...], float, float | None, tuple[float, ...],
    tuple[float, ...], int,
]


def _observe(
    obs: Observation,
    prev: LoopState,
    dt_s: float,
    window: int,
    saturated: bool,
    params: ControlParams,
) -> tuple[_Learned, bool, float]:
    """Update the container's model from one tick; returns (learned, hungry, demand)."""
    spent, rate_in_force, util = obs.spent, obs.rate, obs.util
    spend_rate = spent / dt_s
    history = (*prev.spend_history, spend_rate)[-window:]
    cost = prev.cost_per_launch * 0.99  # forget slowly, so one odd launch does not stick
    if obs.launches:
        cost = max(cost, spent / obs.launches)
    waited = obs.waited_s >= params.hungry_wait_fraction * dt_s
    spent_all = (
        rate_in_force < UNLIMITED_RATE
        and spend_rate >= params.hungry_spend_fraction * rate_in_force
    )
    hungry = waited or spent_all

    k, lower_bound, learned = prev.tokens_per_pct, prev.lower_bound, prev.learned
    if k <= 0 and spend_rate > 0 and rate_in_force >= UNLIMITED_RATE:
        # Unthrottled for the tick: its share was at most 100%, or, when NVML already reports
        # it, about `util` (widened, as the sample and the tick do not cover the same moments).
        share_bound = FULL_SHARE
        if util is not None and util >= 1:
            share_bound = min(FULL_SHARE, params.boot_widening * util + 1)
        k, lower_bound = spend_rate / share_bound, True
    limited = (*prev.limited_history, float(rate_in_force) if hungry else 0.0)[-window:]
    long_run = _steady_spend(history, limited, window, params.steady_tolerance)
    rates = (*prev.rate_history, float(rate_in_force))[-window:]
    if util is None:
        # Nothing measured: `k` can learn nothing this tick (every rule below needs `util`).
        demand = max(history[-params.demand_ticks :]) / k + params.demand_margin if k > 0 else 0.0
        learned_now: _Learned = (
            k, lower_bound, history, limited, cost, prev.util, prev.util_history, rates, learned
        )
        return learned_now, hungry, demand
    utils = (*prev.util_history, util)[-3:]
    # Utilization still moving means queued work draining or NVML's window straddling a change:
    # spending and utilization do not describe the same moment yet.
    util_steady = len(utils) >= 2 and abs(utils[-1] - utils[-2]) <= max(
        1.0, params.steady_tolerance * max(utils[-2:])
    )
    seen = math.inf
    if long_run is not None and util > 0:
        seen = long_run / util
    if not util_steady:
        if long_run is not None and lower_bound and not saturated:
            # Still climbing from the cold-start bound with lumpy samples (a few long kernels
            # per sample period): the largest recent sample bounds the share from above.
            k = max(k, long_run / (max(utils) + 0.5))
    elif long_run is not None and util >= params.min_util_to_learn and not saturated:
        if lower_bound or k <= 0:
            k, lower_bound = seen, False
        else:
            k *= (seen / k) ** params.model_gain
        learned += 1
    elif long_run is not None and util >= params.min_util_to_learn and seen < k:
        # On a full GPU work queues up, so spending overstates use and `seen` overstates k:
        # only a correction downwards is trustworthy, and it is what relieves the GPU.
        k *= (seen / k) ** params.model_gain
        learned += 1
    elif (
        util > prev.target + params.over_tolerance
        and prev.target > 0
        and len(rates) == window
        and rates[-1] < UNLIMITED_RATE
        and max(rates) <= min(rates) * (1 + params.steady_tolerance / 10)
    ):
        # Above its target at a rate held all window: it spent at most that rate, so k is
        # below rate / util. True on a full GPU too, where the other rules may not learn.
        k *= (prev.target / util) ** params.model_gain
        lower_bound = False
        learned += 1
    elif long_run is not None and not saturated:
        # Too coarse to learn from, but NVML rounds, so the true share was below util + 0.5
        # and k is at least this: a safe lower bound to climb by.
        bound = long_run / (util + 0.5)
        if bound > k:
            lower_bound = lower_bound or k <= 0
            k = bound
    # Never spent a token: idle. Otherwise its recent peak, which a waking owner shows at once.
    demand = max(history[-params.demand_ticks :]) / k + params.demand_margin if k > 0 else 0.0
    return (k, lower_bound, history, limited, cost, util, utils, rates, learned), hungry, demand


def _state(learned: _Learned, target: float) -> LoopState:
    k, lower_bound, spends, limited, cost, util, utils, rates, count = learned
    return LoopState(k, lower_bound, spends, limited, cost, util, utils, rates, target, count)


def _clamp_tokens(value: float, low: int, to_int: Callable[[float], int] = round) -> int:
    """A rate or burst within the documented bounds [low, UNLIMITED_RATE]: whatever a container
    made the law learn (a huge spending, a zero utilization), what is written stays a value the
    shim's 64-bit arithmetic handles, and a NaN never reaches `round`."""
    if not value >= low:  # also NaN
        return low
    if value >= UNLIMITED_RATE:
        return UNLIMITED_RATE
    return max(low, min(UNLIMITED_RATE, to_int(value)))


def control_step(
    observations: Sequence[Observation],
    states: Mapping[str, LoopState],
    dt_s: float,
    params: ControlParams | None = None,
) -> dict[str, Decision]:
    """One tick of the law for the containers of one physical GPU."""
    if not dt_s > 0:
        raise ValueError(f"tick length must be > 0 s, got {dt_s!r}")
    params = params or ControlParams()
    keys = [o.key for o in observations]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate container keys in one GPU's observations: {keys}")
    window = max(1, round(params.spend_window_s / dt_s))

    # Full, and someone takes more than planned: the others' work may be queueing behind it,
    # so their spending overstates their use until that is corrected.
    fresh: list[float] = []
    overdrawn = False
    blank = LoopState()
    previous: list[LoopState] = []
    for o in observations:
        prev = states.get(o.key, blank)
        previous.append(prev)
        if o.util is not None:
            fresh.append(o.util)
            if prev.target > 0 and o.util > prev.target + params.over_tolerance:
                overdrawn = True
    saturated = overdrawn and sum(fresh) >= FULL_SHARE - params.saturation_margin
    updated = [
        _observe(o, prev, dt_s, window, saturated, params)
        for o, prev in zip(observations, previous, strict=True)
    ]
    # what `off` containers use, by their last measurement
    off_use = sum(
        (learned[5] or 0.0)
        for o, (learned, _, _) in zip(observations, updated, strict=True)
        if o.policy == "off"
    )
    claims = [
        Claim(o.key, o.limit, o.policy, o.priority, hungry, demand)
        for o, (_, hungry, demand) in zip(observations, updated, strict=True)
    ]
    shares = allocate(claims, max(0.0, FULL_SHARE - off_use))

    decisions: dict[str, Decision] = {}
    targets = shares.target
    for o, prev, (learned, hungry, demand) in zip(observations, previous, updated, strict=True):
        if o.policy == "off":
            decisions[o.key] = Decision(UNLIMITED_RATE, UNLIMITED_RATE, FULL_SHARE, hungry, demand,
                                        _state(learned, prev.target))
            continue
        target = targets[o.key]
        k = learned[0]
        if not math.isfinite(k):  # nothing sane was learned: start over from no model
            learned = (0.0, False, *learned[2:])
            k = 0.0
        if k <= 0:
            # No model yet. A rate already in force (written before an agent restart) is kept
            # until the model is learned from it; otherwise the container runs one tick
            # unthrottled, which gives the cold-start bound.
            kept = (o.rate, o.burst) if o.rate < UNLIMITED_RATE else (UNLIMITED_RATE,) * 2
            decisions[o.key] = Decision(kept[0], kept[1], target, hungry, demand,
                                        _state(learned, prev.target))
            continue
        rate = _clamp_tokens(k * target, params.min_rate)
        burst = max(
            _clamp_tokens(rate * params.burst_s, 1),
            _clamp_tokens(params.burst_launches * learned[4], 1, math.ceil),
        )
        decisions[o.key] = Decision(rate, burst, target, hungry, demand, _state(learned, target))
    return decisions


def forget(states: Mapping[str, LoopState], keep: set[str]) -> dict[str, LoopState]:
    """Drop the memory of containers that are gone."""
    return {key: state for key, state in states.items() if key in keep}


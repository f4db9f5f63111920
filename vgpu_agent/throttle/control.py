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

"Waiting for tokens" (hungry) means it waited, or spent most of its rate over the last few
ticks; once hungry it stays so until it spends clearly less (`hungry_hysteresis`), so that a
container using just about its rate does not flip every tick. Less than what: its rate, or,
where a loan raised that above its own limit's, its own limit's rate; a borrower the GPU holds
back spends the same under the loan as without, and keeps the loan rather than lose it at one
tick and get it back at the next. A GPU in use to within
`saturation_margin` of 100 % has nothing to lend: every container spending there counts as
waiting, since the GPU, not its bucket, holds it back. Use is judged by spending / k, which
NVML's noise does not shake from tick to tick, but `k` learned from a few noisy samples may
be off by a sixth; so the GPU counts as full unless it has room beyond `saturation_sigmas`
deviations of those estimates. Lending on a GPU that only looked to have room oversubscribes
it, and the lender, squeezed, spends less than its rate, which confirms that it was not using
its share: three work-conserving containers of one workload, whose `k` the law had a sixth and
a quarter high, read 88 % in use, and the 50 % one was held at 39 % for 20 s (simulated, sigma
8, one sample a second; 1 s with the deviations counted).

*Rates.* The shim charges whatever a launch costs (grid blocks x threads), so the law never
assumes a token unit. It learns, per container, `k` = tokens per second that buy one percent of
SM time, and sets `rate = k * target`. A change of target is therefore applied in one step
(feed-forward), and the quality of the loop rests on `k` alone, which is a property of the
workload at its operating point, not of the share. A new rate within `rate_deadband` (1 %) of
the one in force is not written: noisy samples nudge `k` every time, and a nudge is not worth
the write and the shim's re-read. Its burst is written all the same when the container's
launches grew past it. Every burst is `burst_s` of refill, or room for `burst_launches` of the
largest launches where that is more, up to a second of refill (a launch costing more than the
bucket holds runs it into a debt, one lumpy launch a refill, which reads as idle at its rate;
the bound, because launch counts and tokens are the container's word and the audit lends in
proportion to the burst).

*Learning `k` through noise.* NVML's per-process samples are coarse (integer percent), late
(each describes the sample period that ended before it was read) and noisy (a few points from one
sample to the next). The law therefore estimates `b = 1 / k` (percent per token/s) with a scalar
Kalman filter over the model `util = b * spend`:

- Each fresh measurement is paired with the spending over the time it describes: the samples'
  span (the NVML sample period, told by the controller from the samples' timestamps, or
  `nvml_period_s`) ending half a tick ago, taken from the per-tick spending history with
  fractional weights for the ticks at its edges. Each entry of the history keeps how long its
  tick lasted (the agent's tick slows to 1 s while all is calm and comes back to 0.1 s on a
  change), so the window is placed on the time the ticks really covered. A window that
  reaches a little (`partial_window`) before the history, as a container's first sample does
  when samples come once a second, is still used: the oldest tick's spending stands in for the
  part before it (that tick ran unthrottled, as the container did before it was followed, or
  under a rate found written), and that part counts as possible misalignment. A sample a
  second late would otherwise cost a second of learning.
- Its weight is what it says: the measurement variance is the NVML noise divided by the number
  of samples averaged, plus the error one tick of misalignment would make (large right after a
  rate change, nil when spending is steady). Transients thus count little without being thrown
  away, and nothing has to agree with anything: this replaces the old gate that learned only
  when two samples agreed.
- NVML's noise is that of a sampled proportion (the driver sees a process busy or not at
  instants): largest at 50 % use, shrinking towards 0 and 100 % as `4 p (1 - p)` (never below
  `noise_tail` of it, never below the integer resolution's 1/12 point^2). The law keeps its
  estimate as at 50 % use (`noise_prior` until measured) and scales it to the share expected
  now, so that noise learned at 100 % use (where samples barely scatter) does not make the
  filter trust every sample once the container drops to 30 %. It is measured from two
  measurements in a row at the same spending: their difference is the noise of both,
  whatever the estimate of k. Pairs near 0 or 100 % use (where the shape is only its floor,
  `noise_tail`) are not measures: there a sampled proportion hardly scatters, and a borrower
  that ran at 100 % for a while would otherwise learn a noise near nothing, then read any
  noisy sample after a cut to 30 % as a changed workload and re-learn k from it alone (seen:
  k off by 30 % to a factor of three). And a pair that differs by more than a changed workload
  counts as noise no more than that: it is the change, not noise.
- A reading of 0 for a container that spent enough for more than `missing_above` percent,
  further off than noise reaches, is a sample NVML missed (its processes were absent from the
  batch), not evidence of an idle GPU: taken as evidence it would make `k` unbounded and the
  container unthrottled. One that noise reaches is a reading like any other once the estimate
  is close enough that it moves `k` by a third at most (`_ZERO_SPREAD`): a small share read
  coarsely reads 0 often, and dropping those zeros read the container busier than it was, its
  `k` and rate too low (three processes at 1.3 % each, sigma 8: `k` at 0.7 of the truth,
  against 0.84-0.88 using them, about what those readings allow). Two far off in a row
  (the first kept as a surprise), from a container measured before and further off than the
  noise reaches, are evidence, of a bound: its tokens came to buy next to nothing (grids far
  larger for the same work), its use is at most the resolution, and `k` is raised to at least
  what that says (spending / resolution), its estimate widened so that the next reading
  re-learns it. A reading after no spending for as long as the history holds clears a
  surprise: the zero of a container going idle and the one as it wakes, seconds later, are no
  pair. Without the bound, such a container read 0 % with its rate unchanged for as long as it
  ran (simulated: launches 50 times dearer for the same SM time, its share 40 %). A zero
  read while the estimate is too loose to learn from it (as after such a raise), yet further
  off than NVML's noise alone reaches from the use `k` expects, counts towards that pair too:
  a raise bounds `k` by the spending it saw, and where that spending was the floor the shim's
  bounded waits leave (launches of 2.5 s of refill, three processes), one raise left `k` a
  thousand times low, and every zero after it was set aside (its share 0.3 % of 40,
  simulated). The controller gives no reading (`None`, not 0) for a container that spent but
  none of whose processes NVML listed (not yet placed, or missed for several periods), so
  that only a process seen at 0 % counts here.
- Between measurements `b` may drift (`drift_per_s`, relative, 0.3 %/s): the filter never
  stops listening, and a workload that changes slowly is followed; a lower drift keeps the
  steady estimate averaging more samples (NVML's noise at 1 sample/s and sigma 8 needs dozens).
  An innovation far outside what the filter expects (`surprise_sigmas`), followed by one off
  the same way (by any amount), is a change of workload, not noise: the estimate's variance
  is widened so that it re-learns within a few samples, from the second. Until the next
  measurement the first is an outlier (`LoopState.surprise` keeps it), counted no further out
  than the bound: a sampled proportion of a small share is skewed, and one reading of 26 %
  for a process truly at 8 % (sigma 8, simulated) once cut its k threefold, and its rate, for
  seconds. A real change costs one measurement more; the controller ticks fast while one is
  pending, so that the next comes soon. (`confirm_surprises` off: re-learned at the first, as
  for a time-sliced GPU's split shares, which are estimates, not samples.) The reading that
  re-learns counts as a third of a reading (`relearn_weight`): it was picked for being far off,
  so its noise likely is too, and it comes amid the change's transient (rates moving on the
  whole GPU). Trusted in full, one 3 sigma off left `k` 13 % low, and the readings after it
  took 3 s to bring it back (simulated, samples every 1/6 s). Now the next few weigh more:
  the phase change of `bench_throttle`'s scenario 6 settled in 3.6 s instead of 5.7 at sigma
  8 (2.4 instead of 3.1 at sigma 3; medians of 24 seeds), at the cost of the false changes
  noise makes at sigma 8 (steady error 0.76 -> 0.84 points with three containers). A third
  only where samples span at most `relearn_span_s` (0.5 s): at one sample a second the
  readings after it are too few to average out what they then weigh (settling 4.2 -> 5.6 s at
  sigma 3 there). There it counts as one reading exactly, what the filter still held of the
  old workload dropped (settling 4.2 -> 3.7 s, 24 seeds). Over 96 seeds the law as it is
  settles that change in 4.2 s at sigma 8 (samples every 1/6 s) and 4.3 s at sigma 3 (one a
  second), simulated: a median of 24 moves by a second with the seeds drawn. The split's
  estimates are not touched (a third made its scenario 6 error rise 10.4 -> 13.7 points).
- Anti-windup: nothing integrates an error; the estimate only moves by evidence, and a
  container that spends nothing (idle, or held off) gives no evidence.
- Because the estimate is of the ratio at the operating point, a workload whose SM time is not
  proportional to its spending (small grids that pack, kernels slowed by neighbours) still
  converges to its target.
- Cold start: a container with no model runs unthrottled for one tick; its spending then bounds
  `b` from above (its share was at most 100%, or a little above what NVML's first sample says),
  so the first limited rate stays under the limit. Without a sample in that tick the bound
  alone would hold a `work-conserving` newcomer at a fraction of its target until NVML reports
  (a second later on GPUs that sample once a second; a tenth of its target when ten start at
  once), so those start from a guess instead (`guess_newcomers`): together the newcomers had
  what the other containers left, each an equal part of it; the first samples then correct
  it. A `strict` newcomer keeps the bound. Until `cold_samples` measurements are in,
  a `strict` container's rate uses `b` plus `cold_sigmas` standard deviations of the estimate,
  so that a noisy first sample cannot push it above its limit; the margin fades as evidence
  accumulates, and never takes the rate below what the cold-start bound buys (that bound is
  proven as far as the tick's spending is; a container alone on the GPU is exactly at it).
  The bound holds `k` until the estimate knows it better (its relative deviation below
  `floor_trust`), no longer: the spending is counted as the shim counts it (in steps,
  launches as it admits them), and a bound a few percent high, kept, held a strict container
  a few percent over its limit for good (no reading off by as little is far enough to
  re-learn from). A rate found already in force (the
  agent restarted) is kept until `k` is learned from it.

Kernel length does not matter: long kernels make spending lumpy within a tick, which the burst
(at least two of the largest launches) absorbs and the sample span averages out.
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
# A reading of 0 that noise reaches is used once the estimate's spread is below 1 / (this x
# surprise_sigmas^2): one such reading then moves b by at most 1 / this (k up by a third).
_ZERO_SPREAD = 4.0
_EPS = 1e-9


@dataclass(frozen=True)
class ControlParams:
    """Tuning of the law. Times in seconds, shares in percent of the GPU's SM time."""

    nvml_period_s: float = 1 / 6  # span of a measurement when the controller cannot tell it
    history_s: float = 2.5  # spending kept per container: the longest span plus a tick
    noise_prior: float = 36.0  # points^2 of NVML noise at 50 % use assumed before measured
    noise_memory: float = 0.05  # weight of one pair of measurements in the noise estimate
    held_tolerance: float = 0.05  # spending this close in two measurements counts as held
    resolution: float = 1.0  # NVML reports whole percents: a floor of resolution^2 / 12
    drift_per_s: float = 0.003  # relative drift of the workload's cost a second may bring
    surprise_sigmas: float = 4.0  # an innovation this far out is a changed workload
    initial_spread: float = 1.0  # relative standard deviation of the cold-start bound
    cold_samples: int = 3  # measurements before a strict container drops the margin
    cold_sigmas: float = 1.0  # the margin, in standard deviations of the estimate
    hungry_wait_fraction: float = 0.02  # waiting this fraction of a tick means rate-limited
    hungry_spend_fraction: float = 0.8  # spending this fraction of the rate means rate-limited
    hungry_hysteresis: float = 0.1  # and, once rate-limited, this much less still does
    boot_widening: float = 1.25  # margin on the first sample, so the first rate stays below
    demand_margin: float = 3.0  # headroom kept for a container that is not rate-limited
    saturation_margin: float = 5.0  # a GPU this close to 100% in use lends nothing
    saturation_sigmas: float = 3.0  # ... counting its use this many deviations of k higher
    demand_ticks: int = 3  # demand is the peak spending of this many recent ticks
    burst_s: float = 0.02  # bucket depth in seconds of refill
    burst_launches: float = 2.0  # and never less than this many of the largest launches
    min_rate: int = 1  # tokens/s; zero would starve a squeezed-out container forever
    rate_deadband: float = 0.01  # a new rate this close to the one in force is not written
    noise_tail: float = 0.2  # NVML noise at 0 % or 100 % use, relative to that at 50 %
    missing_above: float = 5.0  # a zero reading where this much use was expected is a miss
    partial_window: float = 0.3  # a window this much before the history is still used
    # a far-off reading waits for the next to confirm it (NVML's samples of a small share are
    # skewed); off where readings are estimates, not samples (a time-sliced GPU's split)
    confirm_surprises: bool = True
    # a confirmed reading that re-learns k counts as this many readings (it was picked for
    # being far off: its noise likely is too) where samples span at most relearn_span_s, and
    # as one reading where they span more
    relearn_weight: float = 1 / 3
    relearn_span_s: float = 0.5
    # the cold-start bound holds k until the estimate's relative standard deviation is below
    # this: about the bound's own error (the tick's spending is counted in the shim's steps;
    # 4 % seen on the fake driver, not measured on a GPU)
    floor_trust: float = 0.03

    def __post_init__(self) -> None:
        for name in ("nvml_period_s", "history_s", "noise_prior", "noise_memory", "resolution",
                     "initial_spread", "surprise_sigmas", "burst_s", "noise_tail",
                     "relearn_weight"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ControlParams.{name} must be > 0, got {value!r}")
        if not 0 < self.noise_memory <= 1:
            raise ValueError(
                f"ControlParams.noise_memory must be in (0, 1], got {self.noise_memory!r}")
        if self.relearn_weight > 1:
            raise ValueError("ControlParams.relearn_weight must be in (0, 1] (1: a re-learning "
                             f"reading counts in full), got {self.relearn_weight!r}")
        if self.relearn_span_s < 0:
            raise ValueError("ControlParams.relearn_span_s must be >= 0 (0: a re-learning "
                             "reading counts as one at any sample period), got "
                             f"{self.relearn_span_s!r}")
        if not 0 <= self.partial_window < 1:
            raise ValueError("ControlParams.partial_window must be in [0, 1), got "
                             f"{self.partial_window!r}")
        if self.floor_trust < 0:
            raise ValueError("ControlParams.floor_trust must be >= 0 (0: the cold-start bound "
                             f"holds k until a changed workload is found), got "
                             f"{self.floor_trust!r}")
        if not self.saturation_sigmas >= 0:
            raise ValueError("ControlParams.saturation_sigmas must be >= 0 (0: use as the "
                             f"estimates have it), got {self.saturation_sigmas!r}")
        if self.drift_per_s < 0 or self.cold_sigmas < 0 or self.cold_samples < 0:
            raise ValueError("ControlParams.drift_per_s, cold_sigmas and cold_samples must be "
                             f">= 0, got {self.drift_per_s!r}, {self.cold_sigmas!r}, "
                             f"{self.cold_samples!r}")
        if self.demand_ticks < 1:
            raise ValueError(f"ControlParams.demand_ticks must be >= 1, got {self.demand_ticks!r}")
        if not isinstance(self.confirm_surprises, bool):
            raise ValueError("ControlParams.confirm_surprises must be True or False, got "
                             f"{self.confirm_surprises!r}")


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
    util_span_s: float = 0.0  # the time `util` describes (0: one NVML period)
    util_samples: int = 1  # how many NVML samples per process `util` averages


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
        util_span_s: float = 0.0,
        util_samples: int = 1,
    ) -> Observation:
        if not 0 < limit <= FULL_SHARE:
            raise ValueError(f"core limit of {key!r} must be in (0, 100], got {limit!r}")
        if policy not in CORE_POLICIES:
            raise ValueError(
                f"core policy of {key!r} must be one of {CORE_POLICIES}, got {policy!r}"
            )
        made = tuple.__new__(
            cls, (key, limit, policy, priority, spent, launches, waited_s, util, rate, burst,
                  util_span_s, util_samples)
        )
        if min(spent, launches, waited_s, rate, burst, util_span_s) < 0 or util_samples < 1:
            raise ValueError(f"negative usage figures for {key!r}: {made!r}")
        return made


class LoopState(NamedTuple):
    """What the law remembers about one container between ticks."""

    tokens_per_pct: float = 0.0  # k, tokens/s buying one percent of SM time; 0 = unknown
    lower_bound: bool = False  # k is only the cold-start bound, not yet learned
    spend_history: tuple[float, ...] = ()  # tokens/s per recent tick, newest last
    cost_per_launch: float = 0.0  # largest recent average cost of one launch
    util: float | None = None  # last measured SM percent
    spread: float = 0.0  # relative variance of the estimate of 1 / k
    noise: float = 0.0  # estimated NVML noise, points^2 per sample (0: the prior)
    noise_pairs: int = 0  # how many pairs of measurements the noise estimate rests on
    last_pair: tuple[float, float] = (0.0, 0.0)  # (spend, util) of the last measurement
    k_floor: float = 0.0  # the cold-start bound: k is at least this (0: none)
    target: float = 0.0  # the share the rate in force aimed at
    learned: int = 0  # how many measurements `k` has been learned from
    adopted: bool = False  # k was first learned under a rate found written (agent restart)
    hungry: bool = False  # it was rate-limited the tick before
    # seconds each `spend_history` entry lasted, newest last (the tick slows while all is calm);
    # entries without one (a state from before they were kept) are taken as the current tick
    tick_lengths: tuple[float, ...] = ()
    # the innovation of the last measurement when it was far beyond noise but is not yet
    # confirmed by the next one (0: none); see `_observe`
    surprise: float = 0.0


_BLANK = LoopState()


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
    used, lent = used_and_lent(limited, priorities, limits, capacity, order)
    return Shares(
        guarantee={c.key: g for c, g in zip(limited, guarantee, strict=True)},
        # no target above what there is to divide: a share and its loan can add up to a hair
        # more than the capacity they were cut from (2.67 + 97.33 > 100 in floats)
        target={
            c.key: min(capacity, max(g, u + extra))
            for c, g, u, extra in zip(limited, guarantee, used, lent, strict=True)
        },
    )


def used_and_lent(limited: Sequence[Claim], priorities: list[int], limits: list[float],
                  capacity: float, order: list[int] | None) -> tuple[list[float], list[float]]:
    """What each of the `limited` claims uses of `capacity` by priority (its demand, or its
    limit while hungry) and what it is lent of the rest: a work-conserving container up to
    whatever it can use, a strict one up to its limit. `order` is the guarantees' (from
    `_by_priority`), so that the spare is summed as they were."""
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
    return used, _water_fill(spare, limits, lend_caps)


def span_weights(span_s: float, lengths: Sequence[float]) -> tuple[float, ...]:
    """Weights of the ticks that lasted `lengths` seconds (newest last, the current tick's
    included) in the window a measurement describes.

    The window is `span_s` long and ends half the current tick ago (samples are read when they
    are finished, some time within the tick); each tick counts by how much of it lies inside,
    so the weights add up to one (fewer when the history is shorter than the window). Ticks
    are placed by their own lengths: the agent's tick grows while all is calm and shrinks on
    a change, and a measurement right after a change describes the slow ticks before it.
    """
    end = lengths[-1] / 2
    start = end + span_s
    weights = []
    hi = 0.0
    for length in reversed(lengths):  # newest first: it covers [0, its length) ago
        lo, hi = hi, hi + length
        weights.append(max(0.0, min(hi, start) - max(lo, end)) / span_s)
    weights.reverse()
    return tuple(weights)


def tick_lengths(prev: LoopState, dt_s: float, history_len: int) -> tuple[float, ...]:
    """The lengths of the container's history entries after this tick, newest (`dt_s`) last;
    entries the state has no length for are taken as `dt_s`."""
    if prev is _BLANK:
        return ()
    kept = len(prev.spend_history)
    known = prev.tick_lengths[-kept:] if kept else ()
    return ((dt_s,) * (kept - len(known)) + known + (dt_s,))[-history_len:]


def window_lengths(lengths: tuple[float, ...], dt_s: float, history_len: int
                   ) -> tuple[float, ...]:
    """`history_len` lengths for placing a window: before the history, ticks of `dt_s`."""
    return (dt_s,) * (history_len - len(lengths)) + lengths


def _matched_spend(
    history: Sequence[float], weights: Sequence[float], partial: float = 0.0
) -> tuple[float, float]:
    """(spending over the measurement's window, how far off that may be).

    The error bound is the change were the window one tick later and, when the window reaches
    back before the history, the part it does not know. Up to `partial` of the window may lie
    there: the oldest tick's spending stands in for it (the container's first tick ran
    unthrottled, or under the rate found written, as before it was followed). Beyond that,
    (0, 0): the measurement says nothing.
    """
    n = len(weights)
    unknown = 0.0
    if len(history) < n:
        unknown = sum(weights[: n - len(history)])
        if unknown > partial or not history:
            return 0.0, 0.0
        if unknown > _EPS:
            history = (history[0],) * (n - len(history)) + tuple(history)
        else:
            weights = weights[n - len(history) :]
            n = len(history)
    hist = history[-n:]
    total = sum(weights)
    if total <= _EPS:
        return 0.0, 0.0
    matched = sum([h * w for h, w in zip(hist, weights, strict=True)]) / total
    # the same window one tick later: weights shifted by one towards the newest tick
    later = sum([h * w for h, w in zip(hist[1:], weights[:-1], strict=True)])
    later_total = sum(weights[:-1])
    shifted = later / later_total if later_total > _EPS else matched
    off = abs(shifted - matched)
    if unknown > _EPS:
        off = max(off, unknown * hist[0])
    return matched, off


# What `_observe` learned about one container, in `LoopState`'s field order less `target`,
# which the allocation decides afterwards: the state is built once, with its target.
_Learned = tuple[
    float, bool, tuple[float, ...], float, float | None, float, float, int,
    tuple[float, float], float, int, bool, bool, tuple[float, ...], float,
]


def _observe(
    obs: Observation,
    prev: LoopState,
    dt_s: float,
    history_len: int,
    span: float,
    params: ControlParams,
) -> tuple[_Learned, bool, float]:
    """Update the container's model from one tick; returns (learned, hungry, demand).

    `span` is the time the measurement describes (used only with one: `obs.util`).
    """
    spent, rate_in_force, util = obs.spent, obs.rate, obs.util
    spend_rate = spent / dt_s
    history = (*prev.spend_history, spend_rate)[-history_len:]
    lengths = tick_lengths(prev, dt_s, history_len)
    weights = None
    if util is not None:
        weights = span_weights(span, window_lengths(lengths, dt_s, history_len))
    cost = prev.cost_per_launch * 0.99  # forget slowly, so one odd launch does not stick
    if obs.launches:
        cost = max(cost, spent / obs.launches)
    waited = obs.waited_s >= params.hungry_wait_fraction * dt_s
    # Long kernels make one tick's spending lumpy: the last few ticks' mean counts too.
    recent = history[-params.demand_ticks :]
    # Hysteresis: once rate-limited, it stays so until it spends clearly less, so that a
    # container using just about its rate does not flip every tick.
    fraction = params.hungry_spend_fraction - (params.hungry_hysteresis if prev.hungry else 0.0)
    spent_all = (
        rate_in_force < UNLIMITED_RATE
        and max(spend_rate, sum(recent) / len(recent))
        >= fraction * _judged_rate(rate_in_force, obs.limit, prev)
    )
    hungry = waited or spent_all

    k, lower_bound, learned = prev.tokens_per_pct, prev.lower_bound, prev.learned
    spread, noise = prev.spread, prev.noise or params.noise_prior
    noise_pairs, last_pair, k_floor = prev.noise_pairs, prev.last_pair, prev.k_floor
    adopted, surprise = prev.adopted, prev.surprise
    if k <= 0 and spend_rate > 0 and rate_in_force >= UNLIMITED_RATE:
        # Unthrottled for the tick: its share was at most 100%, or, when NVML already reports
        # it, about `util` (widened, as the sample and the tick do not cover the same moments).
        share_bound = FULL_SHARE
        if util is not None and util >= 1:
            share_bound = min(FULL_SHARE, params.boot_widening * util + 1)
        k, lower_bound = spend_rate / share_bound, True
        # only the 100% bound is certain: the first sample may describe another moment
        k_floor, spread = spend_rate / FULL_SHARE, params.initial_spread**2
    elif k > 0:
        spread += params.drift_per_s**2 * dt_s
    if prev is _BLANK:
        # First sight: the controller counts nothing spent (it has no earlier totals), which
        # is not what the container did.
        history = ()
    if util is not None and k <= 0 and weights is not None and util >= params.resolution:
        # Held at a rate it found written (the agent restarted): its first measurement.
        x, _ = _matched_spend(history, weights, params.partial_window)
        if x > 0:
            # as uncertain as one measurement: the rate it ran under was presumably right
            spread = max(noise * _noise_shape(util, params.noise_tail),
                         params.resolution**2 / 12) / obs.util_samples / util**2
            k, last_pair, adopted = x / util, (x, util), True
            learned += 1
    elif util is not None and k > 0 and weights is not None:
        x, misaligned = _matched_spend(history, weights, params.partial_window)
        if x <= 0 and not any(history):
            # idle for as long as the history holds: a surprise before it says nothing now (a
            # container launching one dear kernel every 2 s spends in every other window only)
            surprise = 0.0
        if x > 0 and util < params.resolution and x / k > params.missing_above:
            # Nothing seen of a container that spent for several percent: NVML missed its
            # processes (a reading of no use at all is not noise around such a share) ...
            far, beyond_noise = _zero_off(x, k, spread, noise, obs.util_samples, params)
            loose = spread * params.surprise_sigmas**2 * _ZERO_SPREAD > 1
            # Where noise reaches it, it is a reading like any other, once the estimate is close
            # enough that one reading moves k by a third at most (`_ZERO_SPREAD`; a looser one,
            # at cold start or re-learning, would be thrown far by it). A small share read
            # coarsely reads 0 often (three processes at 1.3 % each, sigma 8: one sample in
            # six); dropping those zeros read the container busier than it was, its k too low
            # and its rate with it (see the module note).
            if far or (loose and beyond_noise):
                if learned and surprise < 0:
                    # ... once. Twice in a row (the first kept as a surprise, as a far reading
                    # is), from a container measured before, further off than noise reaches or
                    # read while the estimate is too loose to learn from them: its tokens came
                    # to buy next to nothing (grids far larger for the same work). Its use is
                    # at most the resolution, so k is at least what that says, and so uncertain
                    # that the next reading re-learns it; zeros after that raise it again. (A
                    # container waking from idle reads 0 once, for the period before it woke,
                    # and then its use.) Zeros set aside while the estimate was loose, and
                    # nothing more, held a container of three processes whose launches came to
                    # cost 2.5 s of refill at 0.3 % of its 40 for good: one raise left its k a
                    # thousand times low and its estimate loose, and every zero after was set
                    # aside (simulated).
                    k, k_floor, surprise = max(k, x / params.resolution), 0.0, 0.0
                    spread = max(spread, params.initial_spread**2)
                    learned += 1
                else:
                    surprise = -x / k  # confirmed or dismissed by the next reading
                x = 0.0
        if x > 0:
            floor = params.resolution**2 / 12
            b = 1 / k
            # NVML's noise is a sampled proportion's: largest at 50 % use, less towards 0 and
            # 100 %. It is kept as at 50 % and scaled to the use expected now.
            shape = _noise_shape(b * x, params.noise_tail)
            # NVML's noise, from two measurements in a row at the same spending: their
            # difference is the noise of both, whatever the estimate of k.
            held_x, held_y = last_pair
            # Near 0 or 100 % the shape is only its floor (`noise_tail`), and the samples
            # barely scatter there: pairs taken there would teach a noise far below the one at
            # 50 %, and then every sample at 30 % would look like a changed workload.
            if (shape > params.noise_tail and held_x > 0
                    and abs(x - held_x) <= params.held_tolerance * max(x, held_x)):
                seen = (util - held_y * x / held_x) ** 2 / 2 * obs.util_samples / shape
                # A difference beyond what counts as a changed workload is the change, not
                # noise: taken in full, the filter would then distrust the very samples that
                # re-learn k (after a phase change, for seconds).
                seen = min(seen, params.surprise_sigmas**2 * noise)
                weight = max(params.noise_memory, 1 / (noise_pairs + 2))
                noise = max(floor, (1 - weight) * noise + weight * seen)
                noise_pairs += 1
            last_pair = (x, util)
            alignment = (b * misaligned) ** 2
            r = max(noise * shape, floor) / obs.util_samples + alignment
            p = spread * b * b
            innovation = util - b * x
            bound = params.surprise_sigmas**2 * (x * x * p + r)
            far = innovation * innovation > bound
            relearn = False
            if surprise * innovation > 0 or (far and (b == 0 or not params.confirm_surprises)):
                # Far beyond noise, and the next measurement off the same way: the workload
                # changed (b = 0: k was infinite, nothing to keep). Widen, so that it re-learns
                # fast from this one (not from the first, which might have been an outlier all
                # the same); the cold-start bound described the old one.
                p, k_floor, surprise = max(p, (innovation / x) ** 2), 0.0, 0.0
                relearn = params.confirm_surprises
            elif not far:
                surprise = 0.0
            else:
                # Once: an outlier until the next measurement says otherwise (a sampled
                # proportion of a small share is skewed: readings of 26 % for a true 8 %
                # come), counted no further out than the bound.
                surprise = innovation
                innovation = math.copysign(math.sqrt(bound), innovation)
            gain = p * x / (x * x * p + r)
            b = max(b + gain * innovation, _EPS * b)
            p *= 1 - gain * x
            if relearn:
                # What was known of the old workload says nothing of the new one: the reading
                # counts as one reading, no more. Picked for being far off, its noise likely is
                # far off too, and it comes amid the change's transient: trusted in full, one
                # 3 sigma off left k 13 % low for 3 s (simulated, samples every 1/6 s). Where
                # samples come often it counts as a part of a reading, so that the next few
                # weigh more; once a second, those are too few to average out what they then
                # weigh (see the module note).
                weight = params.relearn_weight if span <= params.relearn_span_s else 1.0
                p = max(p, r / (weight * x * x))
            # Evidence that straddles the start (spending before the first tick is unknown)
            # may point below the bound, which the unthrottled tick proved. Until the
            # estimate knows k better than the bound does (`floor_trust`): the tick's spending
            # is the container's word, counted as its shim counts (in steps, launches admitted
            # ahead of the GPU), and a bound 4 % high kept for good held a strict 50 %
            # container at 52.5 % (fake driver, real time: within the noise, no reading was
            # far enough to re-learn from). Dropped after the first few readings
            # instead, noise took a strict container alone below it at sigma 8 (simulated).
            k = max(1 / b, k_floor)
            spread, lower_bound = p * k * k, False
            learned += 1
            if spread <= params.floor_trust**2:
                k_floor = 0.0
    # Never spent a token: idle. Otherwise its recent peak, which a waking owner shows at once.
    demand = max(history[-params.demand_ticks :], default=0.0) / k + params.demand_margin \
        if k > 0 else 0.0
    last_util = prev.util if util is None else util
    learned_now = (k, lower_bound, history, cost, last_util, spread, noise, noise_pairs,
                   last_pair, k_floor, learned, adopted, hungry, lengths, surprise)
    return learned_now, hungry, demand


def _zero_off(x: float, k: float, spread: float, noise: float, samples: int,
              params: ControlParams) -> tuple[bool, bool]:
    """Whether a reading of 0 at spending `x` is further off than the filter's outlier bound
    (`surprise_sigmas` of its expected scatter: with ten containers at 10 % and sigma 8, noise
    alone reads 0 twice in a row now and then), and whether it is further off than NVML's
    noise alone reaches from the use `k` expects (the bound without the estimate's spread)."""
    expected = x / k
    r = max(noise * _noise_shape(expected, params.noise_tail), params.resolution**2 / 12)
    scatter = r / samples
    reach = params.surprise_sigmas**2
    return (expected * expected > reach * (expected * expected * spread + scatter),
            expected * expected > reach * scatter)


def _noise_shape(share: float, tail: float) -> float:
    """NVML's noise variance at `share` percent use, relative to that at 50 %."""
    p = min(1.0, max(0.0, share / FULL_SHARE))
    return max(tail, 4 * p * (1 - p))


def _state(learned: _Learned, target: float) -> LoopState:
    (k, lower_bound, spends, cost, util, spread, noise, pairs, pair, floor, count, adopted,
     hungry, lengths, surprise) = learned
    return LoopState(k, lower_bound, spends, cost, util, spread, noise, pairs, pair, floor,
                     target, count, adopted, hungry, lengths, surprise)


def rate_for(k: float, target: float, obs: Observation, state_spread: float, learned: int,
             params: ControlParams, k_floor: float = 0.0) -> float:
    """Tokens/s buying `target` percent; for a strict container still learning, less, though
    never less than the cold-start bound `k_floor` buys (that bound is proven, so a rate at it
    cannot exceed the limit; a weak first sample would otherwise pull the rate below it)."""
    if obs.policy == "strict" and 0 < learned < params.cold_samples and params.cold_sigmas:
        fade = 1 - learned / params.cold_samples
        k /= 1 + params.cold_sigmas * fade * math.sqrt(state_spread)
        k = max(k, k_floor)
    return k * target


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
    history_len = max(params.demand_ticks, math.ceil(params.history_s / dt_s) + 1)

    previous = [states.get(o.key, _BLANK) for o in observations]
    updated = [
        _observe(o, prev, dt_s, history_len, o.util_span_s or params.nvml_period_s, params)
        for o, prev in zip(observations, previous, strict=True)
    ]
    learned_all = [learned for learned, _, _ in updated]
    demands = [demand for _, _, demand in updated]
    if guess_newcomers(observations, previous, learned_all, demands, params):
        updated = [(learned, hungry, demand) for learned, (_, hungry, _), demand
                   in zip(learned_all, updated, demands, strict=True)]
    # what `off` containers use, by their last measurement
    off_use = sum(
        (learned[4] or 0.0)
        for o, (learned, _, _) in zip(observations, updated, strict=True)
        if o.policy == "off"
    )
    # A full GPU has nothing to lend: whoever spends there takes part as if rate-limited (the
    # GPU, not its bucket, is what holds it back), so nobody is lent a neighbour's share.
    full = gpu_full(learned_all, params)
    claims = [
        Claim(o.key, o.limit, o.policy, o.priority,
              hungry or (full and bool(learned[2]) and learned[2][-1] > 0), demand)
        for o, (learned, hungry, demand) in zip(observations, updated, strict=True)
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
            learned = (0.0, *learned[1:])
            k = 0.0
        if k <= 0 or (learned[11] and learned[10] < params.cold_samples
                      and o.rate < UNLIMITED_RATE):
            # No model yet. A rate already in force (written before an agent restart) is kept
            # until the model has been learned from a few measurements under it; otherwise the
            # container runs one tick unthrottled, which gives the cold-start bound.
            kept = (o.rate, o.burst) if o.rate < UNLIMITED_RATE else (UNLIMITED_RATE,) * 2
            decisions[o.key] = Decision(kept[0], kept[1], target, hungry, demand,
                                        _state(learned, prev.target))
            continue
        # within the documented bounds [min_rate, UNLIMITED_RATE], whatever was learned
        rate = _clamp_tokens(rate_for(k, target, o, learned[5], learned[10], params, learned[9]),
                             params.min_rate)
        # Room for the largest launches (one costing more than the bucket holds runs it into
        # a debt its refill must pay first, one lumpy launch a refill: the container reads
        # idle at its rate, and its claims exceed what the audit lends), up to a second of
        # refill: launch counts and tokens are the container's word, and the audit lends in
        # proportion to the burst.
        by_launch = _clamp_tokens(params.burst_launches * learned[3], 1, math.ceil)
        if o.rate < UNLIMITED_RATE and abs(rate - o.rate) <= params.rate_deadband * o.rate:
            # Noisy samples nudge k a little every time: a nudge is not worth a write (and
            # the shim's re-read); the bucket keeps what it has, unless its launches grew
            # past it.
            deeper = max(o.burst, min(by_launch, o.rate))
            decisions[o.key] = Decision(o.rate, deeper, target, hungry, demand,
                                        _state(learned, target))
            continue
        burst = max(_clamp_tokens(rate * params.burst_s, 1), min(by_launch, rate))
        decisions[o.key] = Decision(rate, burst, target, hungry, demand, _state(learned, target))
    return decisions


def guess_newcomers(
    observations: Sequence[Observation],
    previous: Sequence[LoopState],
    learned_all: list[_Learned],
    demands: list[float],
    params: ControlParams,
) -> bool:
    """A first guess of `k` for work-conserving containers that just ran their unthrottled tick
    with no NVML sample to tell their share (the cold-start bound assumes 100 %, so their
    first rates would buy a fraction of their targets until a sample comes, a second later on
    some GPUs). Together they used about what the GPU's other containers left (judged by their
    spending / k), and never taken as less than half their equal part among the containers that
    spent (the others' k may be off): each is given an equal share of that. A `strict` keeps
    the bound, which never lets it above its limit. Updates the lists in place; True when
    anything changed. Both laws call this one function.
    """
    new = [
        i for i, (prev, learned) in enumerate(zip(previous, learned_all, strict=True))
        if prev.tokens_per_pct <= 0 and learned[1] and learned[0] == learned[9] > 0
        and learned[10] == 0
    ]
    if not any(observations[i].policy == "work-conserving" for i in new):
        return False
    fresh = set(new)
    others = 0.0
    spending = 0
    for i, learned in enumerate(learned_all):
        history = learned[2]
        if history and history[-1] > 0:
            spending += 1
            if i not in fresh and learned[0] > 0:
                others += history[-1] / learned[0]
    left = max(FULL_SHARE - others, FULL_SHARE * len(new) / max(spending, len(new)) / 2)
    share = left / len(new)
    for i in new:
        if observations[i].policy != "work-conserving":
            continue
        learned = learned_all[i]
        k = learned[9] * FULL_SHARE / share
        learned_all[i] = (k, *learned[1:])
        demands[i] = max(learned[2][-params.demand_ticks :], default=0.0) / k \
            + params.demand_margin
    return True


def _judged_rate(rate_in_force: int, limit: float, prev: LoopState) -> float:
    """The rate a hungry container's spending is held against to stay hungry: its rate in
    force, but no more than its own limit's where a loan raised it above (see the module
    note). One held back by the GPU, not its bucket, spends the same under a loan as without:
    judged against the lent rate it read as not limited, the loan went, and its rate flipped
    between the two every tick for as long as it ran (simulated: 591 rate writes in 30 s)."""
    if prev.hungry and prev.tokens_per_pct > 0 and prev.target > limit:
        return min(rate_in_force, prev.tokens_per_pct * limit)
    return rate_in_force


def gpu_full(learned_all: Sequence[_Learned], params: ControlParams) -> bool:
    """Whether the GPU counts as full: its use, judged by spending / k, within
    `saturation_margin` of 100 % once counted `saturation_sigmas` deviations of those estimates
    higher (see the module note). Both laws call this one function."""
    loads = [(learned[2][-1] / learned[0], learned[5]) for learned in learned_all
             if learned[0] > 0 and learned[2]]
    in_use = sum([use for use, _ in loads])
    doubt = math.sqrt(sum([use * use * spread for use, spread in loads]))
    return in_use + params.saturation_sigmas * doubt >= FULL_SHARE - params.saturation_margin


def relearn(state: LoopState, params: ControlParams) -> LoopState:
    """A container's state whose readings from now on are taken on another basis than those
    `k` was learned from (a figure measured in a turn alone, on a time-sliced GPU): `k`
    kept as the first guess, as uncertain as the cold-start bound, so that the next readings
    re-learn it. Its noise is kept: forgotten as well (back to the prior), a strict 50 %
    container ran 7 points over its limit for seconds in one run of 40 (simulated H200). Its
    cold-start bound, if it still has one, is dropped, as where a changed workload is found: a
    turn often comes after a change of phase, and a bound from before one held the `k` of a
    container whose tokens came to buy four times more at 1.8 times the new phase's (simulated,
    the time-sliced bench's scenario 6, when the bound was kept for good)."""
    if state.tokens_per_pct <= 0:
        return state
    return state._replace(spread=max(state.spread, params.initial_spread**2), surprise=0.0,
                          k_floor=0.0)


def forget(states: Mapping[str, LoopState], keep: set[str]) -> dict[str, LoopState]:
    """Drop the memory of containers that are gone."""
    return {key: state for key, state in states.items() if key in keep}


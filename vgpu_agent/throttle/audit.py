"""How many tokens a container is believed to have spent in a tick: what its `state` claims,
but never more than its token bucket can have let through.

`state` is written by the container. A claim of more tokens than the rate and burst in force
allowed is provably false, and it is not harmless: the law learns what a percent of SM time
costs from spending against measured use, so a container claiming three times its spending
would be given about three times the rate it should have, run unthrottled and take its share
out of its neighbours'. The controller therefore believes at most what an upper bound of the
shim's bucket allows (`Bucket`): full (`burst`) when its rate begins to limit; in a tick it
lets through at most its balance plus the refill at the rate in force, and what is left,
capped at `burst`, is the next tick's bound.

What an honest shim may spend beyond that is lent, once, not every tick: the bound may fall to
`lent` below zero. `lent` is two bursts (the shim admits a launch once `min(cost, burst)`
tokens are there and takes its whole cost, a debt of up to one launch, which the law keeps
within half a burst; and its lazy refill may credit a raised rate for moments before the raise,
at most a burst where the bucket is capped) plus JITTER_S of refill (the caller measures the
time between a region's two reads with clocks taken around each read, so its own stalls cost
nothing; but a process stalled between admitting a launch and counting it adds its tokens late:
a variation that cancels from one tick to the next). A rate lowered at the end of the last tick
was in force until then: the refill counts the higher of the two. A container claiming the most
it may every tick is thus believed to spend its rate, and the law's feedback from measured use,
which the container cannot write, brings it to its share.

That feedback alone is not enough. A container caught claiming more than its bucket allowed
is believed to spend exactly its rate, whatever it really spends, so a reading says only that
its `k` is at most that rate over its use. Two lies then lasted for good on the simulated GPU:
ten thousand times its spending claimed from its first tick (which no bucket limits) gave it a
first rate thousands of times too high, which the law's averaged readings had not brought
down after 40 s; and a container running lightly while claiming its whole rate read as
rate-limited, had its rate raised reading after reading, then ran unthrottled. Its neighbour
was held at 49 % of a 60 % limit in both. So a caught container's rate is capped (`LiarCap`,
which the controller keeps until the container has not been caught for `LIAR_HOLD_S`): the
cap starts at the rate in force, halves while its use reads above its target, and rises only
as far as a move of the cap proved that its use follows its rate. The law decides below it.

A container claiming exactly what its bucket lets through is never caught by its claims, and
can play the second lie all the same (its neighbour at 49 % of a 60 % limit to the end of the
run on the simulated GPU). Watching for a rate raised far past the last one its use followed
caught it, but also honest containers in separate processes (stand-ins spending what their rate
grants, a fake NVML driver) whose first rate was thousands of times below their need, and whose
use read a few percent of noise while the law ramped them: capped, they got nothing. That watch
was not kept (`BENCHMARKS.md`). What gives such a container away is its use once it runs: its
claims follow its rate, so the law, learning from them, cuts a rate six orders of magnitude too
high a few percent a reading, while its use stays above its target and does not follow. A
limited container (strict, or work-conserving: its target includes what it is lent) whose own
use reads above its target reading after reading while the law's `k` fell and its use did not
follow (`OveruseWatch`) is capped as a caught one is. A time-sliced GPU's split is no reading
of a container's own: there the gap stays.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import math

JITTER_S = 0.1  # of refill lent for counters read early or late (a CFS period of stall)

# (upper bound of the shim's balance after the last tick, the rate in force during it)
Bucket = tuple[float, int]


def believed_spend(claimed: int, bucket: Bucket | None, rate: int, burst: int, dt_s: float
                   ) -> tuple[int, Bucket]:
    """(tokens believed spent in the tick, the bucket's bound after it).

    `bucket` is the bound after the previous tick, None when the bucket did not limit then;
    `rate` and `burst` are those in force during the tick, and limit (the caller passes no
    other); `claimed` is the difference of `state`'s totals, already clamped at 0."""
    # (Written with comparisons rather than min/max: it runs for every device every tick.)
    level, before = (burst, rate) if bucket is None else bucket
    fastest = rate if rate >= before else before
    lent = 2.0 * burst + fastest * JITTER_S
    # The bucket caps the balance, not what flows through it: spending as it refills, a tick
    # may take the balance it began with plus the whole refill.
    through = (level if level < burst else burst) + fastest * dt_s
    allowed = through + lent
    believed = claimed if claimed <= allowed else int(allowed) if allowed > 0 else 0
    left = through - believed
    return believed, (
        (left if left < burst else float(burst)) if left > -lent else -lent, rate)


def dear_launches(claimed: int, believed: int, launches: int, burst: int,
                  usual_cost: float, most: int = 1) -> tuple[float, int]:
    """(the cost, how many) of the launches dearer than the bucket that explain a claim past
    what the bucket let through, at most `most` of them (the container's processes: each waits
    for its own launch); (0.0, 0) when none do. The shim admits such a launch once its
    balance reaches the burst, or once the process waited its longest, and takes its whole
    cost: a debt the loan above may not cover (the law deepens the bucket only for launches it
    has seen, and never past a second of refill, `throttle/control.py`). The tick's other
    launches are taken to cost `usual_cost` (what the law learned a launch costs: the first
    dear launch may share its tick with cheap ones).

    Seen on the simulated GPU: an honest container whose launches came to cost 50 times more
    was caught at its first and its rate capped for seconds; at 500 times (2.5 s of refill
    each) it was caught at every launch and held at 0 %. Three processes of such launches,
    their waits ending together, ran three in one tick. `LaunchDebt` says which such debts are
    forgiven. The claim is still held to the allowance."""
    count = min(launches, max(1, most))
    if count < 1:
        return 0.0, 0
    dear = claimed - (launches - count) * usual_cost
    return (dear, count) if dear > count * burst and claimed - believed <= dear else (0.0, 0)


LAUNCH_DEBT_GRACE_S = 1.0  # the least time between two launch debts forgiven
_LAUNCH_DEBT_GRACE_NS = int(LAUNCH_DEBT_GRACE_S * 1e9)


class LaunchDebt:
    """One device's launch debts forgiven (`dear_launches`). The shim's wait is bounded per
    process: each of the container's processes waits `max_wait_ns` at most and then runs its
    launch in debt, so an honest container of n processes may run n such launches within
    `max_wait_ns`, and no more (an honest process cannot launch again before). One more is
    forgiven once the refill has repaid those before it (LAUNCH_DEBT_GRACE_S after the last
    at least). A container that claims such launches every tick is caught in all the others.

    Seen on the simulated GPU: a strict 40 % container of three processes whose launches came
    to cost 2.5 s of refill each, with one debt forgiven per `max_wait_ns` for the device, was
    caught at the second process's launch, capped, and held at 0-0.3 % in two seeds of three."""

    __slots__ = ("forgiven", "left", "max_wait_ns")

    def __init__(self, max_wait_ns: int) -> None:
        self.max_wait_ns = max_wait_ns
        # the earliest each debt forgiven within `max_wait_ns` can have been launched, oldest
        # first
        self.forgiven: list[int] = []
        self.left = 0.0  # tokens of their debt the refill has not repaid yet

    def repay(self, rate: int, dt_s: float) -> None:
        """A tick's refill at the rate in force, `dt_s` long."""
        if self.left > 0:
            self.left -= rate * dt_s

    def forgive(self, dear: float, burst: int, now_ns: int, earliest_ns: int,
                processes: int = 1, launches: int = 1) -> bool:
        """Whether the debt of `launches` dear launches costing `dear` tokens in all (0: none
        explains the claim, `dear_launches`) is forgiven, seen `now_ns`, launched
        `earliest_ns` at the earliest (the read before), for a container with `processes` on
        the GPU (at least one; the host's count, not its word)."""
        if not dear or launches < 1:
            return False
        most = max(1, processes)
        recent = [t for t in self.forgiven if now_ns - t < self.max_wait_ns]
        if len(recent) + launches <= most or (
                launches <= most and self.left <= 0
                and now_ns - recent[-1] >= _LAUNCH_DEBT_GRACE_NS):
            # debts still being repaid add up; one alone starts afresh
            owed = self.left if recent and self.left > 0 else 0.0
            self.forgiven = [*recent, *[earliest_ns] * launches][-most:]
            self.left = owed + dear - 2.0 * burst
            return True
        self.forgiven = recent
        return False


# A caught container's use reads off its target when it is further than this fraction of the
# target plus this many points (nearer, a reading is noise around a rate that binds).
LIAR_MARGIN = 0.15
LIAR_MARGIN_POINTS = 2.0
LIAR_HOLD_S = 5.0  # a cap is dropped after this long without a catch
# ... or this long for a container the overuse watch fired on: it may play its game again (run
# lightly while its rate is raised, then heavily), and a cap dropped 5 s after the last fire
# left its neighbour at 49.7 % of 60 through each heavy phase with one sample a second
OVERUSE_HOLD_S = 300.0
# The most a cap is raised at once towards the rate its target needs; to this to the power
# 1 + n after n raises in a row the use did not follow, up to LIAR_PROBE_STEPS.
LIAR_PROBE = 8.0
LIAR_PROBE_STEPS = 3
# After a raise its use did not follow (it is not using its rate), the readings to wait before
# the next: doubled at each such raise, up to the last.
IDLE_WAITS = (2, 4, 8, 16, 32)
# A cut a caught container's use did not follow is followed by a deeper one: by 2, 4, 8, then
# this at most. Deeper, the cap may land so far below the rate that binds that the use it
# leaves reads as noise, a raise back then shows no move past the margin, and the cap, taken
# for one a container does not use, stays there (seen: 65536 left it at 0.002 % of its share).
CAP_CUT_MOST = 16.0
# Where moves cannot be judged (`LiarCap.read`), a cap reading low this many readings in a row
# is raised by this factor.
SPLIT_RAISE_READINGS = 5
SPLIT_RAISE = 1.25


OVERUSE_READINGS = 12  # fresh readings in a row above the target by LIAR_MARGIN_POINTS
OVERUSE_ENDS = 3  # readings averaged at each end of such a run
OVERUSE_K_FALL = 0.5  # the law's k fell at least this far over the run, the use not with it


class OveruseWatch:
    """One device's own use against the target its rate aimed at, and against the law's `k`
    (tokens a second a percent of SM time) that rate came from. The container the claims
    cannot catch (it claims exactly what its bucket lets through while it runs lightly, so that
    its rate is raised reading after reading, then runs without pause) ran at 49 % beside a
    strict 60 % neighbour held to 49 % to the end of the run on the simulated GPU: its claims
    follow its rate, so the law, learning from them, brought a `k` six orders of magnitude too
    high down a few percent a reading, and the use did not follow. An honest container above
    its target after its tokens came to buy more (seen on the bench's node: its use doubling
    for 2 s at a time) is brought down by the law as fast, but its use follows `k` down.

    So the watch fires where the use read above the target by more than LIAR_MARGIN_POINTS
    OVERUSE_READINGS fresh readings in a row (noise around the target rarely falls on one side
    that often: 0.4 ** 12 at sigma 8 and 40 %, for readings as independent as the simulated
    GPU's; how correlated a real driver's are is not measured), while `k` fell to
    OVERUSE_K_FALL of what it was at the run's start or lower and the use did not fall halfway
    (in ratio) with it (the means of OVERUSE_ENDS readings at each end), or `k` did not move at
    all: the law learns from every reading paired with spending, so none was claimed for the
    use read (the same container, claiming nothing once its rate reached the law's ceiling, ran
    at 49 % for good).
    Such a container is capped as a caught one is (`LiarCap`), from the rate in force."""

    __slots__ = ("first", "k_start", "over", "recent")

    def __init__(self) -> None:
        self.over = 0  # readings in a row above the target by the margin
        self.k_start = 0.0  # the law's k when the run began
        self.first: list[float] = []  # the run's first readings
        self.recent: list[float] = []  # and its last

    def read(self, util: float, target: float, k: float) -> bool:
        """One fresh reading of its own use against the `target` its rate in force aimed at,
        from the law's `k`; whether the watch fires."""
        if util <= target + LIAR_MARGIN_POINTS or k <= 0:
            self.over = 0
            return False
        if not self.over:
            self.k_start, self.first, self.recent = k, [], []
        self.over += 1
        if len(self.first) < OVERUSE_ENDS:
            self.first.append(util)
        self.recent = [*self.recent[1 - OVERUSE_ENDS :], util]
        if self.over < OVERUSE_READINGS:
            return False
        if k == self.k_start:
            # the law learned nothing from all those readings: no spending was claimed for
            # them (every reading with spending moves k), yet the use was there
            return True
        if k > OVERUSE_K_FALL * self.k_start:
            return False
        # the use fell by less than half of k's fall (in ratio): it does not follow k
        return sum(self.recent) >= sum(self.first) * math.sqrt(k / self.k_start)


class LiarCap:
    """The most the rate of a container caught overclaiming may be (see the module note).

    Its claims are held to its rate, so they say nothing of what it spends; what shows whether
    its rate binds is whether its use follows a move of the cap. Each move (by `factor`) is
    judged two readings later, the first after it possibly describing the time before it: the
    use moved at least halfway (in ratio) with it and by the noise margin (a raise: on two
    readings in a row), and the rate for its target follows from the rate and the use (within
    x2 a step); a cut that the use did not follow is cut again while the use reads high; a
    raise it did not follow is taken back, and the next waits and reaches further.
    """

    __slots__ = ("before", "cap", "caught_ns", "ceiling", "cuts", "factor", "idle", "low",
                 "moved_from", "readings", "seen")

    def __init__(self, cap: int, caught_ns: int) -> None:
        self.cap = self.ceiling = self.before = cap
        self.caught_ns = caught_ns  # when it was last caught
        self.readings = 1  # fresh readings since the cap last moved (its first may act)
        self.factor = 1.0  # the last move of the cap, until judged (1: none pending)
        self.moved_from = 0.0  # the reading before that move
        self.idle = 0  # raises in a row the use did not follow
        self.low = 0  # readings in a row below the target (where moves cannot be judged)
        self.seen = False  # a raise's first reading showed a follow; the next must too
        self.cuts = 0  # cuts in a row its use did not follow

    def read(self, in_force: int, util: float, target: float, own: bool = True) -> None:
        """One fresh reading of its use against its `target`, under the rate `in_force`.

        Not `own` where the reading is a share of the GPU's use split by the tokens believed
        (a time-sliced GPU): the believed tokens are the rate, so that share follows any move
        of the cap at once, whatever the container does, and no move can be judged. There the
        cap is cut while the use reads high, and raised by SPLIT_RAISE while it reads low for
        SPLIT_RAISE_READINGS readings, never above the rate in force when it was first caught
        (a container running lightly while claiming its rate would otherwise raise it)."""
        if not own:
            self.readings += 1
            margin = target * LIAR_MARGIN + LIAR_MARGIN_POINTS
            self.low = self.low + 1 if util < target - margin else 0
            if self.readings >= 2 and util > target + margin:
                self._move(min(1.0, in_force / self.cap) / 2, util)
            elif (self.low >= SPLIT_RAISE_READINGS and in_force >= self.cap
                    and self.cap < self.ceiling):
                self._move(min(SPLIT_RAISE, self.ceiling / self.cap), util)
                self.low = 0
            self.factor = 1.0
            return
        self.readings += 1
        if self.readings < 2 + (IDLE_WAITS[min(self.idle, len(IDLE_WAITS)) - 1]
                                if self.idle and self.factor == 1.0 else 0):
            return
        factor, self.factor = self.factor, 1.0
        margin = target * LIAR_MARGIN + LIAR_MARGIN_POINTS
        if factor != 1.0:
            # at least halfway in ratio, and by the margin a reading's noise may take: at a
            # few percent of use, readings of whole percents wander by more than their value
            ratio = util / max(self.moved_from, 1.0)  # (0 reads as under one percent)
            moved = util - self.moved_from if factor > 1 else self.moved_from - util
            followed = moved >= margin and (
                ratio >= min(factor**0.5, LIAR_PROBE) if factor > 1 else ratio <= factor**0.5)
            if followed and factor > 1 and not self.seen:
                # a container running in bursts reads high in one sample of several: a raise
                # is followed only where two readings in a row show it
                self.seen, self.factor = True, factor
                return
            self.seen = False
            if followed or factor > 1:
                self.cuts = 0
            if followed and util >= 1:
                self.idle = 0
                self._move(in_force * min(2.0, max(0.5, target / util)) / self.cap, util)
                self.factor = 1.0  # set to its target: nothing more to judge
                return
            if factor > 1:  # raised, and its use did not follow: it does not use its rate
                self.idle += 1
                self._move(self.before / self.cap, util)
                self.factor = 1.0
                return
            if util > target + LIAR_MARGIN_POINTS:
                # cut, and its use did not follow: its rate does not bind, which the reading
                # alone could not tell from noise; cut again while its use is above its target,
                # deeper after each cut it did not follow (halved each time, a rate six orders
                # of magnitude too high took forty readings: a minute at a sample a second),
                # but never so deep that the raise back from a use it follows cannot be judged
                self.cuts += 1
                deeper = min(2.0 ** self.cuts, CAP_CUT_MOST)
                self._move(min(1.0, in_force / self.cap) / deeper, util)
                return
        if util > target + margin:
            self._move(min(1.0, in_force / self.cap) / 2, util)
        elif util < target - margin and in_force >= self.cap:
            # as far as its target would need, so that a use that follows moves past noise;
            # further after each raise it did not follow (a few percent of use, or none, may
            # be tokens that bought far less than before: they must be able to climb out)
            most = LIAR_PROBE ** (1 + min(self.idle, LIAR_PROBE_STEPS))
            self._move(min(most, target / max(util, 0.05)), util)

    def _move(self, factor: float, util: float) -> None:
        self.before, self.cap = self.cap, max(1, round(self.cap * factor))
        self.seen = False
        self.factor, self.moved_from, self.readings = factor, util, 0

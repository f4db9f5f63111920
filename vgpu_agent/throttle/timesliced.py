"""A time-sliced GPU's use, shared out among its containers.

Without MPS the contexts of a GPU's processes take turns, and NVML (seen on an H200, driver
580) gives each sample period whole to one process that ran in it, with the whole GPU's use as
its value. `TimeSlicedSplit` turns those periods, and the tokens each container spent, into a
use per container for the law (`throttle.controller` feeds it once per batch of samples).

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping

from vgpu_agent import native

_splitc, NOT_NATIVE_SPLIT_REASON = native.load("vgpu_agent.throttle._splitc")
# whether the split's loops over a GPU's containers run in C (`_splitc.c`), float for float
# with their Python references (`_newton_steps`, `ChangeWatch._judge`, `_age_parts`)
NATIVE_SPLIT = _splitc is not None

# periods after the last stamp with two processes or more before a GPU's samples are read as
# time-sliced again (`controller._utilization`); also how long a container given periods
# without spending tokens is charged for them after its last one
SHARED_PERIODS = 10
# ...but once a GPU has shown per-process samples (two processes that both used it in one
# period, which a time-sliced driver never gives), they are kept this long after the last such
# period: how a driver attributes its periods changes only with the GPU's set-up (MPS), while a
# container whose tokens buy next to nothing reads 0 for as long as it takes the law to learn
# that. Read as time-sliced meanwhile, the GPU's use was split by tokens, most of it charged to
# that container, and its strict-60 neighbour's rate nearly doubled (it ran at 99 % for tenths
# of a second, simulated).
PER_PROCESS_HOLD_S = 60.0


# what `TimeSlicedSplit.remeasure` drops: a figure, its batches, its doubt (None where absent)
KeptFigure = tuple[tuple[float, float, int] | None, tuple[int, float, float] | None,
              tuple[float, float, frozenset[str]] | None]


def read_as_periods(at: Mapping[int, list[tuple[int, int]]], owner: Mapping[int, str],
                    periods: int) -> tuple[list[list[str]], float]:
    """One read of a time-sliced GPU's samples (`at`: stamp -> (pid, value)) as the periods
    it stands for (each the containers of the process given it, "" for strangers, by `owner`)
    and the GPU's mean use over them. `periods`: how many sample periods passed since the last
    read (1 where it came in time).

    Measured on an H200 (driver 580) with processes at fixed rates: the driver answers a read
    with one sample per process given any period since the last read, stamped with the last
    period it was given, its value the GPU's use in the periods it was given over all of them.
    Read every period, that is the one process given it, with the whole use. Read every 0.4 s
    beside two processes each period read 99 gave 50 and 50 (or 33 and 66 where three periods
    passed), every second 40 and 60; a process alone read its own use however seldom it was
    read. So the use over a read is the sum of its values, and each process stands for its part
    of the periods. (Taken for periods of their own, the 50 and 50 of one late tick read as a
    GPU half idle: both strict containers' rates went up by 60 %, and a 50 % one ran at up to
    73 % for a second or two, every time the calm tick grew past the sample period.)

    A process listed idle (value 0) was given nothing. A read whose processes are all listed
    idle is that many periods of an idle GPU, given to nobody."""
    values: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    for stamp in sorted(at):
        for pid, value in at[stamp]:
            if value > 0:
                values.setdefault(pid, []).append(value)
                last[pid] = stamp
    if not values:
        return [[] for _ in range(max(1, periods, len(at)))], 0.0
    means = {pid: sum(v) / len(v) for pid, v in values.items()}
    total = sum(means.values())
    n = max(periods, len(means))
    # in which order they came is not told: spread evenly, each process's last period latest
    # (blocks of one owner read as runs to the change watch, which judges periods in order)
    slots = []
    for pid in means:
        count = max(1, round(n * means[pid] / total))
        slots += [((j + 1) / count, last[pid], pid) for j in range(count)]
    return [[owner.get(pid, "")] for _, _, pid in sorted(slots)], min(100.0, total)


class TimeSlicedSplit:
    """Shares a time-sliced GPU's use out among its containers.

    NVML gives each sample period to one process, whole: a container's part of the periods
    is evidence of its SM time, but only over many periods (taken alone, one reading is 0 or
    the whole GPU, and a law steering on a slow average of them oscillates). Tokens spent
    answer at once but say nothing of how long a container's kernels run per token. So the
    GPU's use is split by tokens spent this tick, each container's weighted by how much SM
    time its tokens buy relative to the others (its cost).

    The costs are learned from the periods, one at a time, as what they are: draws of one
    container among those spending, each with odds in proportion to its tokens spent then
    times its cost (a multinomial logit with the token shares as offsets). Each period moves
    the log of every cost by its surprise (given or not, against the chance predicted) over
    the information gathered so far (a Newton step; the information fades over about
    COST_PERIODS periods, and starts at PRIOR_INFO, the belief that costs are equal).
    Learning against the token shares of the moment, not from averages of periods and of
    tokens taken apart, keeps the estimate right while the law moves the rates; few periods
    move a cost little, and the split draws a cost towards 1 as far as it could be chance
    (`_believed`), so that containers of equal costs are split by their tokens, not by the
    noise of the periods. Periods given to processes of no container (strangers, "") are
    nobody's use here. A container lying about its tokens is corrected by its periods, as fast
    as the costs follow, and is never charged less than its part of the periods proves
    (`_floor_by_periods`); one whose processes spend no token at all (they run without the
    shim) is charged its part of the recent periods, the rest being split among the others.

    An application that changes phase (its tokens then buying four times the SM time they
    did) would be charged by its old cost for as long as the information takes to fade: a
    minute and more. So each period is also checked against the chance predicted
    (`ChangeWatch`): once a container's periods depart from it by more than chance allows,
    its cost's information is cut to RESTART_INFO, and its cost follows the new periods fast.
    Only its own: the others' costs relative to one another did not change (the chances
    depend on the ratios of costs alone). Its change moves every container's chances,
    though, so a neighbour's watch may fire too and have its information cut as well (seen
    in a few changes of thirty, for a container switching the tokens it writes). The costs it
    cut are not watched until they are informed to CONFIRM_INFO again: costs re-learning from
    little follow the periods on their own, and their departures from them are that learning,
    not a change. Judged all the same, they were taken for a second change 5-10 s after the
    first (a strict pair changing phase at 30 s and back at 90 s, simulated), cut the costs
    again and put both figures in doubt: in one run of 24, one of the pair was then held at
    27 % of its 40 to the end. Meanwhile the watch judges the others' periods among
    themselves (`_standing`): a container that changes phase over and over (or says it does by
    the tokens it writes) would otherwise blind it to every neighbour's change. Beside one
    whose cost went six times up and down every 80 periods, a neighbour whose tokens came to
    buy four times more was found after 41-396 periods, or never (2 seeds of 12), and now after
    41-267 (simulated). A pair with one re-learning leaves nothing to judge: a change there in
    that time is followed by the costs alone; a figure it left stale is meant to be asked
    afresh by `stale` once the costs are informed (not traced: no run here changed phase
    twice within that time).

    The GPU's use is not all work: measured on an H200, two processes taking turns with
    sparse launches kept it counted 99 % busy while they did 40 % of the work (66 % with
    launches ten times rarer), and a process alone read its own work exactly. Shared out whole,
    that use charges every container far above what it does, the law cuts their rates, the use
    stays (sparser launches hold the GPU all the same), and they are cut again: simulated, two
    strict 30 % containers with 20 us kernels ended at 4 % each. So a container's use per
    token is also learned where it is alone (every period of the batch given to it, no other
    container spending) and spends steadily (`_calibrate`), and while one container spending
    or more has such a figure, the use shared out is at most ALONE_MARGIN times the work their
    tokens explain (`_explained`): at their figures where all have one; otherwise the figures
    set one scale (`_counted_in_scale`) and the costs the periods show the rest, so that a
    newcomer that joined a container seen alone is covered too. Without a figure (containers
    never alone) the whole use is shared out, as before. A container whose periods show a change
    (`ChangeWatch`) has its figure in doubt: its tokens may no longer buy what they did alone.
    While its cost against the others' has risen beyond chance since, its figure rises by as
    much; where, once the costs are known again, it has not, the doubt ends and the figure stands
    (`_settle_doubts`). A figure in doubt counts as none for turns alone: the controller gives
    its container one, for which the figure is dropped (`remeasure`) and put back should the
    turn end without a new one (`restore`).

    A figure is not dropped by age, nor on the watch's word alone. Containers that share a GPU
    for hours are seldom alone again, and without a figure their use is shared out whole:
    dropped on a false alarm of the watch, as it once was (and after 3,000 batches), two strict
    30 % containers held at 29 % fell to 4 % for good, 3 to 27 minutes in (simulated). What an
    old figure risks: tokens that come to buy more SM time slowly, too slowly for the
    watch, are charged what they bought alone, and their container runs above its limit by
    that much (nothing here can tell that from the GPU counting itself busy). Where costs
    fall instead, the figures explain more than the GPU's use and bound nothing. Tokens that
    come to buy less are charged their old figure, and where that figure sets the scale (of a
    pair, the heavier over its cost does), the neighbour's charge too: where the periods show
    it long enough, the figure is measured afresh (`stale`); where they do not (kernels twice
    lighter, on a GPU whose periods follow its turns more than the work), it stands, unless the
    operator has figures measured afresh by age (`aged`).
    """

    __slots__ = ("alone", "apart", "batches", "beyond_work", "costs", "counts_beyond",
                 "disagreed", "disagreeing", "doubted", "left_out", "lifted", "margin",
                 "measured_at", "newly_left_out", "parts", "periods", "questioned", "rates",
                 "recounted", "relearning", "remade", "restarts", "solo", "solo_others", "solo_ran",
                 "spending", "told_left_out", "unseen", "watch")

    def __init__(self) -> None:
        # alloc_id ("" for strangers) -> (part of the periods, part of the tokens, periods)
        self.parts: dict[str, tuple[float, float, int]] = {}
        self.unseen: dict[str, int] = {}  # alloc_id -> periods since one was given to it
        # alloc_id -> (log of its SM time per token against the others', information)
        self.costs: dict[str, tuple[float, float]] = {}
        self.watch = ChangeWatch()
        self.restarts = 0  # times a change was found and the costs made to follow fast
        # alloc_id -> (use per token/s while alone, its spending then (tokens/s), steady
        # alone batches in a row)
        self.alone: dict[str, tuple[float, float, int]] = {}
        # alloc_id -> its trusted figure (and the batches it rests on) while a new one is being
        # made in its place, its spending having moved while alone: what it keeps should the
        # new one not be finished (`_calibrate`)
        self.remade: dict[str, tuple[tuple[float, float, int], tuple[int, float, float]]] = {}
        # alloc_id -> (its log cost against the others' mean before its periods showed a
        # change, that difference's variance, the others): a figure in doubt (`_settle_doubts`)
        self.doubted: dict[str, tuple[float, float, frozenset[str]]] = {}
        # alloc_id -> its recent log costs against the others' while its figure stood:
        # (periods so far, difference, variance, the containers spending, itself among them),
        # newest last
        self.apart: dict[str, deque[tuple[int, float, float, frozenset[str]]]] = {}
        # the containers spending (all with a trusted figure) whose figures were seen to
        # disagree with the costs -> (the most information the costs had while they did, the
        # periods seen then, the figures then) (`_figures_agree`)
        self.disagreed: dict[frozenset[str], tuple[float, int, dict[str, float]]] = {}
        self.periods = 0  # periods seen so far
        # containers whose costs' information the watch cut, until it is CONFIRM_INFO again:
        # the watch judges the others' periods only meanwhile (see the class note)
        self.relearning: set[str] = set()
        self.spending: list[str] = []  # the containers that spent in the last batch
        # (the GPU's use, what the tokens explain) of the last batch, where its use was bounded
        # by them; () where it was not
        self.beyond_work: tuple[float, float] | tuple[()] = ()
        self.lifted = 0.0  # of that use beyond, what floors by periods charged after all
        # whether the last batch's use passed BEYOND_SEEN times the work (the bound's widening
        # kept): the GPU counting busy beyond the work, not a figure a little light
        self.counts_beyond = False
        self.margin = ALONE_MARGIN  # the bound's factor on the explained work at the last batch
        # alloc_id -> (batches, mean, sum of squared deviations) of the figures of the steady
        # batches alone its figure rests on: how far they scatter (`spread`)
        self.batches: dict[str, tuple[int, float, float]] = {}
        # the container given a turn alone (`throttle/soloturn.py`) and the periods seen since
        self.solo: tuple[str, int] = ("", 0)
        # periods of that turn, past its first TURN_QUIET, given to another process: others
        # ran after the pause (a shim that ignores it, a process without one, a stranger)
        self.solo_others = 0
        self.solo_ran: set[str] = set()  # ... whose processes they were ("" for strangers)
        self.rates: dict[str, float] = {}  # alloc_id -> tokens/s it spent in the last batch
        # containers whose coarse figure was measured afresh once already (`coarse`)
        self.recounted: set[str] = set()
        # those whose figure was left out of the scale as far heavier in the last batch
        # (`_counted_in_scale`); of them, those never left out before while on the GPU (for
        # the operator to be told once); and those ever left out while on it
        self.left_out: set[str] = set()
        self.newly_left_out: set[str] = set()
        self.told_left_out: set[str] = set()
        # the container whose figure over its cost is the heaviest while the figures disagree
        # with the costs beyond chance, and the periods they have (net of those they agreed
        # in) since it became so (`stale`)
        self.disagreeing: tuple[str, int] = ("", 0)
        # alloc_id -> its figure when it was measured afresh for disagreeing (`stale`)
        self.questioned: dict[str, float] = {}
        # alloc_id -> the periods seen when its trusted figure was last measured (or adopted)
        self.measured_at: dict[str, int] = {}

    def share(self, owners: list[list[str]], busy: float, spent: Mapping[str, int],
              dt_s: float = 0.0, untrusted: Collection[str] = (), solo: str = "",
              per_launch: Mapping[str, float] | None = None) -> dict[str, float]:
        """Each container's use (percent) for this batch: `owners` per period used (the
        containers its processes belong to, "" for strangers), `busy` the GPU's mean use over
        those periods, `spent` the tokens each container spent over the tick, which lasted
        `dt_s` (0: not known, and no use per token is learned or applied). `untrusted`: the
        containers lately caught claiming more tokens than their bucket let through; where the
        use is bounded by what the tokens explain, what they do not explain is charged to
        them, not to nobody. `solo`: the container given a turn alone, the others paused by
        the controller (`_calibrate`). `per_launch`: tokens one launch costs, by container,
        where known (how far its spending may step between batches, `_calibrate`)."""
        self.periods += len(owners)
        before = self.solo[1] if solo and solo == self.solo[0] else 0
        if not before:
            self.solo_others, self.solo_ran = 0, set()
        self.solo = (solo, before + len(owners) if solo else 0)
        if solo:
            for n, given in enumerate(owners, before):
                others = [o for o in given if o != solo]
                if n >= TURN_QUIET and others:
                    self.solo_others += 1
                    self.solo_ran.update(others)
        parts = self.parts
        for alloc_id in [*spent, *(o for given in owners for o in given)]:
            parts.setdefault(alloc_id, (0.0, 0.0, 0))
        for gone in [a for a in parts if a and a not in spent]:
            del parts[gone]
            self.unseen.pop(gone, None)
        total = sum(spent.values())
        costs = self.costs
        for gone in [a for a in costs if a not in spent]:
            del costs[gone]
        for left in [k for k in self.disagreed if not k <= spent.keys()]:
            del self.disagreed[left]
        if total > 0:
            self._learn_costs(owners, {a: used / total for a, used in spent.items() if used})
        self._calibrate(owners, busy, spent, dt_s, per_launch or {})
        self.spending = spending = [a for a, used in spent.items() if used > 0]
        if dt_s > 0:
            self.rates = {a: used / dt_s for a, used in spent.items()}
        self.recounted &= spent.keys()
        for gone in [a for a in self.questioned if a not in spent]:
            del self.questioned[gone]
        for gone in [a for a in self.measured_at if a not in spent]:
            del self.measured_at[gone]
        self._settle_doubts(spending)
        self._remember_apart(spending)
        self.left_out = set()
        explained = self._explained(spent, dt_s, len(owners))
        self.told_left_out &= spent.keys()
        self.newly_left_out = self.left_out - self.told_left_out
        self.told_left_out |= self.left_out
        self.beyond_work = ()
        unseen = self.unseen
        if _splitc is None or _splitc.age(parts, unseen, owners, spent, total,
                                          PERIODS_REMEMBERED) is None:
            _age_parts(parts, unseen, owners, spent, total)
        # A container whose processes are given periods without spending a token runs
        # without the shim (or says so in `state`): it is charged its part of the recent
        # periods, while it keeps being given some. Not the periods of this batch alone: in a
        # batch it was not given, its neighbours would be charged the whole GPU, and the law,
        # which takes such all-or-nothing readings for missed samples, would starve them.
        unshimmed = {a: parts[a][0] * busy for a, used in spent.items()
                     if not used and unseen.get(a, SHARED_PERIODS) < SHARED_PERIODS}
        weights = explained[1] if explained is not None else {
            a: used * _believed(*costs[a]) for a, used in spent.items() if used}
        weighted = sum(weights.values())
        ours = max(0.0, busy * (1 - min(1.0, parts.get("", (0.0, 0.0, 0))[0]))
                   - sum(unshimmed.values()))
        whole = ours
        # a figure is an estimate: the bound leaves room for as far as it may be off (the
        # trusted ones': a figure still being made bounds nothing, nor widens the bound)
        alone = self.alone
        widened = 1 + SPREAD_SIGMAS * max(
            [self.spread(a) for a in self.spending
             if a in alone and alone[a][2] >= ALONE_READINGS], default=0.0)
        self.margin = margin = ALONE_MARGIN * widened
        self.counts_beyond = False
        if explained is not None and busy > margin * explained[0]:
            # what the GPU counts busy beyond what their tokens buy is nobody's work
            self.beyond_work = (busy, explained[0])
            self.counts_beyond = busy > BEYOND_SEEN * widened * explained[0]
            ours = min(ours, margin * explained[0])
            busy = margin * explained[0]
        shares = {a: ours * w / weighted if weighted > 0 else 0.0 for a, w in weights.items()}
        liars = [a for a in untrusted if a in weights] if whole > ours else []
        if liars:
            # Its tokens explain nothing: a container that claimed many while working
            # lightly, then worked hard, was charged by the cost its periods had shown, and
            # took 5 points of its neighbour's 60 (seen with a figure from the neighbour).
            self.beyond_work, self.counts_beyond = (), False
            on = sum([weights[a] for a in liars])
            for alloc_id in liars:
                shares[alloc_id] += (whole - ours) * (weights[alloc_id] / on if on > 0
                                                      else 1 / len(liars))
        floors = self._floors(weights, busy)
        self.lifted = _lift_from(shares, floors, whole - ours) if self.beyond_work else 0.0
        _floor_by_periods(shares, floors)
        if explained is not None and explained[2]:
            self._floor_by_figures(shares, spent, dt_s, whole, explained[2])
        return dict.fromkeys(spent, 0.0) | shares | unshimmed

    def _floor_by_figures(self, shares: dict[str, float], spent: Mapping[str, int],
                          dt_s: float, ours: float, floored: Collection[str]) -> None:
        """Each container in `floored` (with a trusted figure) is charged at least what its
        tokens bought alone, as the bound would charge it (up to `ours`): every one while a
        figure in doubt is raised (`_figure`), every other while one is in doubt unraised
        (its cost fell, or rose within chance so far: charged by its figure, perhaps four
        times its work now, it left its neighbours charged less than they did, and a strict
        60 % one ran at 66-89 % for 18 s, until the doubt ended, simulated), and, where figures
        disagree with the costs, one whose figure over its cost was left out of the scale as
        far heavier (`_counted_in_scale`). That one's figure is what its own tokens bought
        alone; charged by the scale of the others' figures instead, a tenant running heavier
        kernels while alone was charged by its noisy cost and crept to 33 % of its strict 30
        over two minutes, 38 % over one 10 s (simulated, the trio of `bench_launch_holds.py
        --odd`, one seed of eight; held at its heavy figure, 7 %, its own choice). The raise
        takes the periods at their word that the doubted container's tokens came to buy more,
        while they may as well show the others' buying less, or (on a GPU counted busy beyond
        the work, where periods follow turns on the GPU) the time slices going to it beyond its
        work: where the raise made the weights explain more than the GPU's use, the whole use
        was shared by them, and a strict 30 % container, charged 30-37, did 38-45 (simulated,
        its neighbour's figure raised e^1.6).
        The safe side for each container's limit, at a cost where the others' tokens did come
        to buy less: two containers changing phase the opposite ways at once (four times
        more, a quarter) are held further from their shares until measured again (simulated,
        see BENCHMARKS.md). Not without a raise: where figures measured alone explain more
        than the use together (tokens buying less beside others), shared by the weights is
        right, and held to its figure an honest container ran at 30 % of its 40 (simulated)."""
        if not math.isfinite(self.margin):
            return  # no bound (the margin infinite): the bound charges nothing by figures
        for alloc_id, (figure, _, steady) in self.alone.items():
            if steady < ALONE_READINGS or alloc_id not in shares or alloc_id not in floored:
                continue
            own = min(ours, self.margin * figure * spent[alloc_id] / dt_s)
            if own > shares[alloc_id]:
                if self.beyond_work:
                    self.lifted += own - shares[alloc_id]
                shares[alloc_id] = own

    def _learn_costs(self, owners: list[list[str]], tokens: Mapping[str, float]) -> None:
        """Each period given to one of the containers spending (`tokens`: their parts of the
        tokens spent) moves their costs; see the class note."""
        costs = self.costs
        for alloc_id in tokens:
            costs.setdefault(alloc_id, (0.0, PRIOR_INFO))
        if len(tokens) < 2:
            return  # alone, it is given every period it can be: nothing to learn
        drawn = [given[0] for given in ([a for a in g if a in tokens] for g in owners)
                 if len(given) == 1]
        if not drawn:
            return
        chances = _chances_of(costs, tokens)
        relearning = self.relearning
        for alloc_id in [a for a in relearning if a not in costs or costs[a][1] >= CONFIRM_INFO]:
            relearning.discard(alloc_id)
        changed = self.watch.changed(*_standing(chances, drawn, relearning))
        if changed:
            self.restarts += 1
            for alloc_id in changed:
                if alloc_id in self.alone and alloc_id not in self.doubted:
                    self.doubted[alloc_id] = self._before_change(alloc_id, tokens)
            for alloc_id in changed:
                log_cost, info = costs[alloc_id]
                costs[alloc_id] = (log_cost, min(info, RESTART_INFO))
            relearning.update(changed)
        if _splitc is None or _splitc.learn(costs, tokens, drawn, FADING,
                                            _LOG_COST_RANGE) is None:
            _newton_steps(costs, tokens, drawn, FADING, _LOG_COST_RANGE)

    def figures(self) -> dict[str, tuple[float, float]]:
        """Each trusted figure as the bound takes it now (`_figure`), with the spending it was
        measured at: alloc_id -> (use per token/s, tokens/s). What `adopt` takes back, which
        takes them as exact: those whose batches scattered by more than FILE_SPREAD are left
        out (learned again after a restart, or measured in a turn alone). A container whose
        figure is being made again gives the trusted one it keeps meanwhile (`remade`)."""
        spending = self.spending
        found = {a: (self._figure(a, spending) if len(spending) > 1 and a in spending
                     else figure, rate)
                 for a, (figure, rate, steady) in self.alone.items()
                 if steady >= ALONE_READINGS and self.spread(a) <= FILE_SPREAD}
        for a, ((figure, rate, _), batches) in self.remade.items():
            if _spread(batches) <= FILE_SPREAD:
                found[a] = (figure, rate)
        return found

    def spread(self, alloc_id: str) -> float:
        """How far a figure may be off, relative to it: the standard error of the mean of the
        batches it rests on (ALONE_AVERAGED of them at most are averaged); 0 for one adopted.
        NVML's samples of a process alone were exact on the H200; the simulator's noisy plants
        scatter them (sigma 3 points at a use of 4 % is three quarters of it)."""
        return _spread(self.batches.get(alloc_id, (0, 0.0, 0.0)))

    def trusted_figures(self) -> dict[str, float]:
        """Each trusted figure as measured alone (use per token/s), not raised by a doubt."""
        return {a: figure for a, (figure, _, steady) in self.alone.items()
                if steady >= ALONE_READINGS}

    def measured(self) -> set[str]:
        """The containers with a trusted figure (those `trusted_figures` gives)."""
        return set(self.trusted_figures())

    def costs_apart(self) -> bool:
        """Whether the periods show two of the containers spending with costs APART_FACTOR
        or more apart, beyond chance (DOUBT_SIGMAS deviations of their difference)."""
        learned = [self.costs[a] for a in self.spending if a in self.costs]
        if len(learned) < 2:
            return False
        # No pair is further apart than the extremes, nor allowed less by chance than the two
        # best informed would be: where even that does not part them, none does, and a hundred
        # containers of near costs cost one pass, not five thousand pairs (0.6 ms a tick).
        logs = [x for x, _ in learned]
        most_info = max(i for _, i in learned)
        if max(logs) - min(logs) <= _LOG_APART + DOUBT_SIGMAS * math.sqrt(1 / most_info):
            return False
        return any(abs(x - y) > _LOG_APART + DOUBT_SIGMAS * math.sqrt(0.5 / i + 0.5 / j)
                   for n, (x, i) in enumerate(learned) for y, j in learned[n + 1:])

    def in_doubt(self) -> set[str]:
        """The containers whose figure is in doubt: their periods showed a change since it was
        measured (`_settle_doubts`). A turn alone measures it afresh (`remeasure`)."""
        return set(self.doubted)

    def coarse(self) -> set[str]:
        """The containers whose trusted figure was read where a whole percent is a large part
        of the reading (below COARSE_READING %) and whose spending has since grown
        COARSE_GROWTH-fold or more: the figure, extrapolated that far, carries the reading's
        rounding with it. Measured on an H200: a container whose turn came while its rate was
        cut to 3.8 % of its work read 3, a figure a fifth light, and once it spent nine times as
        much it did 37 % of its unthrottled work for its strict 30. Once per container: a turn
        alone measures it afresh at the spending of the day (`remeasure`)."""
        found = set()
        for alloc_id, (figure, rate, steady) in self.alone.items():
            if (steady >= ALONE_READINGS and alloc_id not in self.recounted
                    and figure * rate < COARSE_READING + TRUNCATED
                    and self.rates.get(alloc_id, 0.0) >= COARSE_GROWTH * rate):
                found.add(alloc_id)
        return found

    def stale(self) -> set[str]:
        """The container whose figure has disagreed with the costs the periods show for
        STALE_PERIODS (net of periods they agreed in), its figure over its cost the heaviest:
        its tokens may buy less than they did alone (a change of phase the watch missed, or
        whose doubt ended as a fall, not a rise: `_settle_doubts`), and the figure, largest over
        its cost, sets the scale every container of a pair is charged by. Simulated, a strict
        30 % container whose kernels came to buy a quarter of the SM time they did was charged at
        its old figure, and it and its strict 30 % neighbour both ran at 7 % for the minute to
        the end of the run. Once per figure: measured afresh to within ALONE_AGREE of it (an
        honest figure the periods read apart, or a tenant playing heavy while alone), it is not
        asked again until it moves. Empty where none is."""
        heaviest, periods = self.disagreeing
        if periods < STALE_PERIODS or heaviest not in self.alone:
            return set()
        before = self.questioned.get(heaviest)
        if before is not None and abs(math.log(self.alone[heaviest][0] / before)
                                      ) <= _LOG_ALONE_AGREE:
            return set()
        return {heaviest}

    def aged(self, periods: int) -> set[str]:
        """The containers whose trusted figure was measured (or adopted) `periods` periods
        ago or more: what an operator who asked for figures to be measured again by age
        (`throttle_figure_max_age_seconds`) has measured afresh. Kernels twice lighter read
        within the agreement's reach on the H200 plant (its periods follow the turns on the GPU
        more than the work), and their container stays charged at its old figure, at half its
        share (simulated, `bench_launch_holds.py --phase`): nothing else finds that."""
        now = self.periods
        return {a for a in self.trusted_figures()
                if now - self.measured_at.get(a, now) >= periods}

    def remeasure(self, alloc_id: str) -> KeptFigure:
        """Drops a container's figure for a turn alone to measure afresh (kept as it was, a
        figure in the making would be averaged into it); what `restore` puts back should the
        turn end without a trusted one."""
        if alloc_id in self.coarse():
            self.recounted.add(alloc_id)
        if alloc_id in self.stale():
            self.questioned[alloc_id] = self.alone[alloc_id][0]
            self.disagreeing = ("", 0)
        if alloc_id in self.remade:
            self._unmade(alloc_id)  # the trusted one is what the turn would put back
        return (self.alone.pop(alloc_id, None), self.batches.pop(alloc_id, None),
                self.doubted.pop(alloc_id, None))

    def end_turn(self, alloc_id: str) -> None:
        """A turn alone is over: where a figure was being made again after one the turn
        trusted, the trusted one stands (the turn cannot finish the other)."""
        if alloc_id in self.remade:
            self._unmade(alloc_id)

    def restore(self, alloc_id: str, kept: KeptFigure) -> None:
        """Puts back what `remeasure` dropped, unless a trusted figure was measured since
        (the last one, where a figure was being made again after it: `end_turn`)."""
        self.end_turn(alloc_id)
        if self.steady(alloc_id) >= ALONE_READINGS:
            return
        figure, batches, doubt = kept
        if figure is None:
            return
        self.alone[alloc_id] = figure
        if batches is not None:
            self.batches[alloc_id] = batches
        if doubt is not None:
            self.doubted[alloc_id] = doubt

    def steady(self, alloc_id: str) -> int:
        """The steady batches alone a container's figure rests on (0: none)."""
        figure = self.alone.get(alloc_id)
        return figure[2] if figure is not None else 0

    def adopt(self, figures: Mapping[str, tuple[float, float]]) -> None:
        """Trust figures learned before (by this split's predecessor, before an agent
        restart) for containers that have none yet. They face what a figure learned here
        faces: dropped when their container leaves, in doubt when its periods show a
        change."""
        for alloc_id, (figure, rate) in figures.items():
            if figure > 0 and rate > 0 and alloc_id not in self.alone:
                self.alone[alloc_id] = (figure, rate, ALONE_READINGS)
                self.measured_at[alloc_id] = self.periods

    @property
    def uncharged(self) -> float:
        """The points of the last batch's use that nobody was charged (0: all of it was)."""
        if not self.beyond_work:
            return 0.0
        busy, explained = self.beyond_work
        return max(0.0, busy - self.margin * explained - self.lifted)

    def _calibrate(self, owners: list[list[str]], busy: float, spent: Mapping[str, int],
                   dt_s: float, per_launch: Mapping[str, float]) -> None:
        """Learn a container's use per token/s from a batch in which it was alone: every
        period used was given to it, no other container spent, and no other process was given
        one in the last ALONE_QUIET periods (TURN_QUIET in a turn alone, whose pause the
        controller wrote: the periods read at its first tick may be from before it, and the
        next one straddle it; waiting ALONE_QUIET there left a turn no time to average its
        figure over more than three batches, and with the simulated sample noise a figure 18 %
        low let a strict 40 % neighbour of a container understating its tokens run at 48 %).
        A batch's reading is taken TRUNCATED (half a percent) up: NVML truncates.
        Trusted once its spending held within
        ALONE_STEADY for ALONE_READINGS such batches in a row (the periods and the tick do not
        cover quite the same moments), or within one launch (`per_launch`) where a batch holds
        enough of them that one is at most LAUNCH_STEADY of it: a strict rate buys a few big
        launches a tick, and a container alternating four and five of 262,144 tokens (a
        quarter apart) never held steady, its turns ended without a figure, and one four
        times lighter than its figure from before ran at 10 % of its strict 40 (simulated).
        A batch read at no use at all (a sample NVML missed, or one before it launched)
        teaches nothing. A figure is kept, however long its container shares the GPU after,
        until the container leaves or its periods show a change (see the class note on why not
        by age)."""
        alone, batches, remade = self.alone, self.batches, self.remade
        for gone in [a for a in alone if a not in spent]:
            del alone[gone]
        for gone in [a for a in batches if a not in alone]:
            del batches[gone]
        for gone in [a for a in remade if a not in alone]:
            del remade[gone]
        spending = [a for a, used in spent.items() if used > 0]
        if len(spending) > 1:
            for alloc_id in [a for a in spending if a in remade]:
                self._unmade(alloc_id)  # not alone: its new figure cannot be finished now
        if len(spending) != 1 or busy < 1:
            return
        alloc_id = spending[0]
        before = alone.get(alloc_id)
        unseen = self.unseen
        solo, solo_periods = self.solo
        quiet = ALONE_QUIET
        if solo == alloc_id:
            if solo_periods - len(owners) < TURN_QUIET:
                return  # periods of the turn's first moments, which may predate its pause
            quiet = TURN_QUIET
        if (dt_s <= 0 or not owners or any(given != [alloc_id] for given in owners)
                or any(unseen.get(other, quiet) < quiet
                       for other in self.parts if other != alloc_id)):
            # Not alone: another process (a stranger's, or one of a container spending no
            # token) ran lately. A figure still being made starts over (the trusted one it
            # was to replace kept).
            if before is not None and before[2] < ALONE_READINGS:
                self._unmade(alloc_id)
            return
        rate = spent[alloc_id] / dt_s
        figure = (busy + TRUNCATED) / rate
        self.doubted.pop(alloc_id, None)  # measured afresh
        n, mean, squares = batches.get(alloc_id, (0, 0.0, 0.0))
        if before is not None and abs(rate - before[1]) <= _steady_step(
                max(rate, before[1]), per_launch.get(alloc_id, 0.0) / dt_s):
            steady = before[2] + 1
            n, delta = n + 1, figure - mean
            mean += delta / n
            squares += delta * (figure - mean)
            if steady > ALONE_READINGS:  # trusted already: an average of the steady batches
                figure = before[0] + (figure - before[0]) / min(steady, ALONE_AVERAGED)
        else:
            if before is not None and before[2] >= ALONE_READINGS:
                remade[alloc_id] = (before, batches.get(alloc_id, (0, 0.0, 0.0)))
            steady, n, mean, squares = 1, 1, figure, 0.0
        alone[alloc_id] = (figure, rate, steady)
        batches[alloc_id] = (n, mean, squares)
        if steady >= ALONE_READINGS:
            self.measured_at[alloc_id] = self.periods
            remade.pop(alloc_id, None)

    def _unmade(self, alloc_id: str) -> None:
        """Drops a container's figure in the making, putting back the trusted one it was to
        replace, if any. A turn alone whose container's spending stepped by a fifth (a launch
        or two fewer in a batch: a strict rate buys few) after its figure was trusted ended
        with its figure in the making: the figure from before the turn, of the phase before,
        was put back, and the container, now four times lighter, ran at 9.5 % of its strict 40
        to the end of the run (simulated)."""
        kept = self.remade.pop(alloc_id, None)
        if kept is None:
            self.alone.pop(alloc_id, None)
            self.batches.pop(alloc_id, None)
        else:
            self.alone[alloc_id], self.batches[alloc_id] = kept

    def _explained(self, spent: Mapping[str, int], dt_s: float, periods: int = 1
                   ) -> tuple[float, dict[str, float], set[str]] | None:
        """The use the tokens spent explain, each container's weight in it (its part of
        that use, up to a common factor), and the containers to charge at least at their own
        figures (`_floor_by_figures`); None unless two containers or more spent and at least
        one has a trusted figure from when it was alone. Those left out of the scale are kept
        in `left_out` (for the operator to be told).

        Every one with a figure, the figures agreeing with the costs the periods show (their
        ratios, within what chance allows the costs): each one's tokens at its figure.
        Otherwise one figure sets the scale (use per token at a cost of 1: the largest of
        those `_counted_in_scale`) and the costs the periods show the rest: each one's tokens
        at its believed cost times the scale. So a container whose tokens came to buy more
        than they did alone is charged what the periods show they buy now, not what they
        bought then, and one without a figure (a newcomer) what its cost says."""
        spending = [a for a, used in spent.items() if used > 0]
        if dt_s <= 0 or len(spending) < 2:
            return None
        alone, costs = self.alone, self.costs
        measured = [a for a in spending if a in alone and alone[a][2] >= ALONE_READINGS]
        if not measured:
            self.disagreeing = ("", 0)
            return None
        figures = {a: self._figure(a, spending) for a in measured}
        # while a figure in doubt is raised, every container measured is floored at its own;
        # while one is in doubt unraised, every other (`_floor_by_figures`)
        if any(figures[a] != alone[a][0] for a in measured):
            floored = set(measured)
        elif any(a in self.doubted for a in spending):
            floored = {a for a in measured if a not in self.doubted}
        else:
            floored = set()
        # each figure as measured alone over its learned cost, with that cost's information:
        # what agreement is judged on (for the scale, and for a figure gone stale)
        scales = self._scales(measured)
        self._track_disagreement(scales if len(measured) == len(spending) else {}, periods)
        if len(measured) == len(spending) and self._figures_agree(figures):
            weights = {a: figures[a] * spent[a] / dt_s for a in spending}
            return sum(weights.values()), weights, floored
        believed = {a: _believed(*costs.get(a, (0.0, PRIOR_INFO))) for a in spending}
        # which figures count is judged on them as measured alone, against the costs learned
        # (with what chance allows them); the scale is the largest of those counted as the
        # split takes them (raised by a doubt, if so)
        counted = _counted_in_scale(scales)
        scale = max(figures[a] / believed[a] for a in counted)
        weights = {a: scale * believed[a] * spent[a] / dt_s for a in spending}
        # a figure left out as far heavier is what its own container's tokens bought alone:
        # the safe side for its limit is to charge it at least that
        self.left_out = set(measured) - counted
        return sum(weights.values()), weights, floored | self.left_out

    def _scales(self, measured: Iterable[str]) -> dict[str, tuple[float, float]]:
        """Each of `measured` (with a trusted figure): the log of its figure as measured alone
        over its learned cost, and that cost's information."""
        costs, alone = self.costs, self.alone
        scales = {}
        for alloc_id in measured:
            log_cost, info = costs.get(alloc_id, (0.0, PRIOR_INFO))
            scales[alloc_id] = (math.log(alone[alloc_id][0]) - log_cost, info)
        return scales

    def _track_disagreement(self, scales: Mapping[str, tuple[float, float]], periods: int
                            ) -> None:
        """Counts the `periods` of this batch for or against the heaviest figure over its cost
        among `scales` (`_scales` of every container spending, each with a trusted figure;
        none where not all have one): for, where no other figure agrees with it
        (`_agree`, as `_counted_in_scale` judges agreement), the costs
        informed (CONFIRM_INFO) past the cut of a change (`stale`). One that another figure
        agrees with is corroborated: among three containers, two honest ones beside a tenant
        playing light while alone were both measured afresh for nothing, a pause of the
        others each (simulated, `bench_launch_holds.py --odd`)."""
        heaviest, counted = self.disagreeing
        if len(scales) < 2:
            self.disagreeing = ("", 0)
            return
        top = max(scales, key=lambda alloc_id: scales[alloc_id][0])
        unmatched = min(info for _, info in scales.values()) >= CONFIRM_INFO and not any(
            _agree(scales[top], scale) for alloc_id, scale in scales.items() if alloc_id != top)
        if unmatched:
            self.disagreeing = (top, counted + periods if top == heaviest else periods)
        else:
            self.disagreeing = (heaviest, max(0, counted - periods))

    def _figures_agree(self, figures: Mapping[str, float]) -> bool:
        """Whether the figures of the containers spending (every one has one) agree with the
        costs the periods show: their ratios within ALONE_AGREE of the costs', beyond what
        chance allows the least informed cost. Figures once seen to disagree agree again, as
        long as none has moved by ALONE_AGREE since, only with costs as informed as they were
        then (that information fading as the costs' own does, period by period): a change found
        by the watch cuts the costs' information (RESTART_INFO), and what chance then allows
        would let almost any figure agree, one taken light on purpose too. A tenant playing
        light while alone (a quarter of its kernels' time) had its figure 1.39 (log) from the
        costs, beyond the 0.55 chance allowed them, until a change was found; after the cut
        chance allowed 1.2, its figure (measured afresh, as light) was believed, and it ran at
        69 % of its strict 30 for 5 s, until the costs had learned enough to disagree again
        (simulated, `bench_launch_holds --gamer`). Moved is as measured alone, not as a doubt
        raised it. A figure measured afresh after a real change of phase has moved: held to
        costs as informed as before, two containers changing phase fourfold were split by
        their costs, still in motion, for 12 s, their error 4.0 -> 9.5 points (simulated)."""
        costs, alone = self.costs, self.alone
        apart, least_info = [], math.inf
        for alloc_id, figure in figures.items():
            log_cost, info = costs.get(alloc_id, (0.0, PRIOR_INFO))
            apart.append(math.log(figure) - log_cost)
            least_info = min(least_info, info)
        together = frozenset(figures)
        disagreed = self.disagreed
        info_then, periods_then, figures_then = disagreed.get(together, (0.0, self.periods, {}))
        info_then *= FADING ** (self.periods - periods_then)
        if max(apart) - min(apart) > _LOG_ALONE_AGREE + DOUBT_SIGMAS * math.sqrt(
                2 / least_info):
            if together not in disagreed and len(disagreed) >= DISAGREED_KEPT:
                del disagreed[next(iter(disagreed))]
            disagreed[together] = (max(least_info, info_then), self.periods,
                                   {a: alone[a][0] for a in figures})
            return False
        if least_info < info_then and all(
                abs(math.log(alone[a][0] / figures_then[a])) <= _LOG_ALONE_AGREE
                for a in figures):
            return False
        disagreed.pop(together, None)
        return True

    def _apart(self, alloc_id: str, spending: Iterable[str]) -> tuple[float, float]:
        """A container's learned log cost against the mean of the others' `spending`, and the
        variance chance allows that difference (a learned log cost scatters by about
        1 / sqrt(2 info); the others' by their least informed)."""
        costs = self.costs
        log_cost, info = costs.get(alloc_id, (0.0, PRIOR_INFO))
        others = [costs.get(a, (0.0, PRIOR_INFO)) for a in spending if a != alloc_id]
        if not others:
            return 0.0, math.inf  # nothing to be apart from: no rise can be told
        mean = sum([c for c, _ in others]) / len(others)
        return log_cost - mean, 0.5 / info + 0.5 / min(i for _, i in others)

    def _remember_apart(self, spending: list[str]) -> None:
        """Each trusted figure's container's cost against the others spending, batch by
        batch, over the last ANCHOR_PERIODS periods: what it was before a change is where its
        doubt is judged from (`_before_change`). As `_apart` has it, from one pass over the
        costs: `_apart` for each, a pass over all the others each, took 18 containers 18 x 17
        steps a batch (BENCHMARKS.md, "The crowded time-sliced split")."""
        history, alone, doubted = self.apart, self.alone, self.doubted
        for gone in [a for a in history if a not in alone]:
            del history[gone]
        if len(spending) < 2:
            return
        kept_for = [a for a in spending if a in alone and alone[a][2] >= ALONE_READINGS
                    and a not in doubted]
        if not kept_for:
            return
        costs = self.costs
        spent_costs = {a: costs.get(a, (0.0, PRIOR_INFO)) for a in spending}
        total = sum([log_cost for log_cost, _ in spent_costs.values()])
        # the least informed of the others: the least of all, or the next where it is its own
        by_info = sorted(spent_costs, key=lambda a: spent_costs[a][1])
        least, next_least = by_info[0], spent_costs[by_info[1]][1]
        others = len(spending) - 1
        together = frozenset(spending)
        periods = self.periods
        for alloc_id in kept_for:
            log_cost, info = spent_costs[alloc_id]
            least_info = next_least if alloc_id == least else spent_costs[least][1]
            kept = history.get(alloc_id)
            if kept is None:
                kept = history[alloc_id] = deque(maxlen=4 * ANCHOR_PERIODS)
            kept.append((periods, log_cost - (total - log_cost) / others,
                         0.5 / info + 0.5 / least_info, together))
            while len(kept) > 1 and kept[1][0] <= periods - ANCHOR_PERIODS:
                kept.popleft()

    def _before_change(self, alloc_id: str, spending: Iterable[str]
                       ) -> tuple[float, float, frozenset[str]]:
        """A container's cost against the others' (`_apart`, and the others) before its
        periods showed a change: as it was ANCHOR_PERIODS ago, or as long ago as is known
        beside the same others. The watch needs tens of periods to find a change, and the
        costs follow the change from its first period: taken when the watch fired, the cost
        would have moved most of the way already, and the rise judged from it fall short."""
        others = frozenset(spending) - {alloc_id}
        together = others | {alloc_id}  # as `_remember_apart` keeps them: with the container
        for _, apart, variance, spent_together in self.apart.get(alloc_id, ()):
            if spent_together == together:
                return apart, variance, others
        return (*self._apart(alloc_id, spending), others)

    def _risen(self, alloc_id: str, spending: Iterable[str]) -> float:
        """How far (log) a doubted container's cost has risen against the others' since its
        periods showed a change, where beyond chance; 0 otherwise."""
        before, var_before, _ = self.doubted[alloc_id]
        now, var_now = self._apart(alloc_id, spending)
        rise = now - before
        # (an infinite variance is never beyond: `rise > inf` is false)
        return rise if rise > DOUBT_SIGMAS * math.sqrt(var_before + var_now) else 0.0

    def _figure(self, alloc_id: str, spending: list[str]) -> float:
        """A container's use per token/s as the bound takes it: its figure from alone, raised
        by its cost's rise against the others' while in doubt (`_settle_doubts`)."""
        figure = self.alone[alloc_id][0]
        if alloc_id in self.doubted:
            figure *= math.exp(self._risen(alloc_id, spending))
        return figure

    def _settle_doubts(self, spending: list[str]) -> None:
        """Ends the doubt about a figure whose container's periods showed a change where it
        proves to have been chance: once the costs have re-learned CONFIRM_INFO of
        information, its cost has not risen against the others' beyond chance (the watch's
        false alarms, about one in a few thousand periods; or cheaper work, which a figure
        standing charges more, not less: where the figures then disagree with the costs long
        enough, `stale` has it measured afresh). Where it has risen, its tokens buy more than they
        did alone, and the figure follows the rise (`_figure`) while the costs go on learning
        it, until the container is measured alone again. Costs against the others cannot tell
        which of them changed: the figure is raised either way, the safe side for its limit
        (and the others charged at least at their own figures meanwhile, `_floor_by_figures`).
        Where the others spending are no longer those of the change, the rise can no longer
        be told: the figure keeps the rise it had.

        Dropped instead, as it once was, every false alarm ended the bound for good while the
        containers kept sharing, and they starved (simulated: 29 % of 30 to 4 %)."""
        doubted = self.doubted
        for alloc_id, (_, _, others) in list(doubted.items()):
            if alloc_id not in self.alone:
                del doubted[alloc_id]
                continue
            if alloc_id not in spending or len(spending) < 2:
                continue  # nothing to compare with in this batch
            if frozenset(spending) - {alloc_id} != others:
                figure, rate, steady = self.alone[alloc_id]
                rise = self._risen(alloc_id, [alloc_id, *others])
                self.alone[alloc_id] = (figure * math.exp(rise), rate, steady)
                del doubted[alloc_id]
            elif (min([self.costs[a][1] for a in spending]) >= CONFIRM_INFO
                    and not self._risen(alloc_id, spending)):
                del doubted[alloc_id]

    def _floors(self, charged: Iterable[str], busy: float) -> dict[str, float]:
        """Per container whose weight is at its cap, the least use its part of the periods
        proves beyond chance: the lower end of the Wilson interval, LUCK_SIGMAS wide, of that
        part over the periods it rests on (sound with few periods and at parts of 0 or 1,
        where the binomial deviation is 0)."""
        floors = {}
        z2 = LUCK_SIGMAS * LUCK_SIGMAS
        for alloc_id in charged:
            p, tokens, n = self.parts[alloc_id]
            seen = min(n, 2 * PERIODS_REMEMBERED)
            # only where the weight can follow the periods no further (at its cap); below
            # it, the weight corrects the split as fast as the periods allow
            if seen and p > 0 and p >= COST_RANGE * tokens:
                low = (p + z2 / (2 * seen) - LUCK_SIGMAS * math.sqrt(
                    p * (1 - p) / seen + z2 / (4 * seen * seen))) / (1 + z2 / seen)
                if low > 0:
                    floors[alloc_id] = busy * low
        return floors


def _counted_in_scale(scales: Mapping[str, tuple[float, float]]) -> set[str]:
    """The containers whose figure counts towards the scale the split charges by (the largest
    of those counted), given each one's log figure over its learned cost and that cost's
    information: every one, but where most of them agree with their upper median (within
    ALONE_AGREE, widened by what chance allows the two costs), those agreeing and those
    below; the ones far heavier are left out, and charged at least their own figures
    (`_floor_by_figures`).

    Figures that disagree with the periods' costs say that one of them at least no longer
    stands for what its container does together (a change of phase, or a tenant running other
    kernels while it finds itself alone), not which. The largest is the safe side for limits:
    a container playing light is charged at its neighbours' scale, and of figures a little
    apart by noise the heavier counts. But the largest alone let one playing heavy set every
    neighbour's charge: a strict 30 % container running 80 us kernels while alone (20 us
    otherwise) held its two honest neighbours at 7 % of their 30 (simulated, H200 plant,
    `bench_launch_holds.py --odd`). Left out where its neighbours agree, it sets nobody's
    charge but its own. Left out wherever far heavier than the median (no majority asked),
    an honest figure apart from the other honest one by noise was left out too, and a tenant
    playing light beside them, charged at the lower one's scale, ran at 36-37 % of its strict
    30 for 20 s (32 % with the largest). Agreeing within ALONE_AGREE alone, two honest
    neighbours whose costs had wandered apart after a false alarm of the watch (one learned
    at 1.46 on the information of 11 periods) did not, and the heavy tenant's scale charged
    everyone again for seconds (one neighbour at 20 % over 10 s). Of two, nothing tells which
    is odd and the larger is kept: a tenant can lower its neighbour's share only by lowering
    its own as much (7.4 / 7.4 % of 30 / 30, simulated), and never raise its own; the
    smaller, each charged at least its own figure, let a tenant playing light run at 69 % of
    its strict 30, and take 20 points of a strict 70 % neighbour's share (simulated). A
    majority is believed: two of three containers playing light together ran at 32-35 % of
    their strict 30, and held an honest strict 40 % neighbour at 33 % (simulated), which the
    largest alone prevented."""
    ordered = sorted(scales, key=lambda alloc_id: scales[alloc_id][0])
    median = scales[ordered[len(ordered) // 2]]
    agreeing = [alloc_id for alloc_id, scale in scales.items() if _agree(scale, median)]
    if 2 * len(agreeing) <= len(ordered):
        return set(scales)  # no majority agrees: none is told odd
    highest = max(scales[alloc_id][0] for alloc_id in agreeing)
    return {alloc_id for alloc_id, (own, _) in scales.items() if own <= highest}


def _agree(one: tuple[float, float], other: tuple[float, float]) -> bool:
    """Whether two figures over their costs (log, and the cost's information) agree: within
    ALONE_AGREE, widened by what chance allows the two learned costs (DOUBT_SIGMAS deviations
    of their difference, each scattering by about 1 / sqrt(2 info))."""
    return abs(one[0] - other[0]) <= _LOG_ALONE_AGREE + DOUBT_SIGMAS * math.sqrt(
        0.5 / one[1] + 0.5 / other[1])


def _believed(log_cost: float, info: float) -> float:
    """The cost a split uses: the learned one, drawn towards 1 as far as it could be chance
    (a learned log cost scatters by about 1 / sqrt(2 info) around the true one). Containers
    whose costs are equal are then split by their tokens alone, not by noise.

    The draw is x * x^4 / (x^4 + d^4) for a learned log cost x and d = DOUBT_SIGMAS
    deviations: half of x at d, as x^3 / (x^2 + d^2) was, but sharper on either side (a
    seventeenth of x at half of d, against a fifth; 94 % of x at twice d, against 80 %), so
    that chance is drawn in further and costs proven apart are believed more nearly whole."""
    x2 = log_cost * log_cost
    d2 = DOUBT_SIGMAS * DOUBT_SIGMAS / (2 * info)
    doubt = x2 * x2 + d2 * d2
    return math.exp(log_cost * x2 * x2 / doubt) if doubt > 0 else 1.0


class ChangeWatch:
    """Finds periods that no longer follow the costs learned: per container, two CUSUMs of the
    log-likelihood ratio of each period given or not, against the chance predicted, one for
    odds CHANGE_ODDS times higher, one for as many times lower. Chance alone takes a sum past
    CHANGE_EVIDENCE (nats) less often than once in e**CHANGE_EVIDENCE (about 400) periods
    (Wald's bound; seen once in 15,000 periods of two containers whose costs stayed); a
    container whose odds moved CHANGE_ODDS-fold or more takes it there in about 10-20."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: dict[str, tuple[float, float]] = {}  # alloc_id -> (towards more, fewer)

    def changed(self, expected: Mapping[str, float], drawn: list[str]) -> frozenset[str]:
        """The containers whose periods (one owner each, among `expected`'s) show a change;
        empty while none does."""
        sums = self.sums
        for gone in [a for a in sums if a not in expected]:
            del sums[gone]
        if len(expected) < 2:
            return frozenset()  # alone, it is given every period it can be: nothing to predict
        found = None if _splitc is None else _splitc.watch(
            sums, expected, drawn, CHANGE_ODDS, _LOG_CHANGE_ODDS, _CHANCE_EPS, CHANGE_EVIDENCE)
        return frozenset(self._judge(expected, drawn) if found is None else found)

    def _judge(self, expected: Mapping[str, float], drawn: list[str]) -> list[str]:
        """`changed`'s sums moved by each period of `drawn`, up to the first that shows a change:
        those it shows changed (the sums then cleared), or none. The reference of
        `_splitc.watch`."""
        sums = self.sums
        # Per container, the log-likelihood ratios of a period given and of one not given, for
        # odds CHANGE_ODDS times higher (up) and as many times lower (down) than its chance q:
        # log(more / q) = log C - log(1 + (C - 1) q), log((1 - more) / (1 - q)) =
        # -log(1 + (C - 1) q), and likewise log(fewer / q) = -log(C - (C - 1) q),
        # log((1 - fewer) / (1 - q)) = log C - log(C - (C - 1) q).
        odds, log_odds = CHANGE_ODDS, _LOG_CHANGE_ODDS
        terms = []
        for alloc_id, chance in expected.items():
            q = min(1 - _CHANCE_EPS, max(_CHANCE_EPS, chance))
            up_missed = -math.log(1 + (odds - 1) * q)
            down_given = -math.log(odds - (odds - 1) * q)
            terms.append((alloc_id, log_odds + up_missed, up_missed, down_given,
                          log_odds + down_given))
        for owner in drawn:
            found = []
            for alloc_id, up_given, up_missed, down_given, down_missed in terms:
                up, down = sums.get(alloc_id, (0.0, 0.0))
                if alloc_id == owner:
                    up += up_given
                    down += down_given
                else:
                    up += up_missed
                    down += down_missed
                up, down = (up if up > 0 else 0.0), (down if down > 0 else 0.0)
                if up > CHANGE_EVIDENCE or down > CHANGE_EVIDENCE:
                    found.append(alloc_id)
                sums[alloc_id] = (up, down)
            if found:
                sums.clear()  # evidence from here on is judged against what follows
                return found
        return []


def _chances_of(costs: Mapping[str, tuple[float, float]], tokens: Mapping[str, float]
                ) -> dict[str, float]:
    """Each spending container's chance of being given a period: its part of the tokens times
    its cost, over the sum of those."""
    weighed = {a: part * math.exp(costs[a][0]) for a, part in tokens.items()}
    whole = sum(weighed.values())
    return {a: w / whole for a, w in weighed.items()}


def _newton_steps(costs: dict[str, tuple[float, float]], tokens: Mapping[str, float],
                  drawn: list[str], fading: float, top: float) -> None:
    """Each period of `drawn` (the container given it) moves the log cost of every container
    spending by its surprise over its information, which fades by `fading` a period; each log
    cost kept within +/- `top`; then centred, as only the ratios matter (so that the range
    bounds ratios, not a drift). See `TimeSlicedSplit`'s note. The reference of
    `_splitc.learn`, float for float."""
    for owner in drawn:
        for alloc_id, chance in _chances_of(costs, tokens).items():
            log_cost, info = costs[alloc_id]
            info = fading * info + chance * (1 - chance)
            log_cost += ((alloc_id == owner) - chance) / info
            costs[alloc_id] = (top if log_cost > top else -top if log_cost < -top
                               else log_cost, info)
    mean = sum([costs[a][0] for a in tokens]) / len(tokens)
    for alloc_id in tokens:
        log_cost, info = costs[alloc_id]
        costs[alloc_id] = (log_cost - mean, info)


def _age_parts(parts: dict[str, tuple[float, float, int]], unseen: dict[str, int],
               owners: list[list[str]], spent: Mapping[str, int], total: int) -> None:
    """Each period of `owners` moves every container's part of the periods (given it or not)
    and of the tokens (its part of `total` this batch) by one step of a mean over the periods
    seen, at most PERIODS_REMEMBERED of them, and counts the periods since it was last given
    one. The reference of `_splitc.age`, float for float."""
    for given in owners:
        for alloc_id, (periods, tokens, n) in parts.items():
            n += 1
            alpha = max(1 / n, 1 / PERIODS_REMEMBERED)
            periods += alpha * ((alloc_id in given) - periods)
            if total > 0:
                tokens += alpha * (spent.get(alloc_id, 0) / total - tokens)
            parts[alloc_id] = (periods, tokens, n)
            unseen[alloc_id] = 0 if alloc_id in given else unseen.get(alloc_id, 0) + 1


def _standing(chances: dict[str, float], drawn: list[str],
              relearning: set[str]) -> tuple[dict[str, float], list[str]]:
    """What the watch judges while costs re-learn: the periods given among the containers whose
    costs stand, each one's chance taken given that one of them was given it. That is right
    however wrong the re-learning costs still are, so a container that keeps changing phase (or
    says it does) does not blind the watch to its neighbours' changes; a pair with one
    re-learning has nothing left to judge."""
    if not relearning or not any(a in chances for a in relearning):
        return chances, drawn
    standing = {a: q for a, q in chances.items() if a not in relearning}
    whole = sum(standing.values())
    if not whole > 0:
        return {}, []
    return ({a: q / whole for a, q in standing.items()},
            [owner for owner in drawn if owner in standing])


def _lift_from(shares: dict[str, float], floors: Mapping[str, float], uncharged: float) -> float:
    """Lifts each share below its floor towards it out of the use charged to nobody (up to
    `uncharged`); what was lifted. A container writing a small fraction of its spending into
    `state` explains little of the use: bounded by the work the tokens explain, its real use
    was charged to nobody, and its floor, taken out of its neighbours' shares, ran an honest
    strict 40 % neighbour measured in a turn at 42.1 % rather than 40.6 % (simulated)."""
    lifted = 0.0
    for alloc_id, floor in floors.items():
        gap = min(floor - shares.get(alloc_id, floor), uncharged - lifted)
        if gap > 0:
            shares[alloc_id] += gap
            lifted += gap
    return lifted


def _floor_by_periods(shares: dict[str, float], floors: Mapping[str, float]) -> None:
    """Lifts each share below its floor towards it, taking the difference from the shares
    above theirs, in proportion to how far above; the sum stays. The weights cap what periods
    can correct (COST_RANGE) and follow them slowly; without a floor, a container writing a
    small fraction of its spending into `state` would be charged little of the GPU's use and
    its neighbours the rest, and be throttled less while they are throttled more."""
    short = {a: floors[a] - s for a, s in shares.items() if floors.get(a, 0.0) > s}
    if not short:
        return
    spare = {a: s - floors.get(a, 0.0) for a, s in shares.items()
             if a not in short and s > floors.get(a, 0.0)}
    need, room = sum(short.values()), sum(spare.values())
    moved = min(need, room)
    if moved <= 0:
        return
    for alloc_id, gap in short.items():
        shares[alloc_id] += gap * moved / need
    for alloc_id, above in spare.items():
        shares[alloc_id] -= above * moved / room


PERIODS_REMEMBERED = 100  # the parts of the periods and tokens (floors, strangers, no shim)
# A cost's information fades over about this many periods (50 s at six a second): long, for
# costs steady to within a few percent; a change of phase is found by `ChangeWatch` instead.
COST_PERIODS = 300
FADING = 1 - 1 / COST_PERIODS  # what a cost's information keeps of itself per period
# The belief, before any period, that costs are equal: the information of a log cost whose
# standard deviation is 0.5 (a cost within x0.37 to x2.7 of the others' at two deviations).
PRIOR_INFO = 4.0
# SM time per token of a container against the geometric mean of the GPU's containers':
# within about 1/8..8 (clamped, then centred), so two containers' within about 1/64..64
COST_RANGE = 8.0
LUCK_SIGMAS = 2.0  # a floor is the part of the periods chance cannot explain at this many
# deviations of a learned log cost that draw it halfway towards 1 (equal costs)
DOUBT_SIGMAS = 2.0
# A container's odds of being given a period this many times what its cost predicts (or as
# many times less) is a change of workload, found once the evidence for it reaches
# CHANGE_EVIDENCE nats; the information of the costs whose periods changed is then cut to
# RESTART_INFO (that of about 20 periods at even odds), so that they follow the new periods
# within a few dozen periods (seconds at six a second, half a minute at one).
CHANGE_ODDS = 3.0
CHANGE_EVIDENCE = 6.0
RESTART_INFO = 5.0
# A container's use per token from the batches it was alone in: trusted after this many in a
# row at a steady spending (within ALONE_STEADY of the last), averaged over up to
# ALONE_AVERAGED, kept until its container leaves or its periods show a change.
# While a container spending has one, the use shared out is at most ALONE_MARGIN times what
# their tokens explain: a container's kernels may take longer beside another's (caches emptied
# by the switches) than alone. On an H200 the figures explained pairs' work within 2 % (75.8,
# 75.4 and 76.6 where they did 74.9, 75.9 and 75.1), and at 1.05 strict 30 / 50 % pairs ran
# at 27-28 / 47-48 %.
ALONE_READINGS = 3
# ... and with no period given to anyone else (strangers, containers spending no token) in the
# last this many
ALONE_QUIET = 5
# ... in a turn alone: periods read since the turn's pause was written (see `_calibrate`)
TURN_QUIET = 2
ALONE_STEADY = 0.15
# ... or one launch, where it is at most this part of a batch's spending (`_calibrate`)
LAUNCH_STEADY = 0.25
ALONE_AVERAGED = 10
ALONE_MARGIN = 1.02
# ... and the GPU is said to count busy beyond the work (its turns come sooner, see
# `throttle/soloturn.py`) where its use passes this many times that work: a figure a few percent
# light passes the bound's margin too (three saturating containers on a GPU whose use is all
# work, explained 95.5 of 100 by one figure and the costs), and flagged on it their GPU had
# turns 3-4 s apart for good (a mean error of 1.9 points where it was 0.2)
BEYOND_SEEN = 1.05
# ... widened by this many times how far the figures may be off (`spread`): figures from a
# turn's few noisy batches came out up to a fifth off (simulated), and the bound then charged
# containers less than they did: strict 30 % ones ran at up to 32 %, and where the GPU's use was
# all work, three saturating ones were held with a mean error of 3.6 points instead of 1.1
SPREAD_SIGMAS = 2.0
FILE_SPREAD = 0.05  # figures kept across restarts scatter no more than this (`figures`)
# A figure read below this (percent of the GPU: NVML reads whole percents) is coarse, and
# measured afresh once its container spends this many times what it spent then (`coarse`). A
# reading r taken at r + TRUNCATED may be off by 0.5 / (r + 0.5): 9 % at 5, under 5 % from 10;
# with the bound at 1.02 a strict 30 % container whose turn read 5 ran at 31.5 % (simulated)
COARSE_READING = 10.0
COARSE_GROWTH = 3.0
# ... and while their ratios agree with the costs the periods show within this factor (beyond
# what chance allows the costs)
ALONE_AGREE = 1.25
DISAGREED_KEPT = 64  # sets of containers whose disagreement is remembered, the oldest dropped
# NVML's whole percents are truncated (measured on an H200: a process alone at 3.8, 6.7 and
# 8.6 % of its work read 3, 6 and 8), so a figure is made of its batch's reading and half a
# percent: as read, the strict 30 % container of such a turn ran at 41 % for 12 s until it was
# measured afresh (a reading of 2; charged 29.7 % while it did 41 %)
TRUNCATED = 0.5
# A container's cost against the others' is remembered this many periods back (the watch finds
# a three-fold change in 10-20), so that a rise is judged from before the change began
ANCHOR_PERIODS = 60
# A figure whose container's periods showed a change is in doubt until the costs have this much
# information again (about 60-80 periods from RESTART_INFO at even odds); nor is the watch
# asked before costs it cut are this informed again (see the class note)
CONFIRM_INFO = 20.0
# Costs this far apart (`costs_apart`) make a GPU whose use is all work give first turns as
# soon as one counting beyond the work does (`soloturn`): until every container has a figure,
# one figure sets the scale and the costs the periods show the rest, learned from periods
# over tens of seconds where they differ far. A strict 50 % container of 200 us kernels,
# measured first beside a 20 us one, ran at 51-56 % for 30 s and 62-85 % before (simulated,
# sigma 3, 6 Hz, no holds); its neighbour measured 3 s after it, at 48-52 % from 10 s. Not
# at any difference beyond chance: three containers of equal kernels read apart by chance
# and paid a pause each (their mean error in 30 s runs 1.15 -> 2.15 points).
APART_FACTOR = 2.0
# Periods the figures disagree with the costs (net of those they agree in) before the heaviest
# figure over its cost is measured afresh (`stale`): 5 s at NVML's 200 ms (the H200's). At
# 50 a stale figure was asked 5 s later (a changed container's neighbour's lowest 10 s 25.4
# -> 24.5, `bench_launch_holds.py --phase`), and a tenant playing light ran at up to 37 % of
# its strict 30 over 10 s (`--odd`); at 15, noise set it off sooner and that tenant ran at up
# to 36 % (simulated, eight seeds each).
# Counted only while the costs are informed past a change's cut (CONFIRM_INFO), so that a
# change still being learned is not taken for a figure gone stale.
STALE_PERIODS = 25
_CHANCE_EPS = 1e-3
_LOG_CHANGE_ODDS = math.log(CHANGE_ODDS)
_LOG_COST_RANGE = math.log(COST_RANGE)
_LOG_ALONE_AGREE = math.log(ALONE_AGREE)
_LOG_APART = math.log(APART_FACTOR)


def _steady_step(rate: float, launch_rate: float) -> float:
    """How far a container's spending alone (tokens/s, the larger of two batches') may step
    between batches and still be steady: ALONE_STEADY of it, or one launch (`launch_rate`:
    one launch's tokens over the batch) where that is at most LAUNCH_STEADY of it."""
    step = ALONE_STEADY * rate
    return launch_rate if step < launch_rate <= LAUNCH_STEADY * rate else step


def _spread(batches: tuple[int, float, float]) -> float:
    """`TimeSlicedSplit.spread` of a figure resting on `batches` (count, mean, squares)."""
    n, mean, squares = batches
    if n < 2 or mean <= 0:
        return 0.0
    return math.sqrt(squares / (n - 1) / min(n, ALONE_AVERAGED)) / mean

"""A turn alone for a container sharing a time-sliced GPU that was never seen alone there.

A time-sliced GPU counts itself busy beyond the work while processes take turns (measured on
an H200: two processes doing 20 % of the work each read 99 % busy), and the split can tell that
from work only through a container's use per token measured while it ran alone
(`timesliced.TimeSlicedSplit`). Containers that started together, or joined a GPU whose
figures were lost, were never alone: their use was shared out whole and strict ones starved
(two strict 30 % containers of 20 us kernels at 4 % each, simulated, for as long as they ran).

So, where two containers or more have spent on such a GPU for `after_s` and one of them has
no figure of its own, the controller gives it a turn alone: the others' rates are set to the
pause (rate 0, a burst of 1: the shim admits nothing more and credits nothing), its own rate is
left as it was, and the law is not run for that GPU, whose readings say nothing of the shares
meanwhile. The turn ends once the split's figure for it rests on TURN_READINGS steady batches
(EARLY_READINGS where they agree within EARLY_SPREAD; or at `most_s`, trusted after
ALONE_READINGS), when it stops spending, or when NVML gives a
period to another process (not when another's `state` claims spending: a paused container's
claims are not believed), and the others' rates are written back.

Every container gets a figure of its own, not only the first. One figure sets the scale for the
others' use (at the costs their periods show against it), but a ratio of costs learned from
periods is noisy where costs differ, and a figure taken in one phase of an application says
nothing of the next. Simulated, a strict 30 % container of 20 us kernels beside a measured one
of 10 us ran at 35 % (median of 6 runs over 70-150 s; up to 50 %, and 59 % over its worst 10
s); beside one measured with 5 us kernels that moved to 20 us a second after its turn, both ran
at 49 % to the end of the runs (150 s). With a turn each: 28.5 % (at most 35 % over any 10 s),
and 28.4 / 28.6 % (`bench_launch_holds.py --mixed`). A newcomer joining measured containers is
covered by the scale meanwhile, until its turn (turns are 10 s or a minute apart, below). A
figure in doubt (its container's periods showed a change since), read at a few percent
for a container that now spends threefold (`TimeSlicedSplit.coarse`), long at odds with the
costs the periods show (`TimeSlicedSplit.stale`), or older than the operator allows
(`TimeSlicedSplit.aged`, `throttle_figure_max_age_seconds`) counts as none: the caller passes
`measured` without it, and a turn measures it afresh.

`most_s` stays below the shim's longest wait (`VGPU_MAX_WAIT_NS`, 2 s): a launch that has
waited that long runs whatever its bucket says, and one stray launch of a paused process in a
period makes the GPU count its holds again. With NVML's 200 ms periods (the H200's) a figure
is trusted after about 1.2 s alone (TURN_QUIET periods for the others' last work to leave the
samples, then ALONE_READINGS steady batches), and a turn goes on to TURN_READINGS batches or
`most_s`, whichever comes first, for a figure averaged over more samples; with periods longer
than `most_s` allows for a trusted figure, no turn is given.

What a turn costs the others: at most `most_s` without a launch, once per `gap_s` per GPU, and per
container `tries` turns (one whose spending was not steady enough for a figure is tried again
once), which come back one each `retry_s` (a minute), never more than `tries` in hand, while it
stays on the GPU; and once per container a turn for a figure read too coarsely, which spends no try
(the first measurement's end, see `due`). A turn that measured a figure the watch put in doubt
again within FALSE_ALARM_AGREE (10 %) gives its try back, once per container in `refund_s` (ten
minutes: `refund`), as a false alarm spent it. The tries bound how often pauses come; the gap only
spaces them, and a long one leaves a wrong figure believed for as long. Without tries coming back
an application that changed phase twice was charged at a figure of the first phase from the second
change on, for as long as it ran: a strict 40 % container whose tokens came to buy a quarter of the
time ran at 9 % of its 40 (simulated, the first re-measure having spent its second try, or a false
alarm of the watch having spent it before the change); with them, at 30 % or more 20-30 s after the
second change in 19 runs of 24, and still at 9-10 % in 2, where a false alarm of the watch in the
minute before the change had spent the tries (a try comes back a minute after it was spent); with
a false alarm's try given back (and turns at lumpy spending giving figures, `timesliced`), in 23
and none. A tenant that keeps its figure in doubt on purpose costs each neighbour a pause of under
2 s a minute at most, over time, and one more each ten minutes where its turns find its figure as
it was. On a GPU seen counting itself busy beyond the work the figures explain (as the H200 does
while processes take turns, or where a figure came out light) the shares rest on figures: the first
one sets the scale for the others until their own turns, and one taken light (a tenant
running lighter kernels while it finds itself alone, or a change of phase) let both of a strict
30/30 pair run at 48-50 % of their 30 for the minute a gap of 60 s left (`bench_launch_holds.py
--gamer`, simulated); a figure put in doubt by a change of phase waited out the minute after the
last turn for its re-measure (43-67 % of 30 meanwhile). There turns are `gap_s` (10 s) apart: a
pause at most every 12 s (first turns and re-measures sooner, below). On a GPU whose use the
figures explain, the periods share it out well enough without them, and each pause costs more than
it buys: ten containers at 10 % lost 1.0 points of mean error over two minutes to pauses 10 s apart
(`bench_throttle.py --attribution time-sliced`), so turns stay `calm_gap_s` (a minute) apart. Not
re-measures (below), nor first turns where the periods show costs twofold apart or more
(`costs_apart`): until each container has a figure, the first one's sets the scale and the costs
the rest, learned over tens of seconds where they differ far, and a strict 50 % container of 200 us
kernels, measured first beside one of 20 us, ran at 51-56 % for the last 30 s of a 40 s run
(simulated). On a GPU counted busy beyond the work, a container's first turn waits only
`first_gap_s` (3 s) after the last turn: until then it is charged at another's figure times the
cost its periods show, and on the H200, under the controller, the periods understated long kernels
(a container of 20 us kernels at 25-31 % of the GPU's time was given 40-46 % of the periods beside
one of 200 us). There a strict-50 container of 200 us kernels beside a measured strict-30 one of 20
us ran at 64 % of its work for the 10 s gap, its charge rising from 7 to 32 % as the periods came;
simulated, at 54-88 % for 8-12 s (three seeds, `bench_launch_holds.py --unequal`). With the first
gap, about 4 s of that, and ten containers starting together are all measured within 43-80 s
instead of 106-135 s (`--crowd`). A pair's second first turn there comes `remeasure_gap_s` after the
first, without `after_s`: the one container it pauses has just run alone, so nobody is paused twice
in a row, and the pair spent `after_s` together before the first. Waiting, the second was charged at
the first's figure times a cost its periods had not yet learned: a strict 50 % container of 200 us
kernels beside a 30 % one of 20 us ran at 50-74 % over its highest 5 s (median 65, 11 seeds,
`--unequal`), now 49-65 (55); the time-sliced bench's scenario 6 at sigma 8 and 6 Hz, 6.62 -> 5.84
points (12 seeds). Not where the use is all work: there the periods share the use out between the
turns, and a sooner second turn only moved which noisy figures the pair got (the strict 50 % beside
the 30 %, its highest 5 s from 15 s on 48.5-54.8 over 16 seeds, against 48.7-52.9). A container
whose figure is in doubt (or too coarse) is measured afresh sooner still, on any GPU:
`remeasure_gap_s` (0.5 s) after the last turn, and without `after_s` (it has spent all along). Its
charge stands for work it no longer does: a pair whose phases changed together (tokens then buying
four times and a quarter of what they did) ran at 44-62 % and 20-30 % of their 40 and 60 for 5-10
s after the change while each re-measure waited 3 s, after the doubt and then after the other's
turn; now 35-57 % for the second (simulated, six seeds).
Waiting the whole 10 s gap after a neighbour's turn, a doubted figure, raised by its cost's rise
only where that rise is beyond chance, went 2.3-fold up and back with a cost at chance's edge, and
its strict 30 % neighbour ran at 34-38 % for 6 s (simulated, `--unequal`, seed 1 of eleven). A
container never measured still goes first (it has been tried least), as a first turn.

The container given the turn is the one of highest priority among those tried least, so a
latency-sensitive service marked so by its priority (`vgpu.io/priority`) runs through the turn
while the others wait.

Pure: no I/O, no clocks (the caller passes the time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from vgpu_agent.shm.layout import MAX_WAIT_NS
from vgpu_agent.throttle.timesliced import ALONE_READINGS, TURN_QUIET

PAUSED_RATE = 0  # with a burst of 1 the shim admits nothing more (0 and 0: never configured)
PAUSED_BURST = 1
LONGEST_WAIT_S = MAX_WAIT_NS / 1e9  # the shim's (2 s): a launch waits no longer
SOLO_TURN_MOST_S = 0.95 * LONGEST_WAIT_S  # 1.9 s
SOLO_TURN_AFTER_S = 3.0  # containers spending together, one without a figure, this long first
# between the end of one turn and the start of the next on a GPU seen counting busy beyond the
# work (where figures are what shares rest on), and on one not seen to (see the module note)
SOLO_TURN_GAP_S = 10.0
SOLO_TURN_CALM_GAP_S = 60.0
SOLO_TURN_FIRST_GAP_S = 3.0  # ... before a container's first turn there (see the module note)
# ... before a figure in doubt is measured afresh, on any GPU, and without waiting `after_s`
SOLO_TURN_REMEASURE_GAP_S = 0.5
SOLO_TURN_TRIES = 2  # turns per container in hand at most
# ... which come back one each this long (see the module note)
SOLO_TURN_RETRY_S = 60.0
# A turn for a figure in doubt that measured it again within this factor found a false alarm of
# the watch: its try comes back, once per container in this long (see `refund`)
FALSE_ALARM_AGREE = 1.1
SOLO_TURN_REFUND_S = 600.0
# periods a turn needs at least: the others' last work out of the samples, then steady batches
PERIODS_NEEDED = TURN_QUIET + ALONE_READINGS + 1


def turn_fits(period_s: float, most_s: float = SOLO_TURN_MOST_S) -> bool:
    """Whether a turn of at most `most_s` can give a figure on a GPU whose NVML sample period
    is `period_s` (PERIODS_NEEDED of them; 0: not known yet, and nothing is given until it
    is). Where it cannot, no turn is given and the shares rest on the periods alone: the
    controller tells the operator (`throttle_solo_turns_impossible`)."""
    return 0 < period_s * PERIODS_NEEDED <= most_s


def turn_wanted(spending: Collection[str], measured: Collection[str]) -> bool:
    """Whether a turn alone is wanted on a GPU: two containers or more spending, one of them
    without a trusted figure (`measured`) it can be charged by."""
    return len(spending) >= 2 and not all(a in measured for a in spending)


# steady batches a turn waits for, time allowing (a figure is trusted after ALONE_READINGS, and
# averaged over those that follow: three noisy samples made a figure 18 % low, simulated)
TURN_READINGS = 6
# ... unless, one batch past trust, the batches agree this closely already (the standard error
# of their mean, relative to it): the pause lasts what the figure needs. Simulated, pairs of
# 20 and 200 us kernels: with exact samples (as the H200 read a process alone), 4 batches
# scatter by at most 1.4 % and give the figure of 6 within 1.4 %; with the noisy plant's
# sigma-3 samples, by 3.7 % and more (with 2 ms kernels some noisy turns end early too). Three
# batches are not enough to judge: three noisy ones read alike once, 16 % off.
EARLY_READINGS = ALONE_READINGS + 1
EARLY_SPREAD = 0.02


@dataclass
class SoloTurn:
    """One turn under way: whose, since when, and the rates (rate, burst) of the paused devices
    to write back, by device key."""

    alloc_id: str
    started_ns: int
    paused: dict[str, tuple[int, int]] = field(default_factory=dict)
    ticks: int = 0  # ticks since it started


class SoloTurns:
    """One GPU's turns alone: when one is due, and when the one under way is over."""

    __slots__ = ("after_ns", "calm_gap_ns", "credit", "first_gap_ns", "freed", "gap_ns",
                 "last_end_ns", "last_owner", "last_paused", "most_ns", "most_s", "refund_ns",
                 "refunded", "remeasure_gap_ns", "retry_ns", "spent_try", "tried", "tries", "turn",
                 "waiting_ns")

    def __init__(self, most_s: float = SOLO_TURN_MOST_S, after_s: float = SOLO_TURN_AFTER_S,
                 gap_s: float = SOLO_TURN_GAP_S, tries: int = SOLO_TURN_TRIES,
                 calm_gap_s: float = SOLO_TURN_CALM_GAP_S,
                 first_gap_s: float = SOLO_TURN_FIRST_GAP_S,
                 remeasure_gap_s: float = SOLO_TURN_REMEASURE_GAP_S,
                 retry_s: float = SOLO_TURN_RETRY_S,
                 refund_s: float = SOLO_TURN_REFUND_S) -> None:
        if not 0 < most_s < LONGEST_WAIT_S:
            raise ValueError(f"a solo turn must last more than 0 s and less than the shim's "
                             f"longest wait ({LONGEST_WAIT_S:g} s), got {most_s!r}")
        if not (after_s >= 0 and gap_s >= 0 and calm_gap_s >= 0 and first_gap_s >= 0
                and remeasure_gap_s >= 0 and tries >= 1):
            raise ValueError(f"need after_s >= 0, gap_s >= 0, calm_gap_s >= 0, first_gap_s >= 0, "
                             f"remeasure_gap_s >= 0 and tries >= 1, got {after_s!r}, {gap_s!r}, "
                             f"{calm_gap_s!r}, {first_gap_s!r}, {remeasure_gap_s!r}, {tries!r}")
        if not retry_s > 0:
            raise ValueError(f"need retry_s > 0 (inf: no turn once the tries are spent), got "
                             f"{retry_s!r}")
        if not refund_s > 0:
            raise ValueError(f"need refund_s > 0 (inf: no try comes back for a false alarm), "
                             f"got {refund_s!r}")
        self.most_s = most_s
        self.most_ns, self.after_ns = int(most_s * 1e9), int(after_s * 1e9)
        self.gap_ns, self.tries = int(gap_s * 1e9), tries
        self.calm_gap_ns = int(calm_gap_s * 1e9)
        self.first_gap_ns = int(first_gap_s * 1e9)
        self.remeasure_gap_ns = int(remeasure_gap_s * 1e9)
        self.turn: SoloTurn | None = None
        self.waiting_ns: int | None = None  # since when a turn has been wanted
        self.last_end_ns: int | None = None
        # whose the last turn was, and those it paused (the others on the GPU when it came)
        self.last_owner: str | None = None
        self.last_paused: frozenset[str] = frozenset()
        self.tried: dict[str, int] = {}  # alloc_id -> turns it had
        # alloc_id -> (turns left to it, when): `tries` at first, one back each `retry_s`
        self.credit: dict[str, tuple[float, int]] = {}
        self.retry_ns = int(retry_s * 1e9) if math.isfinite(retry_s) else None
        self.freed: set[str] = set()  # those given their one turn that spent no try (`due`)
        self.spent_try: dict[str, bool] = {}  # whether its last turn spent a try (`refund`)
        self.refunded: dict[str, int] = {}  # when its last try came back for a false alarm
        self.refund_ns = int(refund_s * 1e9) if math.isfinite(refund_s) else None

    def due(self, now_ns: int, spending: Sequence[str], measured: Collection[str],
            candidates: Collection[str], period_s: float, present: Collection[str],
            priorities: Mapping[str, int] | None = None, spared: Collection[str] = (),
            beyond_work: bool = True, doubted: Collection[str] = (),
            apart: Callable[[], bool] = lambda: False, free: Collection[str] = ()
            ) -> str | None:
        """The container to give a turn alone now, None for none. `spending`: the containers
        that spent this tick, in a stable order; `measured`: those with a trusted figure (a
        turn is for one without);
        `candidates`: those whose rate limits them (a turn keeps its rate as it is, and needs
        it to hold its spending steady); `period_s`: NVML's sample period on this GPU;
        `present`: every container with a device on the GPU now (the tries of one gone are
        forgotten: a container of the same name later is another); `priorities`: by
        container, those in force (0 where absent); `spared`: those never to be paused (the
        operator's choice): one of them can only be given the turn itself, and with two or
        more on the GPU none is given; `beyond_work`: whether the GPU has been seen counting
        itself busy beyond the work the figures explain (turns `gap_s` apart, `first_gap_s`
        where one eligible was never tried or has its figure in `doubted`, `remeasure_gap_s`
        without `after_s` for a pair's second first turn; `calm_gap_s` where not);
        `doubted`: those whose figure is in doubt or too coarse (left out of `measured`; the
        turn given to one of them comes `remeasure_gap_s` after the last, on
        any GPU, without `after_s`); `apart`: whether the costs of containers spending differ far
        (`TimeSlicedSplit.costs_apart`; called only where it decides the gap, as it may compare
        every pair spending): first turns `first_gap_s` apart on any GPU then; `free`: those of
        `doubted` whose turn spends no try, once per container while it stays (a figure read
        too coarsely, `TimeSlicedSplit.coarse`: the first turn comes while the rates are cut,
        and reads low; measuring it again is the first measurement's end, and spending a try on
        it left a container that changed phase 40 s in without one for its re-measure until a
        minute after its start, held at 7 % of its strict 30 meanwhile, simulated).

        Of the eligible, the one tried least is taken, then the highest priority (a turn
        pauses every other container: the one whose waits matter most is spared them), then
        the first in `spending`'s order."""
        for gone in [a for a in self.tried if a not in present]:
            del self.tried[gone]
            self.credit.pop(gone, None)
            self.freed.discard(gone)
            self.spent_try.pop(gone, None)
            self.refunded.pop(gone, None)
        if (self.turn is not None or not turn_wanted(spending, measured)
                or not turn_fits(period_s, self.most_s)):
            self.waiting_ns = None
            return None
        if self.waiting_ns is None:
            self.waiting_ns = now_ns
        unspent = {a for a in free if a in doubted and a not in self.freed} if free else ()
        spare = [a for a in present if a in spared] if spared else ()
        if len(spare) > 1:
            return None  # none may pause the other spared ones
        # One pass over those spending (asked at every tick of a time-sliced GPU): the eligible
        # one tried least, then of the highest priority, then the first; and whether any
        # eligible one was never tried (or is doubted).
        tried, credit, ranks = self.tried, self.credit, priorities or {}
        chosen, best = None, (0, 0)
        untried = untried_or_doubted = False
        for a in spending:
            if a not in candidates or a in measured or (spare and a not in spare):
                continue
            # at least one turn left (one never charged a try has them all)
            if a not in unspent and a in credit and self._credit(a, now_ns) < 1 - 1e-9:
                continue
            turns = tried.get(a)
            if turns is None:
                untried = untried_or_doubted = True
                turns = 0
            elif a in doubted:
                untried_or_doubted = True
            key = (turns, -ranks.get(a, 0))
            if chosen is None or key < best:
                chosen, best = a, key
        if chosen is None:
            return None
        after_ns, gap_ns = self.after_ns, self.gap_ns if beyond_work else self.calm_gap_ns
        if chosen in doubted:
            # its figure stood for other work: its turn comes as soon as the last ends
            after_ns, gap_ns = 0, min(gap_ns, self.remeasure_gap_ns)
        elif (beyond_work and untried_or_doubted) or (untried and apart()):
            gap_ns = min(gap_ns, self.first_gap_ns)
            if (beyond_work and chosen not in self.tried and chosen in self.last_paused
                    and set(present) - {chosen} <= {self.last_owner}):
                # a pair's second: the only one it pauses has just run alone, and it spent
                # beside that one for `after_s` before the first (paused by it; module note)
                after_ns, gap_ns = 0, min(gap_ns, self.remeasure_gap_ns)
        if now_ns - self.waiting_ns < after_ns or (
                self.last_end_ns is not None and now_ns - self.last_end_ns < gap_ns):
            return None
        self.tried[chosen] = self.tried.get(chosen, 0) + 1
        if chosen in unspent:
            self.freed.add(chosen)
        else:
            self.credit[chosen] = (self._credit(chosen, now_ns) - 1, now_ns)
        self.spent_try[chosen] = chosen not in unspent
        self.waiting_ns = None
        self.last_owner, self.last_paused = chosen, frozenset(present) - {chosen}
        return chosen

    def _credit(self, alloc_id: str, now_ns: int) -> float:
        """The turns left to it now: `tries` at first, one back each `retry_s` since its last
        turn, never more than `tries`."""
        left, since_ns = self.credit.get(alloc_id, (float(self.tries), now_ns))
        if self.retry_ns is not None:
            left = min(float(self.tries), left + (now_ns - since_ns) / self.retry_ns)
        return left

    def refund(self, alloc_id: str, now_ns: int) -> bool:
        """Gives back the try a container's last turn spent, where that turn measured its
        figure in doubt again as it was (the caller judges, within FALSE_ALARM_AGREE): the
        watch's false alarm spent it, not a change. At most once per `refund_s` per
        container, so that a tenant that makes its periods look changed and then runs as
        before while alone costs its neighbours one pause more in that time, not one each
        time. Whether it did."""
        if not self.spent_try.pop(alloc_id, False) or self.refund_ns is None:
            return False
        last = self.refunded.get(alloc_id)
        if last is not None and now_ns - last < self.refund_ns:
            return False
        self.credit[alloc_id] = (min(float(self.tries), self._credit(alloc_id, now_ns) + 1),
                                 now_ns)
        self.refunded[alloc_id] = now_ns
        return True

    def start(self, alloc_id: str, now_ns: int, paused: Mapping[str, tuple[int, int]]) -> None:
        self.turn = SoloTurn(alloc_id, now_ns, dict(paused))

    def over(self, now_ns: int, spent: Mapping[str, int], steady: int, spread: float,
             others_ran: int) -> str | None:
        """Why the turn under way is over (None: it goes on), given what each container spent
        this tick, the steady batches alone its container's figure rests on and how far they
        scatter (`TimeSlicedSplit.spread`), and the sample periods of the turn (past its first
        TURN_QUIET, which may predate the pause) NVML gave to other processes.

        Others are judged by their periods, not by what their `state` claims: a paused
        container's claims are not evidence (a bucket with no refill lets nothing through),
        and a container writing spending into `state` while paused must not end its
        neighbour's turn. Periods are: a process that ran (a shim that ignores the pause, a
        process without one) spoils the figure, and waiting on is pointless."""
        turn = self.turn
        if turn is None:
            return None
        if steady >= TURN_READINGS or (steady >= EARLY_READINGS and spread <= EARLY_SPREAD):
            return "measured"
        turn.ticks += 1
        if not spent.get(turn.alloc_id, 0):
            return "stopped"
        if others_ran:
            return "others_ran"
        if now_ns - turn.started_ns >= self.most_ns:
            return "measured" if steady >= ALONE_READINGS else "too_long"
        return None

    def end(self, now_ns: int) -> SoloTurn | None:
        """Ends the turn under way; what it paused (to write back)."""
        turn, self.turn = self.turn, None
        if turn is not None:
            self.last_end_ns = now_ns
        return turn

"""Turns alone on the controller's time-sliced GPUs: offered, followed and ended.

`soloturn.SoloTurns` decides, per GPU, when a container is due a turn alone and when its turn is
over; `TurnKeeper` carries that out for the controller: it pauses every other device of the GPU
(their rates kept), follows the turn's ticks, and at its end writes the rates back, hands the
figure it gave to the split and has the law re-learn where the figure says its `k` is off. It
also tells the operator, once per GPU, where NVML samples too seldom for a turn to fit.

It writes rates only through the `apply` it is given, and reads nothing itself: the controller
owns the devices, the splits and the law's states, and passes them in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import structlog

from vgpu_agent.throttle.control import FULL_SHARE, ControlParams, Decision, LoopState, relearn
from vgpu_agent.throttle.soloturn import (
    FALSE_ALARM_AGREE,
    PAUSED_BURST,
    PAUSED_RATE,
    PERIODS_NEEDED,
    SoloTurns,
    turn_fits,
    turn_wanted,
)
from vgpu_agent.throttle.timesliced import KeptFigure, TimeSlicedSplit

log = structlog.get_logger(__name__)

# After a turn alone gave a figure, a container whose `k` has its tokens buy this many times
# more or less than its figure says re-learns it (`relearn_after_turn`). At the neighbours'
# turns the law's estimates sat within 5 % of their figures on the simulated H200 (42 turns),
# 20-35 % off where their charges had been diluted, 0.55-1.25 of them on a GPU whose use is all
# work.
RELEARN_APART = 1.1
_LOG_RELEARN_APART = math.log(RELEARN_APART)
_LOG_FALSE_ALARM_AGREE = math.log(FALSE_ALARM_AGREE)


class _Closable(Protocol):
    @property
    def closed(self) -> bool: ...


class TurnDevice(Protocol):
    """What a turn needs of a device the controller follows (`controller._Device`)."""

    limited: bool  # whether its rate limited the shim at the last tick
    paused: bool  # paused for a neighbour's turn alone

    @property
    def alloc_id(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def region(self) -> _Closable: ...
    @property
    def limits(self) -> tuple[float, str, str, int] | None:
        """Limit, policy in force, the policy and priority it was found from (None: unread)."""
    @property
    def last(self) -> tuple[object, Decision, bool] | None:
        """The last decision: (observation, decision, open loop)."""


Device = TypeVar("Device", bound=TurnDevice)


class TurnKeeper(Generic[Device]):
    """Per time-sliced GPU: its `SoloTurns`, the turns given, the figure a turn measuring one
    afresh set aside (restored should the turn fail), and whether the operator was told that
    no turn fits there."""

    def __init__(self, params: ControlParams, apply: Callable[[Device, int, int], None],
                 spare_priority: int | None = None, figure_max_age_s: float = 0.0) -> None:
        if not (math.isfinite(figure_max_age_s) and figure_max_age_s >= 0):
            raise ValueError(f"a figure's longest age must be >= 0 s (0: never measured again "
                             f"by age), got {figure_max_age_s!r}")
        self.params = params
        self.apply = apply
        # containers of this priority or more are never paused for a turn alone (None: none)
        self.spare_priority = spare_priority
        # a trusted figure this old is measured afresh in a turn (0: never by age)
        self.figure_max_age_s = figure_max_age_s
        self.turns: dict[str, SoloTurns] = {}
        self.given: dict[str, int] = defaultdict(int)  # per GPU, since start
        # per GPU, the containers spending at its last offer without a trusted figure (never
        # seen alone, or their figure in doubt): those a turn alone is wanted for
        self.awaiting: dict[str, int] = {}
        self._kept: dict[str, KeptFigure] = {}
        self._turnless_told: set[str] = set()

    def solo(self, uuid: str) -> str:
        """The container on a turn alone on the GPU, "" where none is."""
        turns = self.turns.get(uuid)
        return turns.turn.alloc_id if turns is not None and turns.turn is not None else ""

    def past_first_tick(self, uuid: str) -> bool:
        """Whether the GPU's turn under way has had its first tick (which counts what was
        spent before the pause)."""
        turns = self.turns.get(uuid)
        return turns is not None and turns.turn is not None and bool(turns.turn.ticks)

    def offer(self, uuid: str, split: TimeSlicedSplit, steered: Sequence[tuple[Device, int, int]],
              spent_by: Mapping[str, int], now_ns: int, period_s: float,
              beyond_work: bool) -> bool:
        """Start a turn alone on the GPU where one is due: every other device paused, the rates
        they had kept to write back. Whether one started."""
        turns = self.turns.get(uuid)
        if turns is None:
            turns = self.turns[uuid] = SoloTurns()
        # (one pass: asked at every tick of a time-sliced GPU with something spending)
        pausable, candidates, present = True, set(), set()
        priorities: dict[str, int] = {}
        for device, _, _ in steered:
            alloc_id, limits = device.alloc_id, device.limits
            present.add(alloc_id)
            if limits is None:
                pausable = False
            else:
                priorities[alloc_id] = limits[3]
                if limits[1] == "off" or limits[0] >= FULL_SHARE:
                    pausable = False
            if device.last is None:
                pausable = False
            if device.limited:
                candidates.add(alloc_id)
        # a figure in doubt (its periods showed a change), read too coarsely for the spending
        # it now stands for, or long at odds with the periods, is as good as none: measured
        # afresh
        coarse, stale = split.coarse(), split.stale()
        aged = (split.aged(max(1, round(self.figure_max_age_s / period_s)))
                if self.figure_max_age_s > 0 and period_s > 0 else set())
        doubted = split.in_doubt() | coarse | stale | aged
        measured = split.measured() - doubted
        spending = [a for a, used in spent_by.items() if used]
        self.awaiting[uuid] = len([a for a in spending if a not in measured])
        if period_s > 0 and not turn_fits(period_s, turns.most_s):
            self._tell_turnless(uuid, period_s, turns.most_s, spending, measured)
        chosen = turns.due(now_ns, spending, measured,
                           candidates if pausable else (), period_s, present, priorities,
                           spared(priorities, self.spare_priority),
                           beyond_work, doubted, split.costs_apart, coarse)
        if chosen is None:
            return False
        if chosen in doubted:
            self._kept[uuid] = split.remeasure(chosen)
        paused: dict[str, tuple[int, int]] = {}
        for device, _, _ in steered:
            if device.alloc_id != chosen and device.last is not None:
                decision = device.last[1]
                paused[device.key] = (decision.rate, decision.burst)
                device.paused = True
                self.apply(device, PAUSED_RATE, PAUSED_BURST)
        turns.start(chosen, now_ns, paused)
        self.given[uuid] += 1
        log.info("throttle_solo_turn_started", uuid=uuid, alloc_id=chosen, paused=len(paused),
                 most_s=turns.most_s,
                 why="its figure read at a few percent, its spending since grown threefold"
                 if chosen in coarse
                 else "its figure long at odds with the costs its periods show" if chosen in stale
                 else "its figure older than throttle_figure_max_age_seconds" if chosen in aged
                 else "its figure in doubt: its periods showed a change" if chosen in doubted
                 else "a container sharing a time-sliced GPU, never seen alone there")
        return True

    def _tell_turnless(self, uuid: str, period_s: float, most_s: float,
                       spending: list[str], measured: Collection[str]) -> None:
        """Tells the operator, once per GPU, that a turn alone is wanted there (two containers
        or more `spending`, one without a figure it can be charged by) and cannot be given: NVML
        samples the GPU too seldom for PERIODS_NEEDED periods to fit in a turn."""
        if uuid in self._turnless_told:
            return
        if not turn_wanted(spending, measured):
            return
        self._turnless_told.add(uuid)
        log.warning("throttle_solo_turns_impossible", uuid=uuid,
                    sample_period_s=round(period_s, 3), periods_needed=PERIODS_NEEDED,
                    turn_most_s=most_s,
                    detail="NVML samples this time-sliced GPU too seldom for a turn alone to "
                           "measure a container within the shim's longest wait: its shares "
                           "rest on the sample periods alone, which cannot tell the GPU "
                           "counting busy beyond the work from work, tell containers whose "
                           "tokens buy unlike SM time apart only over tens of periods (until "
                           "then they are split as if alike, which may leave them further from "
                           "their shares than the GPU's own time-slicing would) and follow a "
                           "change of phase only over tens of seconds; a driver that samples each "
                           "process's own use avoids it (whether it does so under MPS is not "
                           "yet measured)")

    def over(self, uuid: str, split: TimeSlicedSplit | None, spent_by: Mapping[str, int],
             now_ns: int) -> str | None:
        """A tick of the GPU during a turn alone: why it is over, None while it goes on."""
        turns = self.turns.get(uuid)
        if turns is None or turns.turn is None:
            return "no_turn"
        solo = turns.turn.alloc_id
        if split is None:
            return "not_time_sliced"
        return turns.over(now_ns, spent_by, split.steady(solo), split.spread(solo),
                          split.solo_others)

    def end(self, uuid: str, why: str, now_ns: int, split: TimeSlicedSplit | None,
            devices: Mapping[str, Device], states: dict[str, LoopState] | None) -> None:
        """End the GPU's turn under way, if any: write back the rates of the devices it paused
        (those still followed), hand its figure to the split and the law."""
        turns = self.turns.get(uuid)
        turn = turns.end(now_ns) if turns is not None else None
        if turn is None or turns is None:
            return
        for key, (rate, burst) in turn.paused.items():
            device = devices.get(key)
            if device is None:
                continue
            device.paused = False
            # its bucket as when a rate first limits it: full, its next claims not judged
            device.limited = False
            if not device.region.closed:
                self.apply(device, rate, burst)
        if split is not None:
            split.end_turn(turn.alloc_id)
        fresh = split is not None and turn.alloc_id in split.measured()
        kept = self._kept.pop(uuid, None)
        if fresh and kept is not None and split is not None:
            self._false_alarm(uuid, turns, turn.alloc_id, kept, split.alone[turn.alloc_id][0],
                              now_ns)
        if kept is not None and split is not None:
            split.restore(turn.alloc_id, kept)  # unless measured afresh
        if fresh and states and split is not None:
            relearn_after_turn(turn.alloc_id, states, devices, split.trusted_figures(),
                               self.params)
        if why == "others_ran" and split is not None:
            # a paused container whose processes ran all the same: a shim that ignores its
            # rate, or processes without one (or a process of no container: "")
            log.warning("throttle_solo_turn_spoiled", uuid=uuid, alloc_id=turn.alloc_id,
                        ran=sorted(split.solo_ran), periods=split.solo_others,
                        detail="processes ran on the GPU while paused for a turn alone")
        # `measured`: whether it has a trusted figure now; `figure`: whence ("kept": a
        # re-measure that found none, the figure from before stands)
        measured = split is not None and turn.alloc_id in split.measured()
        log.info("throttle_solo_turn_ended", uuid=uuid, alloc_id=turn.alloc_id, why=why,
                 seconds=round((now_ns - turn.started_ns) / 1e9, 3), measured=measured,
                 figure="fresh" if fresh else "kept" if measured else "none")

    def forget(self, uuid: str) -> None:
        """The GPU is no longer steered (its turn, if any, ended first by `end`)."""
        self.turns.pop(uuid, None)
        self.awaiting.pop(uuid, None)

    def gpus(self) -> Iterable[str]:
        return list(self.turns)

    def _false_alarm(self, uuid: str, turns: SoloTurns, alloc_id: str, kept: KeptFigure,
                     figure: float, now_ns: int) -> None:
        """A turn for a figure the watch put in doubt that measured it again as it was gives
        its try back (`SoloTurns.refund`): without, a false alarm in the minute before a
        change of phase had spent the tries, and a strict 40 % container four times lighter
        than its figure ran at 9 % of its 40 until a try came back (simulated)."""
        before, _, doubt = kept
        if before is None or doubt is None or not before[0] > 0 or not figure > 0:
            return
        if abs(math.log(figure / before[0])) <= _LOG_FALSE_ALARM_AGREE \
                and turns.refund(alloc_id, now_ns):
            log.info("throttle_solo_turn_refunded", uuid=uuid, alloc_id=alloc_id,
                     figure_before=before[0], figure=figure,
                     detail="its figure in doubt measured again as it was: a false alarm")


def relearn_after_turn(measured: str, states: dict[str, LoopState],
                       devices: Mapping[str, TurnDevice], figures: Mapping[str, float],
                       params: ControlParams) -> None:
    """After a turn alone gave `measured` a figure: the law re-learns `k` from the next
    reading (`control.relearn`) for it, and for each other container whose `k` says its
    tokens buy more than RELEARN_APART times more or less than its own figure does.

    Charged by its figure from now on, not as before (by its tokens at a cost the periods
    showed, at another's figure's scale, or by its tokens alone), the measured one's `k`
    was learned from charges of another kind, confidently (and with a noise their moves
    taught): the law followed the new charges a few percent a reading, and a strict 50 %
    container ran at 56-62 % over its worst 2 s after its turn (simulated H200, 8 runs of 40). A
    neighbour's charge moves with the split's weights, by as much as the new figure
    changes them: a strict 50 % container measured first, diluted until its neighbour's
    figure came, ran 2-5 points over its limit over its worst 5 s in 5 runs of 16 with the
    measured one alone re-learned, in 2 with it too (a GPU whose use is all work,
    simulated). Re-learned every time, a neighbour's `k` followed
    the first readings after its pause, a transient, and every one of them too: a steady
    0.3 points off for seconds where nothing had changed."""
    for key, state in list(states.items()):
        device = devices.get(key)
        k = state.tokens_per_pct
        if device is None or not 0 < k < math.inf:
            continue
        figure = figures.get(device.alloc_id, 0.0)
        if device.alloc_id == measured or (
                figure > 0 and abs(math.log(k * figure)) > _LOG_RELEARN_APART):
            states[key] = relearn(state, params)


def spared(priorities: Mapping[str, int], at_least: int | None) -> frozenset[str]:
    """The containers never to be paused for a turn alone: those of priority `at_least` or
    more (`solo_turn_spare_priority`; None: none)."""
    if at_least is None:
        return frozenset()
    return frozenset(alloc_id for alloc_id, priority in priorities.items()
                     if priority >= at_least)

"""When a container of a time-sliced GPU is given a turn alone, and when the turn is over
(`throttle/soloturn.py`)."""

from __future__ import annotations

import math

import pytest

from vgpu_agent.throttle.soloturn import (
    EARLY_READINGS,
    EARLY_SPREAD,
    PERIODS_NEEDED,
    SOLO_TURN_AFTER_S,
    SOLO_TURN_CALM_GAP_S,
    SOLO_TURN_FIRST_GAP_S,
    SOLO_TURN_GAP_S,
    SOLO_TURN_MOST_S,
    SOLO_TURN_REFUND_S,
    SOLO_TURN_REMEASURE_GAP_S,
    SOLO_TURN_RETRY_S,
    TURN_READINGS,
    SoloTurns,
    turn_fits,
)
from vgpu_agent.throttle.timesliced import ALONE_READINGS

S = 1_000_000_000
PERIOD_S = 0.2  # the H200's


def _due(turns: SoloTurns, at_s: float, spending=("a", "b"), measured=(), candidates=("a", "b"),
         period_s: float = PERIOD_S, present=None, priorities=None, spared=(),
         beyond_work: bool = True, doubted=(), apart: bool = False) -> str | None:
    on_gpu = set(spending) | set(candidates) if present is None else set(present)
    return turns.due(int(at_s * S), list(spending), set(measured), set(candidates), period_s,
                     on_gpu, priorities, set(spared), beyond_work, set(doubted),
                     lambda: apart)


def test_a_turn_is_due_once_two_containers_have_spent_together_for_a_while():
    turns = SoloTurns()
    assert _due(turns, 0.0) is None
    assert _due(turns, SOLO_TURN_AFTER_S - 0.1) is None
    assert _due(turns, SOLO_TURN_AFTER_S) == "a"  # the first eligible, in the order given


def test_a_turn_is_for_a_container_without_a_figure_of_its_own():
    # One measured beside one not: the other gets a turn too (charged at the measured one's
    # figure times a ratio of costs the periods learn, it ran at up to twice its limit).
    turns = SoloTurns(after_s=0.0, gap_s=0.0)
    assert _due(turns, 0.0, measured=("a",)) == "b"  # though "a" comes first
    turns.start("b", 0, {})
    turns.end(int(1.0 * S))
    assert _due(turns, 2.0, measured=("a", "b")) is None  # every one spending measured
    # a figure of a container not spending now says nothing of those spending
    assert _due(turns, 3.0, spending=("a", "c"), candidates=("a", "c"), measured=("b",)) == "a"


def test_no_turn_for_a_container_alone_or_with_nobody_pausable():
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, spending=("a",)) is None
    assert _due(turns, 1.0, candidates=()) is None  # none limited: a turn could not hold
    assert _due(turns, 2.0, candidates=("b",)) == "b"


def test_no_turn_where_nvml_periods_are_too_long_for_one():
    # a figure needs PERIODS_NEEDED periods alone, and a turn lasts under 2 s
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, period_s=1.0) is None
    assert _due(turns, 0.0, period_s=0.0) is None  # not seen yet
    longest = SOLO_TURN_MOST_S / PERIODS_NEEDED
    assert _due(turns, 0.0, period_s=longest * 1.01) is None
    assert _due(turns, 0.0, period_s=longest) == "a"
    # what the controller asks to tell the operator, with the same answer
    assert [turn_fits(p) for p in (0.0, 1 / 6, longest, longest * 1.01, 1.0)] \
        == [False, True, True, False, False]
    assert not turn_fits(0.5, most_s=1.0) and turn_fits(0.15, most_s=1.0)


def test_the_wait_starts_over_when_the_containers_stop_sharing():
    turns = SoloTurns()
    assert _due(turns, 0.0) is None
    assert _due(turns, 2.0, spending=("a",)) is None  # one alone: the wait ends
    assert _due(turns, 3.5) is None  # started again at 3.5 s
    assert _due(turns, 3.5 + SOLO_TURN_AFTER_S) == "a"


def test_turns_are_spaced_and_tried_at_most_twice_a_container():
    turns = SoloTurns(after_s=0.0, retry_s=math.inf)  # the tries alone (retries: below)
    assert _due(turns, 0.0) == "a"
    turns.start("a", 0, {"b/0": (100, 10)})
    assert _due(turns, 0.5) is None  # one under way
    assert turns.end(1 * S) is not None
    # b's first turn, soon: the only one it pauses just ran alone (below)
    first = 1.0 + SOLO_TURN_REMEASURE_GAP_S
    assert _due(turns, first - 0.1) is None  # too soon after the last
    assert _due(turns, first) == "b"  # the one tried least
    turns.start("b", int(first * S), {})
    turns.end(int(first * S))
    # each had one: the second tries SOLO_TURN_GAP_S apart
    at = first + SOLO_TURN_GAP_S
    assert _due(turns, at - 1) is None
    assert _due(turns, at) == "a"
    turns.start("a", int(at * S), {})
    turns.end(int(at * S))
    at += SOLO_TURN_GAP_S
    assert _due(turns, at - 1) is None
    assert _due(turns, at) == "b"
    turns.start("b", int(at * S), {})
    turns.end(int(at * S))
    # each had its two: no more, however long they share without a figure (but for retries)
    assert _due(turns, at + 10 * SOLO_TURN_GAP_S) is None
    # a container gone and come back (a new one of the same name) is tried afresh
    assert _due(turns, at + 11 * SOLO_TURN_GAP_S, spending=("b", "c"), candidates=("b", "c")) \
        == "c"


def test_a_pairs_second_first_turn_follows_the_first():
    # The second container's turn pauses only the first, which has just run alone: nobody is
    # paused twice in a row, and the pair has shared for `after_s` already. Waiting the first
    # gap and `after_s` again left the second charged at the first's figure times a cost the
    # periods had not yet learned for 3 s more.
    turns = SoloTurns()
    assert _due(turns, 0.0) is None  # the pair starts spending together
    assert _due(turns, SOLO_TURN_AFTER_S) == "a"
    turns.start("a", int(SOLO_TURN_AFTER_S * S), {"b/0": (100, 10)})
    end = SOLO_TURN_AFTER_S + 1.5
    turns.end(int(end * S))
    assert _due(turns, end + SOLO_TURN_REMEASURE_GAP_S - 0.1) is None
    assert _due(turns, end + SOLO_TURN_REMEASURE_GAP_S) == "b"
    # with a third container, b's turn would pause c a second time: the first gap stands (and
    # `after_s` again, from the first look after the turn)
    three = ("a", "b", "c")
    turns = SoloTurns()
    assert _due(turns, 0.0, spending=three, candidates=three) is None
    assert _due(turns, SOLO_TURN_AFTER_S, spending=three, candidates=three) == "a"
    turns.start("a", int(SOLO_TURN_AFTER_S * S), {})
    turns.end(int(end * S))
    assert _due(turns, end + SOLO_TURN_REMEASURE_GAP_S, spending=three, candidates=three) is None
    assert _due(turns, end + SOLO_TURN_FIRST_GAP_S - 0.1, spending=three,
                candidates=three) is None
    at = end + max(SOLO_TURN_FIRST_GAP_S, SOLO_TURN_REMEASURE_GAP_S + SOLO_TURN_AFTER_S)
    assert _due(turns, at, spending=three, candidates=three) == "b"
    # on a GPU whose use the figures explain, a pair's waits stand: the calm gap, or the first
    # gap where costs are far apart (there the periods share the use out between the turns,
    # and taking the second sooner moved only which noisy figures a pair got: a strict 50 %
    # container beside a 30 % one, its highest 5 s from 15 s on 48.5-54.8 over 16 seeds,
    # against 48.7-52.9)
    for apart, wait in ((False, SOLO_TURN_CALM_GAP_S), (True, SOLO_TURN_FIRST_GAP_S)):
        turns = SoloTurns()
        assert _due(turns, 0.0, beyond_work=False, apart=apart) is None
        assert _due(turns, SOLO_TURN_AFTER_S, beyond_work=False, apart=apart) == "a"
        turns.start("a", int(SOLO_TURN_AFTER_S * S), {})
        turns.end(int(end * S))
        assert _due(turns, end + SOLO_TURN_REMEASURE_GAP_S, beyond_work=False,
                    apart=apart) is None
        assert _due(turns, end + wait + SOLO_TURN_AFTER_S, beyond_work=False,
                    apart=apart) == "b"
    # a newcomer beside the last turn's container (its neighbour gone) was not paused by that
    # turn: it waits `after_s` and the first gap like any first turn, not a brief spending
    turns = SoloTurns()
    assert _due(turns, 0.0) is None
    assert _due(turns, SOLO_TURN_AFTER_S) == "a"
    turns.start("a", int(SOLO_TURN_AFTER_S * S), {"b/0": (100, 10)})
    turns.end(int(end * S))
    late = end + 2 * SOLO_TURN_GAP_S  # b left; c arrives and spends beside a
    assert _due(turns, late, spending=("a", "c"), candidates=("a", "c")) is None
    assert _due(turns, late + SOLO_TURN_AFTER_S - 0.1, spending=("a", "c"),
                candidates=("a", "c")) is None
    assert _due(turns, late + SOLO_TURN_AFTER_S, spending=("a", "c"),
                candidates=("a", "c")) == "c"
    # and a second try of the first (tried already) waits the whole gap, so that a pair's
    # pauses do not alternate
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0) == "a"
    turns.start("a", 0, {})
    turns.end(1 * S)
    assert _due(turns, 1.0 + SOLO_TURN_REMEASURE_GAP_S) == "b"
    turns.start("b", int(1.5 * S), {})
    turns.end(2 * S)
    assert _due(turns, 2.0 + SOLO_TURN_FIRST_GAP_S) is None
    assert _due(turns, 2.0 + SOLO_TURN_GAP_S) == "a"


def test_first_turns_come_closer_together_only_where_the_gpu_counts_beyond_the_work():
    # there a container never measured is charged at another's figure times a cost its
    # periods show, which a time-sliced driver understates for long kernels: a strict-50
    # container of 200 us kernels ran at 64 % of its work (H200) for the gap after its
    # neighbour's turn. Elsewhere the periods share the use out well enough.
    assert SOLO_TURN_AFTER_S <= SOLO_TURN_FIRST_GAP_S < SOLO_TURN_GAP_S
    three = ("a", "b", "c")
    for beyond_work, gap in ((True, SOLO_TURN_FIRST_GAP_S), (False, SOLO_TURN_CALM_GAP_S)):
        turns = SoloTurns(after_s=0.0)
        assert _due(turns, 0.0, spending=three, candidates=three,
                    beyond_work=beyond_work) == "a"
        turns.start("a", 0, {})
        turns.end(1 * S)
        assert _due(turns, 1.0 + gap - 0.1, spending=three, candidates=three,
                    beyond_work=beyond_work) is None
        assert _due(turns, 1.0 + gap, spending=three, candidates=three,
                    beyond_work=beyond_work) == "b"
        turns.start("b", int((1.0 + gap) * S), {})
        turns.end(int((1.0 + gap) * S))
        assert _due(turns, 1.0 + 2 * gap, spending=three, candidates=three,
                    beyond_work=beyond_work) == "c"
        turns.start("c", int((1.0 + 2 * gap) * S), {})
        turns.end(int((1.0 + 2 * gap) * S))
        # all tried once: a second try waits the usual gap
        at = 1.0 + 2 * gap + (SOLO_TURN_GAP_S if beyond_work else SOLO_TURN_CALM_GAP_S)
        assert _due(turns, at - 0.1, spending=three, candidates=three,
                    beyond_work=beyond_work) is None
        assert _due(turns, at, spending=three, candidates=three, beyond_work=beyond_work) == "a"
    with pytest.raises(ValueError, match="first_gap_s"):
        SoloTurns(first_gap_s=-1.0)


def test_a_figure_in_doubt_is_measured_afresh_soon_after_the_last_turn_on_any_gpu():
    # both measured once; then a's figure is in doubt (its periods showed a change, or it was
    # read at a few percent): its charge stands for other work. Waiting 3 s after the doubt
    # and 3 s after its neighbour's re-measure, a pair that changed phase together ran at
    # 44-62 % and 20-30 % of their 40 and 60 for 5-10 s after the change (simulated); a figure
    # rising and falling with a cost at chance's edge charged a strict-50 container 29 and
    # 70 % by turns. Not waiting `after_s` either: its container has spent all along.
    for beyond_work, gap in ((True, SOLO_TURN_FIRST_GAP_S), (False, SOLO_TURN_CALM_GAP_S)):
        turns = SoloTurns(retry_s=math.inf)  # the tries alone (retries: below)
        assert _due(turns, 0.0, beyond_work=beyond_work) is None
        assert _due(turns, SOLO_TURN_AFTER_S, beyond_work=beyond_work) == "a"
        turns.start("a", 0, {})
        turns.end(int(SOLO_TURN_AFTER_S * S))
        # b's first turn: right after a's where the GPU counts beyond the work (a pair's
        # second); on a calm GPU it waits the gap and `after_s` again
        if beyond_work:
            started = SOLO_TURN_AFTER_S + SOLO_TURN_REMEASURE_GAP_S
            assert _due(turns, started - 0.1, beyond_work=beyond_work) is None
        else:
            started = 2 * SOLO_TURN_AFTER_S + gap
            assert _due(turns, SOLO_TURN_AFTER_S + gap, beyond_work=beyond_work) is None
        assert _due(turns, started, beyond_work=beyond_work) == "b"
        turns.start("b", int(started * S), {})
        ended = started + 1.0
        turns.end(int(ended * S))
        assert _due(turns, ended + SOLO_TURN_REMEASURE_GAP_S - 0.1, measured=("b",),
                    doubted=("a",), beyond_work=beyond_work) is None
        assert _due(turns, ended + SOLO_TURN_REMEASURE_GAP_S, measured=("b",), doubted=("a",),
                    beyond_work=beyond_work) == "a"
        turns.start("a", int((ended + 1) * S), {})
        turns.end(int((ended + 2) * S))
        # b's in doubt too (both changed phase): measured right after a's
        assert _due(turns, ended + 2 + SOLO_TURN_REMEASURE_GAP_S, doubted=("b",),
                    beyond_work=beyond_work) == "b"
        turns.start("b", int((ended + 3) * S), {})
        turns.end(int((ended + 4) * S))
        # their tries spent: doubt or not, no third
        assert _due(turns, ended + 10 * SOLO_TURN_CALM_GAP_S, doubted=("a", "b"),
                    beyond_work=beyond_work) is None
    # without the doubt, the figure standing waits the usual gap
    turns = SoloTurns(after_s=0.0)
    for name, at in (("a", 0.0), ("b", 1.0 + SOLO_TURN_REMEASURE_GAP_S)):
        assert _due(turns, at) == name
        turns.start(name, int(at * S), {})
        turns.end(int((at + 1) * S))
    last_end = 2.0 + SOLO_TURN_REMEASURE_GAP_S
    assert _due(turns, last_end + SOLO_TURN_FIRST_GAP_S, measured=("b",)) is None
    assert _due(turns, last_end + SOLO_TURN_GAP_S, measured=("b",)) == "a"


def test_a_container_never_measured_goes_before_a_figure_in_doubt_and_waits_as_a_first_turn():
    # c joined a measured pair; a's figure is in doubt too: c has been tried least, so the turn
    # is c's, after `after_s` and the first gap, not the re-measure's short one
    three = ("a", "b", "c")
    turns = SoloTurns()
    turns.tried = {"a": 1, "b": 1}
    turns.last_end_ns = 0
    wanted = SOLO_TURN_REMEASURE_GAP_S  # c and b spending together since
    assert _due(turns, wanted, spending=three, candidates=three, measured=("b",),
                doubted=("a",)) is None
    at = wanted + max(SOLO_TURN_AFTER_S, SOLO_TURN_FIRST_GAP_S)
    assert _due(turns, at - 0.1, spending=three, candidates=three, measured=("b",),
                doubted=("a",)) is None
    assert _due(turns, at, spending=three, candidates=three, measured=("b",),
                doubted=("a",)) == "c"
    turns.start("c", int(at * S), {})
    end = at + 1
    turns.end(int(end * S))
    assert _due(turns, end + SOLO_TURN_REMEASURE_GAP_S, spending=three, candidates=three,
                measured=("b", "c"), doubted=("a",)) == "a"


def test_a_containers_tries_come_back_one_each_retry_up_to_the_tries():
    # two phase changes: the first re-measure spent the second try (or a false alarm did);
    # without one back, a strict 40 % container ran at 9 % after the second change for as
    # long as it ran (simulated)
    turns = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0)
    turns.tried, turns.credit = {"a": 2, "b": 2}, {"a": (0.0, 0), "b": (0.0, 0)}
    turns.last_end_ns = 0

    def turn(at: float) -> str | None:
        chosen = _due(turns, at, doubted=("a", "b"))
        if chosen is not None:
            turns.start(chosen, int(at * S), {})
            turns.end(int(at * S))
        return chosen

    assert turn(SOLO_TURN_RETRY_S - 0.1) is None
    assert turn(SOLO_TURN_RETRY_S) == "a"  # both have one back: a first in the order given
    assert turn(SOLO_TURN_RETRY_S + 0.1) == "b"
    assert turn(SOLO_TURN_RETRY_S + 0.2) is None  # both spent again
    assert turn(2 * SOLO_TURN_RETRY_S - 0.1) is None
    assert turn(2 * SOLO_TURN_RETRY_S) == "a"
    # b's come back over a long wait, but never more than the tries: two, then none
    late = 10 * SOLO_TURN_RETRY_S
    given = [turn(late + 0.1 * n) for n in range(5)]
    assert given[0] == "b"  # tried least
    assert sorted(given[:4]) == ["a", "a", "b", "b"] and given[4] is None
    # a container gone is forgotten, its tries with it; one of the same name later is new
    _due(turns, late + 1, spending=("b", "c"), candidates=("b", "c"), measured=("b", "c"))
    assert "a" not in turns.tried and "a" not in turns.credit
    # retry_s infinite: the tries are all there is
    never = SoloTurns(after_s=0.0, gap_s=0.0, retry_s=math.inf)
    never.tried, never.credit = {"a": 2, "b": 2}, {"a": (0.0, 0), "b": (0.0, 0)}
    assert _due(never, 1e6, measured=("b",), doubted=("a",)) is None


def test_turns_are_spaced_wider_on_a_gpu_not_seen_counting_busy_beyond_the_work():
    # there the periods share the use out well enough, and a pause costs more than it buys
    assert SOLO_TURN_GAP_S < SOLO_TURN_CALM_GAP_S
    turns = SoloTurns(after_s=0.0)
    three = ("a", "b", "c")
    assert _due(turns, 0.0, spending=three, candidates=three, beyond_work=False) == "a"
    turns.start("a", 0, {})
    turns.end(1 * S)
    assert _due(turns, 1.0 + SOLO_TURN_GAP_S, spending=three, candidates=three,
                beyond_work=False) is None
    assert _due(turns, 1.0 + SOLO_TURN_CALM_GAP_S - 0.1, spending=three, candidates=three,
                beyond_work=False) is None
    # seen counting beyond the work since: the short gap is over already
    assert _due(turns, 1.0 + SOLO_TURN_CALM_GAP_S - 0.1, spending=three, candidates=three) == "b"
    turns.start("b", 0, {})
    end = 1.0 + SOLO_TURN_CALM_GAP_S
    turns.end(int(end * S))
    assert _due(turns, end + SOLO_TURN_CALM_GAP_S, spending=three, candidates=three,
                beyond_work=False) == "c"
    with pytest.raises(ValueError,
                       match=r"calm_gap_s >= 0.*got 0\.0, 10\.0, -1\.0, 3\.0, 0\.5, 2"):
        SoloTurns(after_s=0.0, calm_gap_s=-1.0)


def test_a_container_keeps_its_tries_while_it_stays_on_the_gpu_idle_or_not():
    turns = SoloTurns(after_s=0.0, retry_s=math.inf)  # the tries alone (retries: below)
    for n, whose in enumerate("abab"):
        at = n * 2 * SOLO_TURN_GAP_S
        assert _due(turns, at) == whose
        turns.end(int(at * S))
    at = 10 * SOLO_TURN_GAP_S
    assert _due(turns, at) is None  # both had their two
    # idle and not limited for a while, but still there: its tries are not forgotten
    assert _due(turns, at + 1, spending=("b",), candidates=(), present=("a", "b")) is None
    assert _due(turns, at + 2 * SOLO_TURN_GAP_S) is None
    # gone for one tick: a container of that name later is another
    assert _due(turns, at + 3 * SOLO_TURN_GAP_S, spending=("b",), candidates=(),
                present=("b",)) is None
    assert _due(turns, at + 4 * SOLO_TURN_GAP_S) == "a"


def test_the_turn_goes_to_the_highest_priority_among_those_tried_least():
    turns = SoloTurns(after_s=0.0)
    ranks = {"a": 0, "b": 50, "c": -10}
    spending = ("a", "b", "c")
    assert _due(turns, 0.0, spending=spending, candidates=spending, priorities=ranks) == "b"
    turns.end(0)
    # tried once: the others first, the highest of them
    assert _due(turns, SOLO_TURN_GAP_S, spending=spending, candidates=spending,
                priorities=ranks) == "a"
    turns.end(int(SOLO_TURN_GAP_S * S))
    # not eligible (its rate does not limit it): the next highest
    assert _due(turns, 2 * SOLO_TURN_GAP_S, spending=spending, candidates=("a", "b"),
                priorities=ranks) == "b"
    # equal priorities: the first spending, as without them
    fresh = SoloTurns(after_s=0.0)
    assert _due(fresh, 0.0, spending=("c", "a"), candidates=("c", "a"),
                priorities={"a": 5, "c": 5}) == "c"


def test_a_spared_container_is_never_paused():
    three = ("a", "b", "c")
    # one spared: only it may be given the turn (the others then wait, not it)
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, spending=three, candidates=three, spared=("b",)) == "b"
    # ... and where it cannot be (its rate does not limit it), no turn
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, spending=three, candidates=("a", "c"), spared=("b",)) is None
    # two spared on the GPU, spending or not: none
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, spending=("a", "b"), present=three, spared=("b", "c")) is None
    assert _due(turns, 1.0, spending=("a", "b"), present=("a", "b")) == "a"  # c left


def test_a_turn_ends_once_its_container_is_measured_over_enough_batches():
    turns = SoloTurns()
    turns.start("a", 0, {"b/0": (100, 10)})
    assert turns.over(int(0.2 * S), {"a": 50, "b": 0}, 0, 0.1, 0) is None
    # trusted, but averaged over more batches while time allows
    assert turns.over(int(0.8 * S), {"a": 50, "b": 0}, ALONE_READINGS, 0.1, 0) is None
    assert turns.over(int(1.0 * S), {"a": 50, "b": 0}, TURN_READINGS, 0.1, 0) == "measured"
    turn = turns.end(int(0.4 * S))
    assert turn is not None and turn.alloc_id == "a" and turn.paused == {"b/0": (100, 10)}
    assert turns.turn is None and turns.end(S) is None


def test_a_turn_ends_sooner_where_its_batches_agree_closely():
    turns = SoloTurns()
    turns.start("a", 0, {})
    # trusted, and agreeing: one batch more is not enough to judge how far they scatter
    assert turns.over(int(0.8 * S), {"a": 50}, ALONE_READINGS, 0.0, 0) is None
    assert turns.over(int(1.0 * S), {"a": 50}, EARLY_READINGS, EARLY_SPREAD * 1.01, 0) is None
    assert turns.over(int(1.0 * S), {"a": 50}, EARLY_READINGS, EARLY_SPREAD, 0) == "measured"


def test_a_turn_ends_when_it_cannot_give_a_figure():
    turns = SoloTurns()
    turns.start("a", 0, {})
    assert turns.over(int(0.1 * S), {"a": 0, "b": 0}, 0, 0.1, 0) == "stopped"
    turns = SoloTurns()
    turns.start("a", 0, {})
    # what a paused container's `state` claims is not evidence: the turn goes on ...
    assert turns.over(int(0.1 * S), {"a": 50, "b": 10**9}, 0, 0.1, 0) is None
    assert turns.over(int(0.2 * S), {"a": 50, "b": 10**9}, 1, 0.1, 0) is None
    # ... but a period NVML gave another process is: the figure is spoiled
    assert turns.over(int(0.3 * S), {"a": 50, "b": 0}, 1, 0.1, 1) == "others_ran"
    turns = SoloTurns()
    turns.start("a", 0, {})
    assert turns.over(int((SOLO_TURN_MOST_S - 0.01) * S), {"a": 50}, 1, 0.1, 0) is None
    assert turns.over(int(SOLO_TURN_MOST_S * S), {"a": 50}, ALONE_READINGS - 1, 0.1, 0) \
        == "too_long"
    turns.start("a", 0, {})
    # out of time with a figure trusted: measured, on fewer batches
    assert turns.over(int(SOLO_TURN_MOST_S * S), {"a": 50}, ALONE_READINGS, 0.1, 0) == "measured"
    assert SoloTurns().over(0, {"a": 50}, 0, 0.1, 0) is None  # none under way


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"most_s": 0.0}, "0.0"), ({"most_s": 2.0}, "2.0"), ({"most_s": float("nan")}, "nan"),
    ({"after_s": -1.0}, "-1.0"), ({"gap_s": -1.0}, "-1.0"), ({"tries": 0}, "0"),
    ({"remeasure_gap_s": -1.0}, r"remeasure_gap_s >= 0.*-1\.0"),
    ({"retry_s": 0.0}, r"retry_s > 0.*got 0\.0"), ({"retry_s": float("nan")}, "nan"),
    ({"refund_s": 0.0}, r"refund_s > 0.*got 0\.0"), ({"refund_s": float("nan")}, "nan"),
])
def test_bad_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SoloTurns(**kwargs)


def test_the_first_gap_is_for_a_container_that_can_be_given_the_turn():
    # one container spared by the operator: only it may be given a turn; the other, never
    # tried, cannot be, so it does not bring the spared one's second turn sooner
    turns = SoloTurns(after_s=0.0)
    assert _due(turns, 0.0, spared=("a",)) == "a"
    turns.start("a", 0, {})
    turns.end(1 * S)
    assert _due(turns, 1.0 + SOLO_TURN_FIRST_GAP_S, spared=("a",)) is None
    assert _due(turns, 1.0 + SOLO_TURN_GAP_S, spared=("a",)) == "a"


def test_first_turns_come_soon_on_a_calm_gpu_only_where_costs_are_far_apart():
    # a GPU whose use is all work: a minute between turns, first ones too, unless the
    # containers' costs differ far (the second's figure then matters within seconds; a pair's
    # second waits the first gap there too: test_a_pairs_second_first_turn_follows_the_first)
    for apart, expected in ((False, SOLO_TURN_CALM_GAP_S), (True, SOLO_TURN_FIRST_GAP_S)):
        turns = SoloTurns(after_s=0.0)
        assert _due(turns, 0.0, beyond_work=False, apart=apart) == "a"
        turns.start("a", 0, {})
        turns.end(int(1.0 * S))
        at = 1.0 + expected
        assert _due(turns, at - 0.1, measured=("a",), beyond_work=False, apart=apart) is None
        assert _due(turns, at, measured=("a",), beyond_work=False, apart=apart) == "b"
    # ... first turns only: a container tried before waits the minute there, costs apart or
    # not (a figure in doubt is measured afresh sooner on any GPU: the test above)
    turns = SoloTurns(after_s=0.0)
    turns.tried = {"a": 1, "b": 1}
    turns.last_end_ns = 0
    assert _due(turns, SOLO_TURN_FIRST_GAP_S + 1, measured=("a",), beyond_work=False,
                apart=True) is None
    assert _due(turns, SOLO_TURN_CALM_GAP_S, measured=("a",), beyond_work=False,
                apart=True) == "b"


def test_a_coarse_figures_turn_spends_no_try_once_per_container():
    # a's first turn read low (its rate cut then); measured again once it spends threefold,
    # that turn spends no try: a change of phase later finds one in hand. Once only while it
    # stays: the next coarse turn spends a try like any other
    turns = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0,
                      retry_s=math.inf)

    def turn(at: float, doubted=("a",), free=("a",)) -> str | None:
        chosen = turns.due(int(at * S), ["a", "b"], {"b"}, {"a", "b"}, PERIOD_S, {"a", "b"},
                           None, set(), True, set(doubted), lambda: False, set(free))
        if chosen is not None:
            turns.start(chosen, int(at * S), {})
            turns.end(int(at * S))
        return chosen

    assert turn(0.0, doubted=(), free=()) == "a"  # its first turn: one try spent
    assert turn(1.0) == "a"  # coarse: free
    assert turns.freed == {"a"} and turns._credit("a", 2 * S) == 1
    assert turn(2.0, free=()) == "a"  # in doubt: its second try
    assert turn(3.0) is None  # coarse again, but its free turn is spent, and so are its tries
    # free only for a figure measured afresh (one in `doubted`)
    turns = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0,
                      retry_s=math.inf)
    turns.tried, turns.credit = {"a": 2}, {"a": (0.0, 0)}
    assert turn(4.0, doubted=()) is None
    # gone, then back: a container of that name later is another
    turns.freed = {"a"}
    turns.due(5 * S, ["b"], {"b"}, {"b"}, PERIOD_S, {"b"})
    assert turns.freed == set()


def test_a_false_alarms_try_comes_back_once_per_refund_time():
    # a false alarm of the watch spent a's try; its figure measured again as it was, the try
    # comes back (without, a change of phase soon after found none in hand: a strict 40 %
    # container four times lighter than its figure ran at 9 % until one came back, simulated)
    turns = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0,
                      retry_s=math.inf)

    def turn(at: float) -> str | None:
        chosen = _due(turns, at, measured=("b",), doubted=("a",))
        if chosen is not None:
            turns.start(chosen, int(at * S), {})
            turns.end(int(at * S))
        return chosen

    assert turn(0.0) == "a" and turns._credit("a", 0) == 1
    assert turns.refund("a", 1 * S) and turns._credit("a", S) == 2
    assert not turns.refund("a", 1 * S)  # once for the turn that spent it
    assert turn(2.0) == "a" and turn(3.0) == "a" and turn(4.0) is None  # two, then none
    # within the refund time no other comes back, however many false alarms
    assert not turns.refund("a", int(SOLO_TURN_REFUND_S * S))
    assert turns._credit("a", int(SOLO_TURN_REFUND_S * S)) == 0
    # past it, one does
    assert turn(SOLO_TURN_REFUND_S + 2) is None
    turns.spent_try["a"] = True  # (as the last turn left it)
    assert turns.refund("a", int((SOLO_TURN_REFUND_S + 2) * S))
    assert turn(SOLO_TURN_REFUND_S + 3) == "a"
    # never more than the tries
    full = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0)
    full.spent_try["a"] = True
    assert full.refund("a", 0) and full._credit("a", 0) == full.tries


def test_a_turn_that_spent_no_try_gets_none_back():
    # a coarse figure's free turn spent nothing: nothing to refund; nor a container gone
    turns = SoloTurns(after_s=0.0, gap_s=0.0, first_gap_s=0.0, remeasure_gap_s=0.0,
                      retry_s=math.inf)
    chosen = turns.due(0, ["a", "b"], {"b"}, {"a", "b"}, PERIOD_S, {"a", "b"}, None, set(),
                       True, {"a"}, lambda: False, {"a"})
    assert chosen == "a" and turns.spent_try == {"a": False}
    assert not turns.refund("a", S) and turns._credit("a", S) == turns.tries
    turns.tried["b"], turns.spent_try["b"] = 1, True
    turns.due(2 * S, ["a"], {"a"}, {"a"}, PERIOD_S, {"a"})  # b gone: forgotten
    assert "b" not in turns.spent_try and not turns.refund("b", 3 * S)
    # refund_s infinite: no try comes back for a false alarm
    never = SoloTurns(refund_s=math.inf)
    never.spent_try["a"] = True
    assert not never.refund("a", 0)


def _plain_due(turns: SoloTurns, now_ns, spending, measured, candidates, period_s, present,
               priorities, spared, beyond_work, doubted, apart, free):
    """`SoloTurns.due` as its docstring reads, list by list: the oracle its one pass over
    those spending must agree with, decision for decision and in every state it leaves."""
    for gone in [a for a in turns.tried if a not in present]:
        del turns.tried[gone]
        turns.credit.pop(gone, None)
        turns.freed.discard(gone)
        turns.spent_try.pop(gone, None)
        turns.refunded.pop(gone, None)
    if (turns.turn is not None or not (len(spending) >= 2
                                       and not all(a in measured for a in spending))
            or not turn_fits(period_s, turns.most_s)):
        turns.waiting_ns = None
        return None
    if turns.waiting_ns is None:
        turns.waiting_ns = now_ns
    unspent = {a for a in free if a in doubted and a not in turns.freed}
    eligible = [a for a in spending if a in candidates and a not in measured
                and (a in unspent or turns._credit(a, now_ns) >= 1 - 1e-9)]
    spare = [a for a in present if a in spared]
    if spare:
        eligible = [a for a in eligible if a in spare] if len(spare) == 1 else []
    if not eligible:
        return None
    ranks = priorities or {}
    chosen = min(eligible, key=lambda a: (turns.tried.get(a, 0), -ranks.get(a, 0)))
    after_ns, gap_ns = turns.after_ns, turns.gap_ns if beyond_work else turns.calm_gap_ns
    if chosen in doubted:
        after_ns, gap_ns = 0, min(gap_ns, turns.remeasure_gap_ns)
    elif (beyond_work and any(a not in turns.tried or a in doubted for a in eligible)) or (
            any(a not in turns.tried for a in eligible) and apart()):
        gap_ns = min(gap_ns, turns.first_gap_ns)
        if (beyond_work and chosen not in turns.tried and chosen in turns.last_paused
                and set(present) - {chosen} <= {turns.last_owner}):
            after_ns, gap_ns = 0, min(gap_ns, turns.remeasure_gap_ns)
    if now_ns - turns.waiting_ns < after_ns or (
            turns.last_end_ns is not None and now_ns - turns.last_end_ns < gap_ns):
        return None
    turns.tried[chosen] = turns.tried.get(chosen, 0) + 1
    if chosen in unspent:
        turns.freed.add(chosen)
    else:
        turns.credit[chosen] = (turns._credit(chosen, now_ns) - 1, now_ns)
    turns.spent_try[chosen] = chosen not in unspent
    turns.waiting_ns = None
    turns.last_owner, turns.last_paused = chosen, frozenset(present) - {chosen}
    return chosen


def _state(turns: SoloTurns) -> tuple:
    return tuple(getattr(turns, name) for name in SoloTurns.__slots__)


@pytest.mark.parametrize("seed", range(10))
def test_the_one_pass_choice_agrees_with_the_plain_one_on_random_histories(seed):
    # Two copies of one GPU's turns, driven by the same random ticks (containers joining,
    # leaving, spending, measured, doubted, spared; turns started and ended), one through
    # `due` and one through the oracle: every answer and every state the same, the apart
    # question asked as often.
    import random

    rng = random.Random(seed)
    retry_s = rng.choice([SOLO_TURN_RETRY_S, 5.0, math.inf])
    kwargs = dict(after_s=rng.choice([0.0, 1.0, 3.0]), gap_s=rng.choice([2.0, 10.0]),
                  calm_gap_s=rng.choice([0.0, 5.0, 60.0]), first_gap_s=rng.choice([0.0, 1.0]),
                  remeasure_gap_s=rng.choice([0.0, 0.5]), tries=rng.choice([1, 2, 3]),
                  retry_s=retry_s)
    ours, plain = SoloTurns(**kwargs), SoloTurns(**kwargs)
    names = [f"c{n}" for n in range(7)]
    doubt = rng.choice([0.15, 0.5])
    present = set(names[:4])
    asked = [0, 0]
    given = 0
    now_ns = 0
    for _ in range(3000):
        now_ns += rng.choice([1, 100, 200, 500, 2000]) * 1_000_000
        # containers come and go now and then (one gone has its tries forgotten)
        present ^= {a for a in names if rng.random() < 0.02}
        spending = [a for a in names if a in present and rng.random() < 0.8]
        rng.shuffle(spending)
        measured = {a for a in present if rng.random() < 0.3}
        candidates = {a for a in present if rng.random() < 0.85}
        doubted = {a for a in present - measured if rng.random() < doubt}
        free = {a for a in doubted if rng.random() < 0.5}
        spared = {a for a in present if rng.random() < 0.05}
        priorities = {a: rng.choice([0, 0, 1, 5]) for a in present} if rng.random() < 0.7 \
            else None
        period_s = rng.choice([0.0, PERIOD_S, PERIOD_S, 1.0])
        beyond_work, is_apart = rng.random() < 0.5, rng.random() < 0.5

        def apart(n=0):
            def ask() -> bool:
                asked[n] += 1
                return is_apart
            return ask

        args = (now_ns, spending, measured, candidates, period_s, present, priorities, spared,
                beyond_work, doubted)
        got = ours.due(*args, apart(0), free)
        want = _plain_due(plain, *args, apart(1), free)
        assert got == want
        assert _state(ours) == _state(plain)
        assert asked[0] == asked[1]
        if got is not None:
            given += 1
            for turns in (ours, plain):
                turns.start(got, now_ns, {})
        elif ours.turn is not None and rng.random() < 0.3:
            for turns in (ours, plain):
                turns.end(now_ns)
            if rng.random() < 0.3:
                refunded = rng.choice(names)
                for turns in (ours, plain):
                    turns.refund(refunded, now_ns)
    assert given > 20  # the histories gave turns, not only refusals

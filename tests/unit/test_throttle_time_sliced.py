"""Sharing a time-sliced GPU's use out among containers (`timesliced.TimeSlicedSplit`): NVML gives
each sample period whole to one process, with the whole GPU's use as its value."""

from __future__ import annotations

import math
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from vgpu_agent.throttle import timesliced
from vgpu_agent.throttle.timesliced import (
    PERIODS_REMEMBERED,
    SHARED_PERIODS,
    ChangeWatch,
    TimeSlicedSplit,
    read_as_periods,
)


def test_use_is_split_by_tokens_at_once():
    split = TimeSlicedSplit()
    got = split.share([["a"]], 80.0, {"a": 300, "b": 100})
    # (one period given to b moves its weight a little: it counts as one period in many)
    assert got == pytest.approx({"a": 60.0, "b": 20.0}, abs=2)
    # the tokens change: so does the split, on the same tick
    assert split.share([["b"]], 80.0, {"a": 100, "b": 300})["b"] > 40


def test_a_container_that_spent_nothing_and_was_given_no_period_used_nothing():
    split = TimeSlicedSplit()
    assert split.share([["a"]], 50.0, {"a": 100, "b": 0}) == pytest.approx({"a": 50.0, "b": 0.0})


def test_periods_given_to_strangers_are_nobodys_use_here():
    split = TimeSlicedSplit()
    for n in range(200):
        got = split.share([["" if n % 4 == 0 else "a"]], 100.0, {"a": 100})
    assert got["a"] == pytest.approx(75, abs=3)


def test_tokens_that_buy_more_sm_time_weigh_more_as_periods_show_it():
    # b's kernels run 3x longer per token: with equal tokens it takes 3 periods in 4
    split = TimeSlicedSplit()
    first = split.share([["b"]], 100.0, {"a": 100, "b": 100})
    for n in range(5 * PERIODS_REMEMBERED):
        got = split.share([["a" if n % 4 == 0 else "b"]], 100.0, {"a": 100, "b": 100})
    assert first["b"] == pytest.approx(50, abs=15)
    assert got["b"] == pytest.approx(75, abs=5)
    assert got["a"] + got["b"] == pytest.approx(100)


def test_a_container_lying_about_its_tokens_is_found_out_by_its_periods():
    # "liar" reports a tenth of what it spends: equal work, so equal periods
    split = TimeSlicedSplit()
    for n in range(5 * PERIODS_REMEMBERED):
        got = split.share([["liar" if n % 2 else "honest"]], 100.0, {"liar": 10, "honest": 100})
    # its weight is capped (COST_RANGE), yet it is charged far more than its tokens say
    assert got["liar"] > 40


def test_a_container_gone_is_forgotten():
    split = TimeSlicedSplit()
    split.share([["a"], ["b"]], 60.0, {"a": 1, "b": 1})
    split.share([["a"]], 60.0, {"a": 1})
    assert set(split.parts) == {"a"}


def test_a_container_running_without_the_shim_is_charged_its_part_of_the_periods():
    # no token spent, yet NVML gives it periods: its processes bypass the shim
    split = TimeSlicedSplit()
    got = split.share([["bypass"], ["a"]], 90.0, {"bypass": 0, "a": 500})
    assert got == pytest.approx({"bypass": 45.0, "a": 45.0})
    # a period it was not given: its part shrinks, it is not charged nothing at once
    got = split.share([["a"]], 90.0, {"bypass": 0, "a": 500})
    assert got == pytest.approx({"bypass": 30.0, "a": 60.0})
    # given none for SHARED_PERIODS periods: no longer charged
    assert split.share([["a"]] * SHARED_PERIODS, 90.0, {"bypass": 0, "a": 500})["bypass"] == 0


def test_a_container_understating_its_tokens_is_charged_what_its_periods_prove():
    # "liar" reports a thousandth of what it spends, for half the periods: past the capped
    # weight, the floor from its periods charges it nearly half, and the honest one not all
    split = TimeSlicedSplit()
    for n in range(5 * PERIODS_REMEMBERED):
        got = split.share([["liar" if n % 2 else "honest"]], 100.0, {"liar": 1, "honest": 1000})
    assert got["liar"] > 40
    assert got["honest"] < 60
    assert got["liar"] + got["honest"] == pytest.approx(100)


def test_a_floor_needs_periods_enough_to_rule_out_chance():
    # one period given proves little: the tokens decide, with a small floor at most
    split = TimeSlicedSplit()
    got = split.share([["b"]], 100.0, {"a": 900, "b": 100})
    assert got["b"] < 25
    assert got["a"] + got["b"] == pytest.approx(100)


def _drawn(rng: random.Random, spent: dict[str, int], cost: dict[str, float]) -> tuple[str, dict]:
    """One period as a time-sliced GPU gives it: to a container with odds of its SM time
    (tokens x cost), and each container's true part of the GPU."""
    work = {a: spent[a] * cost[a] for a in spent}
    whole = sum(work.values())
    pick, owner = rng.random() * whole, ""
    for alloc_id, w in work.items():
        owner = alloc_id
        if pick < w:
            break
        pick -= w
    return owner, {a: 100 * w / whole for a, w in work.items()}


def _errors(cost_at, periods: int, seed: int = 0) -> tuple[list[float], TimeSlicedSplit]:
    """a's error (points) per period while the rates move (tokens drawn anew every period)."""
    rng, split, errors = random.Random(seed), TimeSlicedSplit(), []
    for n in range(periods):
        spent = {"a": rng.randint(200, 400), "b": rng.randint(50, 150)}
        owner, truth = _drawn(rng, spent, cost_at(n))
        errors.append(abs(split.share([[owner]], 100.0, spent)["a"] - truth["a"]))
    return errors, split


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_costs_are_learned_against_the_tokens_of_each_period(seed):
    # b's tokens buy four times a's SM time, and both spend differently every period: the
    # split follows the true parts, whatever the rates do meanwhile
    errors, split = _errors(lambda n: {"a": 1.0, "b": 4.0}, 600, seed)
    late = errors[300:]
    assert sum(late) / len(late) < 6.5  # 2.3-4.8 over seeds 0-5; equal costs: about 30
    assert math.exp(split.costs["b"][0] - split.costs["a"][0]) == pytest.approx(4, rel=0.25)
    assert split.restarts <= 1  # no change of workload: the watch stays (nearly) quiet


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_phase_change_is_found_and_followed_within_seconds(seed, monkeypatch):
    # after 600 periods the costs swap (a's tokens now buy four times b's): 60-120 periods
    # later (10-20 s at six a second) the split is near the truth, 120-240 later close to it;
    # without the watch, only the fading information follows, several times slower
    def swap(n):
        return {"a": 1.0, "b": 4.0} if n < 600 else {"a": 4.0, "b": 1.0}

    errors, split = _errors(swap, 840, seed)
    assert split.restarts >= 1
    assert sum(errors[660:720]) / 60 < 12  # 3.8-10.1 over seeds 0-5
    assert sum(errors[720:]) / 120 < 7  # 1.3-6.4
    monkeypatch.setattr(timesliced, "CHANGE_EVIDENCE", math.inf)
    blind, unwatched = _errors(swap, 840, seed)
    assert unwatched.restarts == 0
    assert sum(blind[660:720]) / 60 > 15  # 19.8-23.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_watch_waits_for_costs_informed_again_after_a_change(seed):
    # the costs swap at period 600 and back at 640, while they are still being re-learned
    # after the first was found: nothing more is found until every cost is informed again
    # (CONFIRM_INFO), and the costs, learning fast from little, follow the swap back
    # themselves (a figure that went stale with it is asked afresh: `stale`)
    def swap(n):
        return {"a": 1.0, "b": 4.0} if n < 600 or n >= 640 else {"a": 4.0, "b": 1.0}

    rng, split = random.Random(seed), TimeSlicedSplit()
    found, errors = [], []
    for n in range(1100):
        spent = {"a": rng.randint(200, 400), "b": rng.randint(50, 150)}
        owner, truth = _drawn(rng, spent, swap(n))
        informed = min(info for _, info in split.costs.values()) if split.costs else 0.0
        restarts = split.restarts
        errors.append(abs(split.share([[owner]], 100.0, spent)["a"] - truth["a"]))
        if split.restarts > restarts:
            found.append((n, informed))
    assert 600 <= found[0][0] < 640, found
    # every change found was found on costs informed past the re-learning of the last
    assert all(informed >= timesliced.CONFIRM_INFO for _, informed in found), found
    assert sum(errors[1000:]) / 100 < 7, found  # the swap back followed


@pytest.mark.parametrize("seed", [2, 4, 7])
def test_a_container_forever_changing_phase_does_not_blind_the_watch_to_its_neighbours(seed):
    # x's tokens buy six times more, then less again, every 80 periods: its cost is nearly
    # always being re-learned. b's buy four times more from period 1240: while x re-learns, the
    # watch judges a's and b's periods between themselves, and finds b's change (the tree
    # that did not ask the watch while any cost re-learned: after 396 periods, or never)
    rng, split = random.Random(seed), TimeSlicedSplit()
    found, x_relearning = None, 0
    for n in range(1800):
        cost = {"a": 1.0, "b": 1.0 if n < 1240 else 4.0, "x": 1.0 if (n // 80) % 2 == 0 else 6.0}
        spent = {alloc_id: rng.randint(80, 120) for alloc_id in cost}
        owner, _ = _drawn(rng, spent, cost)
        restarts = split.restarts
        split.share([[owner]], 100.0, spent)
        if n >= 1240:
            x_relearning += "x" in split.relearning
            if found is None and split.restarts > restarts and "b" in split.relearning:
                found = n - 1240
    assert x_relearning > 140  # 146-325 of 560: x was re-learning much of the time
    assert found is not None and found < 300, found  # 70-267


def test_the_watch_judges_the_standing_costs_among_themselves():
    chances = {"a": 0.2, "b": 0.3, "x": 0.5}
    # nothing re-learning, or none of those spending: judged as they are
    assert timesliced._standing(chances, ["a", "x"], set()) == (chances, ["a", "x"])
    assert timesliced._standing(chances, ["a", "x"], {"gone"}) == (chances, ["a", "x"])
    # x re-learning: a's and b's chances given that one of them was given the period, and
    # x's periods left out
    expected, drawn = timesliced._standing(chances, ["a", "x", "b", "x"], {"x"})
    assert expected == pytest.approx({"a": 0.4, "b": 0.6})
    assert drawn == ["a", "b"]
    # all re-learning: nothing to judge
    assert timesliced._standing(chances, ["a"], {"a", "b", "x"}) == ({}, [])


def test_the_watch_needs_two_containers_and_periods_it_can_predict():
    watch = ChangeWatch()
    assert not watch.changed({"a": 1.0}, ["a"] * 1000)  # alone: every period is its own
    # a container predicted to get a tenth of the periods and given every one of ten in a row
    assert "a" in watch.changed({"a": 0.1, "b": 0.9}, ["a"] * 10)
    assert watch.sums == {}  # judged afresh from there
    # as predicted: never a change
    assert not ChangeWatch().changed({"a": 0.5, "b": 0.5}, ["a", "b"] * 500)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_liar_setting_off_the_watch_gains_little(seed):
    # it does half the work but writes a tenth, then half, of its tokens, switching every 50
    # periods: each switch looks like a change of phase and cuts what the weights have
    # learned, yet it is charged most of its half (the tree before this watch: 42.8-43.8)
    rng, split, charged = random.Random(seed), TimeSlicedSplit(), []
    for n in range(3000):
        claim = 10 if (n // 50) % 2 == 0 else 50
        owner = "liar" if rng.random() < 0.5 else "honest"
        got = split.share([[owner]], 100.0, {"liar": claim, "honest": 100})
        if n >= 500:
            charged.append(got["liar"])
    assert split.restarts > 10
    assert sum(charged) / len(charged) > 40  # 41.5-42.3


def test_only_the_container_that_changed_phase_forgets_what_was_learned():
    # three containers of equal cost; after 600 periods a's tokens buy four times the SM time:
    # a's cost is re-learned from little, b's and c's keep their information (their costs
    # relative to each other did not change)
    rng, split = random.Random(0), TimeSlicedSplit()
    least: dict[str, float] = {"a": math.inf, "b": math.inf, "c": math.inf}
    for n in range(900):
        cost = {"a": 1.0 if n < 600 else 4.0, "b": 1.0, "c": 1.0}
        spent = {alloc_id: rng.randint(80, 120) for alloc_id in cost}
        owner, _ = _drawn(rng, spent, cost)
        split.share([[owner]], 100.0, spent)
        if n >= 600:
            for alloc_id in least:
                least[alloc_id] = min(least[alloc_id], split.costs[alloc_id][1])
    assert split.restarts >= 1
    assert least["a"] <= timesliced.RESTART_INFO + 1
    assert min(least["b"], least["c"]) > 4 * timesliced.RESTART_INFO
    assert math.exp(split.costs["a"][0] - split.costs["b"][0]) == pytest.approx(4, rel=0.35)


@pytest.mark.parametrize("sign", [1, -1])
def test_a_learned_cost_is_drawn_towards_1_by_how_far_chance_could_take_it(sign):
    # d: DOUBT_SIGMAS deviations of a log cost learned from `info`; within about half of d a
    # cost is taken for chance (drawn nearly to 1), from twice d it is believed nearly whole
    info = 50.0
    d = timesliced.DOUBT_SIGMAS / math.sqrt(2 * info)
    for part_of_d, kept_low, kept_high in ((0.5, 0.0, 0.07), (1.0, 0.49, 0.51),
                                           (2.0, 0.93, 0.95), (4.0, 0.99, 1.0)):
        x = sign * part_of_d * d
        kept = math.log(timesliced._believed(x, info)) / x
        assert kept_low <= kept <= kept_high, (part_of_d, kept)
    assert timesliced._believed(0.0, info) == 1.0
    assert timesliced._believed(sign * 0.3, 1e12) == pytest.approx(math.exp(sign * 0.3))


def _alone(split: TimeSlicedSplit, alloc_id: str, busy: float, tokens: int, batches: int,
           others: tuple[str, ...] = ()) -> None:
    """`batches` of 0.1 s in which `alloc_id` alone spent `tokens` and was given every period
    (`others` listed, spending nothing)."""
    for _ in range(batches):
        split.share([[alloc_id]], busy, {alloc_id: tokens, **dict.fromkeys(others, 0)}, 0.1)


def test_use_counted_beyond_the_work_is_not_charged_once_each_was_measured_alone():
    # as measured on an H200: each alone read its own work (20 %); together, sparse launches
    # kept the GPU counted 99 % busy while they did 40 %
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 20.0, 1000, 10, others=("a",))
    got = {}
    for n in range(20):
        got = split.share([["a" if n % 2 else "b"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    # (each read 20: at 20 to 21 %, NVML truncating, so taken at 20.5)
    work = 2 * (20 + timesliced.TRUNCATED)
    assert sum(got.values()) == pytest.approx(timesliced.ALONE_MARGIN * work, rel=0.02)
    assert got["a"] == pytest.approx(got["b"], rel=0.1)
    assert split.beyond_work == pytest.approx((99.0, work), rel=0.02)
    assert split.uncharged == pytest.approx(99.0 - timesliced.ALONE_MARGIN * work, rel=0.02)
    # the tick's length counts: the same tokens over twice the time are half the work
    got = split.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.2)
    assert sum(got.values()) == pytest.approx(timesliced.ALONE_MARGIN * work / 2, rel=0.02)
    # a batch whose use the tokens explain is not bounded: nothing is said of it
    split.share([["a"]], 40.0, {"a": 1000, "b": 1000}, 0.1)
    assert split.beyond_work == () and split.uncharged == 0.0


def test_one_figure_sets_the_scale_and_the_periods_costs_the_rest():
    # a was seen alone (20 % for 1000 tokens a tick), b never: b's tokens count at what the
    # periods say its cost is against a's (equal here, as b's periods follow its tokens)
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    got = {}
    for n in range(20):
        got = split.share([["a" if n % 2 else "b"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(got.values()) == pytest.approx(timesliced.ALONE_MARGIN * 40, rel=0.05)
    assert got["a"] == pytest.approx(got["b"], rel=0.15)
    # b's periods show its tokens buying three times a's: b counts three times as much
    rng, split = random.Random(3), TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    for _ in range(300):
        spent = {"a": 1000, "b": 1000}
        owner, _ = _drawn(rng, spent, {"a": 1.0, "b": 3.0})
        got = split.share([[owner]], 99.0, spent, 0.1)
    assert got["b"] / got["a"] == pytest.approx(3, rel=0.3)
    assert got["a"] == pytest.approx(timesliced.ALONE_MARGIN * 20, rel=0.15)


def test_without_a_figure_or_the_ticks_length_the_whole_use_is_shared_out():
    split = TimeSlicedSplit()
    got = split.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(got.values()) == pytest.approx(99.0)
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 20.0, 1000, 10, others=("a",))
    assert sum(split.share([["a"]], 99.0, {"a": 1000, "b": 1000}).values()) == pytest.approx(99)


def test_use_the_tokens_explain_is_shared_out_whole():
    # a GPU whose use is all work: the figures bound nothing
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 30.0, 1000, 10, others=("a",))
    got = split.share([["b"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(got.values()) == pytest.approx(50.0)
    assert split.beyond_work == () and not split.counts_beyond


@pytest.mark.parametrize("excess", [1.01, 1.035, 1.08])
def test_a_gpu_is_said_to_count_beyond_the_work_only_well_past_the_bound(excess):
    # the figures explain 2 x 20.5 (read 20, truncated); a use a little above that is bounded
    # (a figure may be a little light) but says nothing of how the GPU counts
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 20.0, 1000, 10, others=("a",))
    work = 2 * (20 + timesliced.TRUNCATED)
    got = split.share([["a"], ["b"]], excess * work, {"a": 1000, "b": 1000}, 0.1)
    bounded = excess > timesliced.ALONE_MARGIN
    assert sum(got.values()) == pytest.approx(min(excess, timesliced.ALONE_MARGIN) * work)
    assert bool(split.beyond_work) == bounded
    assert split.counts_beyond == (excess > timesliced.BEYOND_SEEN)
    assert timesliced.ALONE_MARGIN < timesliced.BEYOND_SEEN


@pytest.mark.parametrize("why", ["unsteady", "shared period", "too few", "read at 0"])
def test_a_figure_needs_steady_batches_alone(why):
    split = TimeSlicedSplit()
    _alone(split, "b", 20.0, 1000, 10, others=("a",))
    if why == "unsteady":  # its spending moved by half every batch
        for n in range(6):
            split.share([["a"]], 20.0, {"a": 1000 if n % 2 else 1500, "b": 0}, 0.1)
    elif why == "shared period":  # b's process was given periods while it spent nothing
        for n in range(6):
            split.share([["a"], ["b"] if n % 2 else ["a"]], 20.0, {"a": 1000, "b": 0}, 0.1)
    elif why == "read at 0":  # alone, but read at no use: no figure (and no log of 0)
        _alone(split, "a", 0.0, 1000, 10, others=("b",))
    else:  # b's periods ended ALONE_QUIET periods ago: then a needs ALONE_READINGS alone
        _alone(split, "a", 20.0, 1000,
               timesliced.ALONE_QUIET + timesliced.ALONE_READINGS - 1, others=("b",))
    trusted = timesliced.ALONE_READINGS
    assert split.alone.get("a", (0.0, 0.0, 0, 0))[2] < trusted
    if why == "too few":  # one more, and it is trusted
        _alone(split, "a", 20.0, 1000, 1, others=("b",))
        assert split.alone["a"][2] >= trusted
        assert split.alone["a"][0] == pytest.approx((20.0 + timesliced.TRUNCATED) / 10_000)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_container_whose_tokens_came_to_buy_more_is_charged_what_its_periods_show(seed):
    # each did 10 % alone; a's tokens came to buy four times the SM time they did then, and
    # the GPU is counted 99 % busy for the 50 % of work: the figures disagree with the
    # periods, so b's sets the scale and a is charged what its cost says (as once, the bound
    # dropped, b would be charged twice its work and a eight times)
    rng, split = random.Random(seed), TimeSlicedSplit()
    _alone(split, "a", 10.0, 1000, 10, others=("b",))
    _alone(split, "b", 10.0, 1000, 10, others=("a",))
    cost = {"a": 4.0, "b": 1.0}
    charged = []
    for _ in range(1000):
        spent = {"a": rng.randint(950, 1050), "b": rng.randint(950, 1050)}
        owner, _ = _drawn(rng, spent, cost)
        charged.append(split.share([[owner]], 99.0, spent, 0.1))
    assert sum(got["b"] for got in charged[-200:]) / 200 == pytest.approx(10.5, abs=2)
    assert 30 < sum(got["a"] for got in charged[-200:]) / 200 < 50


def _charged_together(figures: dict[str, float], seed: int = 1) -> dict[str, float]:
    """Each container measured alone at its reading (percent for 1000 tokens a tick), then all
    spending about 1000 together, their kernels alike (equal costs) on a GPU counted 99 % busy:
    each one's mean charge over the last 200 of 600 batches."""
    rng, split = random.Random(seed), TimeSlicedSplit()
    for name, reading in figures.items():
        _alone(split, name, reading, 1000, 10, others=tuple(n for n in figures if n != name))
    charged = []
    for _ in range(600):
        spent = {name: rng.randint(950, 1050) for name in figures}
        owner, _ = _drawn(rng, spent, dict.fromkeys(figures, 1.0))
        charged.append(split.share([[owner]], 99.0, spent, 0.1))
    return {name: sum(got[name] for got in charged[-200:]) / 200 for name in figures}


@pytest.mark.parametrize("odd", [40.0, 2.5])
@pytest.mark.parametrize("seed", [1, 2])
def test_one_odd_figure_among_three_sets_nobodys_charge(odd, seed):
    # c read 40 % (or 2.5 %) alone for the tokens with which a and b read 10 %: its kernels
    # were heavier (lighter) while it was alone than together, where the three cost alike.
    # The figures disagree with the periods, and the scale is the median's, a's and b's: a and
    # b are charged their work (with the largest, c's heavy figure charged them 33 each); c
    # its work where light, and where heavy at least what its tokens bought alone.
    charged = _charged_together({"a": 10.0, "b": 10.0, "c": odd}, seed)
    work = timesliced.ALONE_MARGIN * (10 + timesliced.TRUNCATED)
    own = timesliced.ALONE_MARGIN * (max(10.0, odd) + timesliced.TRUNCATED)
    assert charged == pytest.approx({"a": work, "b": work, "c": own}, abs=1.5)


def test_a_figure_left_out_of_the_scale_is_told_once_while_its_container_stays():
    split, names, rng = TimeSlicedSplit(), ("a", "b", "c"), random.Random(1)

    def together(batches: int) -> tuple[list[set[str]], list[str]]:
        left_out, told = [], []
        for _ in range(batches):
            spent = {name: rng.randint(950, 1050) for name in names}
            owner, _ = _drawn(rng, spent, dict.fromkeys(names, 1.0))
            split.share([[owner]], 99.0, spent, 0.1)
            left_out.append(set(split.left_out))
            told.extend(split.newly_left_out)
        return left_out, told

    for name, reading in zip(names, (10.0, 10.0, 40.0), strict=True):
        _alone(split, name, reading, 1000, 10, others=tuple(n for n in names if n != name))
    left_out, told = together(300)
    # left out whenever the costs know enough to tell a four-fold figure from chance (not at
    # first, nor while chance lets it agree with them), and told the first time only
    assert all(out == {"c"} for out in left_out[-100:]) and told == ["c"]
    # gone, then back (a container of the same name later is another): told again
    split.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert split.left_out == set() and "c" not in split.told_left_out
    _alone(split, "c", 40.0, 1000, 10, others=("a", "b"))
    _, told = together(300)
    assert told == ["c"]


def test_of_two_disagreeing_figures_the_larger_sets_the_scale():
    # nothing tells which of two is odd: the larger is kept, so that a figure taken light
    # lowers nobody's charge, and one taken heavy raises its own as much as its neighbour's
    light = _charged_together({"a": 10.0, "c": 2.5})
    work = timesliced.ALONE_MARGIN * (10 + timesliced.TRUNCATED)
    assert light == pytest.approx({"a": work, "c": work}, abs=1.5)
    heavy = _charged_together({"a": 10.0, "c": 40.0})
    assert heavy["a"] > 3 * work and heavy["a"] == pytest.approx(heavy["c"], rel=0.15)


def test_the_scale_leaves_out_only_figures_far_heavier_than_a_majority_agreeing():
    agree = timesliced.ALONE_AGREE

    def counted(*scales: float, info: float = 1e12) -> str:
        # each figure over its cost, the costs known as well as `info` periods tell them
        names = "abcd"[:len(scales)]
        return "".join(sorted(timesliced._counted_in_scale(
            {name: (math.log(scale), info) for name, scale in zip(names, scales, strict=True)})))

    assert counted(3.0) == "a"
    assert counted(5.0, 1.0) == "ab"  # of two, both: the larger sets the scale
    assert counted(2.0, 9.0, 2.1) == "ac"  # 9 left out
    assert counted(1.0, 2.0 * agree, 2.0) == "abc"  # all within, or below
    # 2 and 2.5+ do not agree, nor 1 with either: no majority, none left out
    assert counted(1.0, 2.0 * agree * 1.01, 2.0) == "abc"
    assert counted(2.0, 2.1, 2.2, 9.0) == "abc"  # three of four agree
    assert counted(0.5, 2.0, 9.0, 9.5) == "abcd"  # two of four are no majority
    # costs learned on few periods may be far apart by chance: what agrees widens with them
    # (two sigmas of the difference of two log costs, each scattering by 1 / sqrt(2 info))
    assert counted(1.0, 1.6, 9.0, info=1000) == "abc"
    assert counted(1.0, 1.6, 9.0, info=10) == "ab"
    assert counted(1.0, 1.6, 3.0, info=10) == "abc"  # 3 is within chance of 1.6 there


def test_a_doubts_raise_does_not_break_the_majority_that_leaves_a_heavy_figure_out():
    # c's figure is four times heavy; b's is in doubt, raised twofold by its periods: as
    # measured, a and b agree and c is left out, and the scale is b's raised one
    split = TimeSlicedSplit()
    names = ("a", "b", "c")
    for name, reading in zip(names, (10.0, 10.0, 40.0), strict=True):
        _alone(split, name, reading, 1000, 10, others=tuple(n for n in names if n != name))
    split.costs = dict.fromkeys(names, (0.0, 100.0))  # their kernels alike, as periods show
    # b's cost against the others' was log 2 lower before its periods showed a change
    split.doubted["b"] = (-math.log(2.0), 0.0, frozenset({"a", "c"}))
    _, weights, floored = split._explained({"a": 1000, "b": 1000, "c": 1000}, 0.1)
    assert floored == {"a", "b", "c"}  # (a raise floors every one; c is left out as well)
    work = 10 + timesliced.TRUNCATED
    assert weights == pytest.approx(dict.fromkeys(names, 2.0 * work), rel=0.01)
    # judged on the raised figures, no majority would agree, and c's would set everyone's
    raised = {"a": 0.0, "b": math.log(2.0), "c": math.log(4.0)}
    assert timesliced._counted_in_scale(
        {name: (log, 100.0) for name, log in raised.items()}) == set(names)


def test_a_figure_lasts_while_its_container_shares_and_leaves_with_it():
    # an hour of batches at five a second beside a container never alone: the figure still
    # bounds the use (dropped by age, both were charged the whole 99 % again)
    rng, split = random.Random(2), TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b", "c"))
    _alone(split, "b", 20.0, 1000, 10, others=("a", "c"))
    split.share([["a"]], 20.0, {"a": 1000}, 0.1)  # b gone
    assert "b" not in split.alone
    got = {}
    for _ in range(18_000):
        spent = {"a": rng.randint(950, 1050), "c": rng.randint(950, 1050)}
        owner, _ = _drawn(rng, spent, {"a": 1.0, "c": 1.0})
        got = split.share([[owner]], 99.0, spent, 0.1)
    assert split.restarts > 0  # the watch's false alarms did not end the figure
    assert "a" in split.alone
    assert sum(got.values()) == pytest.approx(
        timesliced.ALONE_MARGIN * 2 * (20 + timesliced.TRUNCATED), rel=0.06)
    split.share([["c"]], 99.0, {"c": 1000}, 0.1)  # a gone
    assert "a" not in split.alone


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_one_figure_follows_its_containers_rise_against_a_neighbour_never_alone(seed):
    # a did 10 % alone; c joined and was never alone (the GPU counted 99 % busy for 20 % of
    # work); then a's tokens came to buy four times the SM time. Its figure alone would keep
    # charging it 10.5 and c a quarter of that; the rise its periods show raises the figure
    rng, split = random.Random(seed), TimeSlicedSplit()
    _alone(split, "a", 10.0, 1000, 10, others=("c",))
    charged = []
    for n in range(1200):
        cost = {"a": 4.0 if n >= 600 else 1.0, "c": 1.0}
        spent = {"a": rng.randint(950, 1050), "c": rng.randint(950, 1050)}
        owner, _ = _drawn(rng, spent, cost)
        charged.append(split.share([[owner]], 99.0, spent, 0.1))
    before, after = charged[400:600], charged[-200:]
    assert sum(got["a"] for got in before) / 200 == pytest.approx(10.5, abs=2)
    assert sum(got["c"] for got in before) / 200 == pytest.approx(10.5, abs=2)
    assert sum(got["a"] for got in after) / 200 > 30
    # (not a quarter of its work; the rise is judged against chance, so it may overshoot)
    assert 8 < sum(got["c"] for got in after) / 200 < 16
    assert split.restarts > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_costs_remembered_apart_are_each_one_against_all_the_others(seed):
    # six containers, four measured alone; then they share, one of them doubted for a while:
    # each batch's remembered difference and variance are `_apart`'s against the others
    # spending then (the least informed of them, its own information left out)
    rng, split = random.Random(seed), TimeSlicedSplit()
    crowd = ("a", "b", "c", "d", "e", "f")
    for alloc_id in crowd[:4]:
        _alone(split, alloc_id, 10.0, 1000, 10, others=tuple(set(crowd) - {alloc_id}))
    cost = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 1.0, "e": 1.5, "f": 1.0}
    checked = 0
    for n in range(300):
        spent = {a: rng.randint(900, 1100) for a in crowd}
        if n % 7 == 0:
            spent["f"] = 0  # not spending this batch: not among the others
        owner, _ = _drawn(rng, spent, cost)
        if n == 100:
            split.costs["b"] = (split.costs["b"][0], 0.5)  # b the least informed of all
        split.share([[owner]], 99.0, spent, 0.1)
        spending = [a for a, used in spent.items() if used]
        for alloc_id, kept in split.apart.items():
            periods, apart, variance, together = kept[-1]
            if periods != split.periods:
                continue  # doubted meanwhile: nothing kept this batch
            assert together == frozenset(spending)
            assert (apart, variance) == pytest.approx(split._apart(alloc_id, spending),
                                                       rel=1e-12, abs=1e-12)
            checked += 1
    assert checked > 4 * 250
    assert set(split.apart) == {"a", "b", "c", "d"}
    # what a doubt is judged from: the entry of as long ago as is kept beside the same others
    spending = list(crowd)
    before = split._before_change("a", spending)
    first = next(entry for entry in split.apart["a"] if entry[3] == frozenset(crowd))
    assert before == (first[1], first[2], frozenset(crowd) - {"a"})


def _slices_turning_to_b(seed: int) -> tuple[TimeSlicedSplit, list[dict[str, float]]]:
    """a did 20 % alone, b 10 %; together their work stays so, but after 400 periods the time
    slices go to b five times as often as to a (the GPU counted whole, 100 % busy): the split
    and what it charged, period by period."""
    rng, split = random.Random(seed), TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 10.0, 1000, 10, others=("a",))
    charged = []
    for n in range(1400):
        cost = {"a": 2.0, "b": 1.0 if n < 400 else 10.0}
        spent = {"a": rng.randint(950, 1050), "b": rng.randint(950, 1050)}
        owner, _ = _drawn(rng, spent, cost)
        charged.append(split.share([[owner]], 100.0, spent, 0.1))
    return split, charged


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_neighbours_raised_figure_never_charges_a_container_below_its_own(seed):
    # The periods say b's tokens came to buy ten times what they did against a's: b's figure
    # is raised (or a's sets the scale), the weights explain more than the GPU's use, and
    # shared by those weights alone a was charged 11-17 for its 20
    split, charged = _slices_turning_to_b(seed)
    own = timesliced.ALONE_MARGIN * (20 + timesliced.TRUNCATED)
    assert "b" in split.doubted and split.restarts > 0
    for got in charged[200:]:
        # (its tokens drawn from 950-1050 a tick: its figure's work within 5 %)
        assert got["a"] >= 0.95 * own
    after = charged[-500:]
    # b is charged the rise the periods show (the safe side for its own limit) ...
    assert sum(got["b"] for got in after) / 500 > 60
    # ... and nothing is said to be uncharged that was charged after all
    assert split.uncharged >= 0.0
    # with the figures as measured (no doubt, agreeing with the periods) the use is shared
    # by them: a GPU whose use is all work, both a little light, is not charged beyond it
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 10.0, 1000, 10, others=("a",))
    got = split.share([["a"], ["a"], ["b"]], 30.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(got.values()) == pytest.approx(30.0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_neighbours_figure_in_doubt_unraised_never_charges_a_container_below_its_own(seed):
    # a did 20 % alone, b 40 %; after 400 periods b's tokens come to buy a quarter of what
    # they did (the GPU's use all work: 60 %, then 30 %). The periods cannot tell which
    # changed, and a, put in doubt too, is measured afresh in a turn alone (as the controller
    # gives one); b's figure stays in doubt, not raised (its cost fell). Shared by the
    # figures as measured, a was charged 10-15 for its 20 until b was measured again (a
    # strict 60 % neighbour ran at 66-89 % for 18 s, simulated)
    rng, split = random.Random(seed), TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "b", 40.0, 1000, 10, others=("a",))
    own = timesliced.ALONE_MARGIN * (20 + timesliced.TRUNCATED)
    charged = []
    for n in range(1400):
        if "a" in split.doubted:
            split.remeasure("a")
            _alone(split, "a", 20.0, 1000, 6, others=("b",))
            split.end_turn("a")
        cost = {"a": 2.0, "b": 4.0 if n < 400 else 1.0}
        spent = {"a": rng.randint(950, 1050), "b": rng.randint(950, 1050)}
        owner, _ = _drawn(rng, spent, cost)
        got = split.share([[owner]], 60.0 if n < 400 else 30.0, spent, 0.1)
        if "b" in split.doubted and "a" not in split.doubted:
            assert split._figure("b", ["a", "b"]) == split.alone["b"][0]  # not raised
            charged.append(got["a"])
    assert len(charged) > 50
    # (its tokens drawn from 950-1050 a tick: its figure's work within 5 %)
    assert min(charged) >= 0.95 * own
    assert split.uncharged >= 0.0


@pytest.mark.parametrize(("ratio", "apart"), [(1.0, False), (1.5, False), (6.0, True)])
def test_costs_are_said_apart_only_when_far_apart_beyond_chance(ratio, apart):
    rng, split = random.Random(5), TimeSlicedSplit()
    for _ in range(400):
        spent = {"a": 1000, "b": 1000}
        owner, _ = _drawn(rng, spent, {"a": 1.0, "b": ratio})
        split.share([[owner]], 100.0, spent)
    assert split.costs_apart() == apart
    # a container alone has nobody to be apart from
    split.share([["a"]], 50.0, {"a": 1000})
    assert not split.costs_apart()


def test_costs_apart_answers_as_every_pair_compared_would():
    # the pass over the extremes only skips pairs none of which could be apart
    rng = random.Random(11)
    for trial in range(2000):
        split = TimeSlicedSplit()
        n = rng.randint(0, 12)
        split.spending = [f"c{i}" for i in range(n)]
        width = rng.choice([0.05, 0.3, 0.8, 2.0])
        split.costs = {a: (rng.gauss(0.0, width), rng.choice([1.0, 4.0, 30.0, 400.0]))
                       for a in split.spending if rng.random() < 0.9}
        learned = [split.costs[a] for a in split.spending if a in split.costs]
        pairwise = any(
            abs(x - y) > timesliced._LOG_APART
            + timesliced.DOUBT_SIGMAS * math.sqrt(0.5 / i + 0.5 / j)
            for k, (x, i) in enumerate(learned) for y, j in learned[k + 1:])
        assert split.costs_apart() == pairwise, (trial, learned)


def test_without_a_bound_no_container_is_floored_at_its_figure(monkeypatch):
    # the margin infinite (the bound switched off, as `bench_launch_holds`' variant does):
    # the floor stands for what the bound would charge, so there is none either
    monkeypatch.setattr(timesliced, "ALONE_MARGIN", math.inf)
    split, charged = _slices_turning_to_b(0)
    assert "b" in split.doubted
    assert sum(got["a"] for got in charged[-500:]) / 500 < 18
    assert all(sum(got.values()) == pytest.approx(100.0) for got in charged[-500:])


def test_figures_kept_across_a_restart_bound_the_use_at_once():
    before = TimeSlicedSplit()
    _alone(before, "a", 10.0, 1000, 10, others=("b",))
    _alone(before, "b", 10.0, 1000, 10, others=("a",))
    _alone(before, "new", 10.0, 1000, timesliced.ALONE_READINGS - 1, others=("a", "b"))
    kept = before.figures()
    assert kept.keys() == {"a", "b"}  # not one still being made
    read = 10.0 + timesliced.TRUNCATED  # read 10: at 10 to 11 %
    assert kept["a"] == pytest.approx((read / 10_000, 10_000))
    after = TimeSlicedSplit()
    after.adopt(kept | {"gone": (1.0, 1.0), "bad": (0.0, 1.0)})
    got = after.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(got.values()) == pytest.approx(timesliced.ALONE_MARGIN * 2 * read, rel=0.02)
    assert after.alone.keys() == {"a", "b"}  # "gone" left with its container, "bad" refused
    # without them, the whole use is shared out
    fresh = TimeSlicedSplit().share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert sum(fresh.values()) == pytest.approx(99.0)


def test_a_figure_learned_here_is_not_replaced_by_one_adopted():
    split = TimeSlicedSplit()
    _alone(split, "a", 10.0, 1000, 10, others=("b",))
    split.adopt({"a": (5.0, 1.0)})
    assert split.figures()["a"] == pytest.approx(((10.0 + timesliced.TRUNCATED) / 10_000, 10_000))


def test_what_the_tokens_do_not_explain_falls_on_a_container_caught_overclaiming():
    # a did 10 % alone; beside b the GPU reads 99: bounded, both are charged about their
    # explained 10.5, and 78 points are nobody's. With b caught claiming more than its bucket
    # let through, its tokens explain nothing: those points are its, a's charge stays
    split = TimeSlicedSplit()
    _alone(split, "a", 10.0, 1000, 10, others=("b",))
    bounded = split.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert split.uncharged > 70
    split = TimeSlicedSplit()
    _alone(split, "a", 10.0, 1000, 10, others=("b",))
    got = split.share([["a"]], 99.0, {"a": 1000, "b": 1000}, 0.1, untrusted=("b",))
    assert got["a"] == pytest.approx(bounded["a"])
    assert got["a"] + got["b"] == pytest.approx(99.0)
    assert split.uncharged == 0.0


def test_in_a_turn_alone_a_figure_waits_for_fewer_quiet_periods():
    # the controller paused the others: TURN_QUIET periods read since are enough, not
    # ALONE_QUIET; the periods of its first moments (which may predate the pause) teach nothing
    quiet, trusted = timesliced.TURN_QUIET, timesliced.ALONE_READINGS
    assert quiet < timesliced.ALONE_QUIET
    split = TimeSlicedSplit()
    for n in range(6):  # sharing until the turn: b given every other period
        split.share([["a" if n % 2 else "b"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    for _ in range(quiet):
        split.share([["a"]], 20.0, {"a": 1000, "b": 0}, 0.1, solo="a")
    assert "a" not in split.alone
    for _ in range(trusted):
        split.share([["a"]], 20.0, {"a": 1000, "b": 0}, 0.1, solo="a")
    assert split.steady("a") == trusted and split.measured() == {"a"}
    assert split.figures()["a"] == (pytest.approx((20.0 + timesliced.TRUNCATED) / 10000),
                                    pytest.approx(10000))
    # the same batches outside a turn are not enough
    split = TimeSlicedSplit()
    for n in range(6):
        split.share([["a" if n % 2 else "b"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    _alone(split, "a", 20.0, 1000, quiet + trusted, others=("b",))
    assert split.measured() == set() and split.steady("a") < trusted
    # a turn for another container is no turn for this one
    split = TimeSlicedSplit()
    for n in range(6):
        split.share([["a" if n % 2 else "b"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    for _ in range(quiet + trusted):
        split.share([["a"]], 20.0, {"a": 1000, "b": 0}, 0.1, solo="b")
    assert split.measured() == set()


def test_a_turn_counts_the_periods_given_to_others_once_its_pause_is_in_the_samples():
    quiet = timesliced.TURN_QUIET
    split = TimeSlicedSplit()
    for n in range(6):
        split.share([["a" if n % 2 else "b"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    # the turn's first periods may predate the pause: b's there count for nothing
    split.share([["b"]] * quiet, 50.0, {"a": 1000, "b": 500}, 0.1, solo="a")
    assert split.solo_others == 0
    split.share([["a"], ["a"]], 20.0, {"a": 1000, "b": 0}, 0.1, solo="a")
    assert split.solo_others == 0
    # later ones given to b (its shim ignores the pause) or a stranger count, one each
    split.share([["a"], ["b"], [""]], 40.0, {"a": 1000, "b": 0}, 0.1, solo="a")
    assert split.solo_others == 2 and split.solo_ran == {"b", ""}
    # the next turn starts from nothing
    split.share([["b"]], 20.0, {"a": 0, "b": 1000}, 0.1)
    split.share([["b"]] * (quiet + 1), 20.0, {"a": 0, "b": 1000}, 0.1, solo="b")
    assert split.solo_others == 0 and split.solo_ran == set()


def test_use_a_floor_proves_is_charged_out_of_what_nobody_was_charged_first():
    # b writes a thousandth of what it spends into `state`, beyond what costs can correct:
    # the work the tokens explain is mostly a's (measured alone), and the bound charged b's
    # real use to nobody; its floor by the periods, taken out of a's share, had a charged less
    # than its own work
    rng, split = random.Random(5), TimeSlicedSplit()
    _alone(split, "a", 40.0, 1000, 10, others=("b",))
    got = {}
    for _ in range(300):
        spent = {"a": 1000, "b": 1}
        owner, _ = _drawn(rng, spent, {"a": 1.0, "b": 1000.0})
        got = split.share([[owner]], 80.0, spent, 0.1)
    assert got["a"] >= 40.0 * 0.95  # its own work, at its figure
    assert split.lifted > 0  # b's floor came out of what nobody was charged
    assert split.uncharged == pytest.approx(
        80.0 - timesliced.ALONE_MARGIN * split.beyond_work[1] - split.lifted)


def test_a_figure_from_scattered_batches_bounds_with_room_for_its_error():
    # batches alone reading 20 and 12 by turns (sampled noise at a low use): the figure may be
    # off by a fifth, and the bound leaves that much room; exact batches leave none
    exact, noisy = TimeSlicedSplit(), TimeSlicedSplit()
    _alone(exact, "a", 16.0, 1000, 8, others=("b",))
    for n in range(8):
        noisy.share([["a"]], 20.0 if n % 2 else 12.0, {"a": 1000, "b": 0}, 0.1)
    assert exact.spread("a") == 0.0
    assert 0.1 < noisy.spread("a") < 0.3
    for split in (exact, noisy):
        for n in range(20):
            split.share([["a" if n % 2 else "b"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert exact.margin == timesliced.ALONE_MARGIN
    assert noisy.margin == pytest.approx(
        timesliced.ALONE_MARGIN * (1 + timesliced.SPREAD_SIGMAS * noisy.spread("a")))
    assert noisy.uncharged < exact.uncharged  # more of the use charged
    # only a figure that does not scatter is kept across restarts
    assert set(exact.figures()) == {"a"} and noisy.figures() == {}
    # a figure still being made (two scattered batches of b alone, once a's last period is
    # out of the samples: not trusted) leaves the room as the trusted ones set it
    for busy in (20.0,) * timesliced.ALONE_QUIET + (30.0, 10.0):
        exact.share([["b"]], busy, {"a": 0, "b": 1000}, 0.1)
    assert "b" in exact.alone and "b" not in exact.measured() and exact.spread("b") > 0.3
    for n in range(20):
        exact.share([["a" if n % 2 else "b"]], 99.0, {"a": 1000, "b": 1000}, 0.1)
    assert exact.margin == timesliced.ALONE_MARGIN


def test_a_figure_in_doubt_is_dropped_for_a_turn_and_restored_if_none_is_measured():
    split = TimeSlicedSplit()
    split.adopt({"a": (2e-9, 1e9), "b": (3e-9, 1e9)})
    split.doubted["a"] = (0.4, 0.1, frozenset({"b"}))
    assert split.in_doubt() == {"a"} and split.measured() == {"a", "b"}
    kept = split.remeasure("a")
    assert split.measured() == {"b"} and split.in_doubt() == set()  # measured afresh, or not
    split.restore("a", kept)  # the turn ended without a trusted figure: as it was
    assert split.measured() == {"a", "b"} and split.in_doubt() == {"a"}
    assert split.alone["a"] == (2e-9, 1e9, timesliced.ALONE_READINGS)


def _turn(split: TimeSlicedSplit, busy_and_tokens: list[tuple[float, int]]) -> None:
    """A turn alone for "a" (b paused and listed): batches of 0.2 s, their first TURN_QUIET
    periods left out as the pause may not be in them yet."""
    for _ in range(timesliced.TURN_QUIET):
        split.share([["a"]], 50.0, {"a": 1000, "b": 0}, 0.2, solo="a")
    for busy, tokens in busy_and_tokens:
        split.share([["a"]], busy, {"a": tokens, "b": 0}, 0.2, solo="a")


def test_a_turn_whose_spending_steps_after_its_figure_was_trusted_keeps_that_figure():
    # a's figure from before a change of phase (four times heavier than now); the turn
    # measures the new one (three steady batches: trusted), then its spending steps by a
    # fifth and a figure is being made again when the turn ends
    split = TimeSlicedSplit()
    split.adopt({"a": (4e-3, 5000.0), "b": (1e-3, 5000.0)})
    kept = split.remeasure("a")
    _turn(split, [(5.0, 1000)] * timesliced.ALONE_READINGS)
    fresh = split.alone["a"]
    assert split.steady("a") == timesliced.ALONE_READINGS
    assert fresh[0] == pytest.approx((5.0 + timesliced.TRUNCATED) / 5000.0)
    split.share([["a"]], 4.0, {"a": 800, "b": 0}, 0.2, solo="a")
    assert split.steady("a") == 1  # the new one in the making
    split.restore("a", kept)
    assert split.alone["a"] == fresh  # the turn's, not the one from before it
    assert split.trusted_figures()["a"] == pytest.approx(fresh[0])
    assert "a" not in split.remade


def test_a_first_turn_that_trusted_a_figure_ends_with_it_though_another_was_being_made():
    # no figure before (a first turn: nothing to restore), so the controller is told the
    # turn is over, and then asks whether it gave a figure
    split = TimeSlicedSplit()
    _turn(split, [(5.0, 1000)] * timesliced.ALONE_READINGS)
    fresh = split.alone["a"]
    split.share([["a"]], 4.0, {"a": 800, "b": 0}, 0.2, solo="a")
    assert "a" not in split.measured()
    split.end_turn("a")
    assert "a" in split.measured() and split.alone["a"] == fresh
    split.end_turn("a")  # once is enough
    assert split.alone["a"] == fresh


def test_a_figure_remade_while_alone_is_kept_when_a_neighbour_comes_first():
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    trusted = split.alone["a"]
    assert trusted[2] >= timesliced.ALONE_READINGS
    # its spending grows by half (its rate raised): a figure in the making in its place...
    _alone(split, "a", 30.0, 1500, 1, others=("b",))
    assert split.steady("a") == 1 and "a" not in split.trusted_figures()
    # ... and b starts before it is finished: a keeps the figure it had
    split.share([["a"], ["b"]], 99.0, {"a": 1500, "b": 1000}, 0.1)
    assert split.alone["a"] == trusted
    assert split.trusted_figures()["a"] == pytest.approx(trusted[0])
    # finished, the new one replaces it and nothing is kept for it
    _alone(split, "a", 30.0, 1500, timesliced.ALONE_QUIET + timesliced.ALONE_READINGS,
           others=("b",))
    assert split.steady("a") >= timesliced.ALONE_READINGS and "a" not in split.remade
    # a container with no trusted figure before loses its figure in the making, as before
    _alone(split, "c", 20.0, 1000, 1, others=("a", "b"))
    split.share([["c"], ["a"]], 99.0, {"a": 1500, "b": 0, "c": 1000}, 0.1)
    assert "c" not in split.alone


def test_a_figure_kept_while_remade_is_the_one_saved():
    # the file keeps the trusted figure while a new one is made in its place (a restart
    # then would otherwise lose it)
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    saved = split.figures()["a"]
    _alone(split, "a", 30.0, 1500, 1, others=("b",))
    assert split.steady("a") == 1
    assert split.figures() == {"a": saved}


def test_a_turn_for_a_figure_being_remade_keeps_the_trusted_one_to_put_back():
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    trusted = split.alone["a"]
    _alone(split, "a", 30.0, 1500, 1, others=("b",))
    kept = split.remeasure("a")
    assert kept[0] == trusted and "a" not in split.alone and "a" not in split.remade
    split.restore("a", kept)  # the turn measured nothing
    assert split.alone["a"] == trusted


def test_a_figure_kept_while_remade_is_forgotten_with_its_container():
    split = TimeSlicedSplit()
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _alone(split, "a", 30.0, 1500, 1, others=("b",))
    assert "a" in split.remade
    split.share([["b"]], 50.0, {"b": 1000}, 0.1)  # a gone
    assert "a" not in split.remade and "a" not in split.alone


def test_trusted_figures_are_those_measured_alone_as_measured_not_as_a_doubt_raised_them():
    split = TimeSlicedSplit()
    split.adopt({"a": (2e-9, 1e9), "b": (3e-9, 1e9)})
    split.alone["c"] = (5e-9, 1e9, timesliced.ALONE_READINGS - 1)  # still being made
    split.doubted["a"] = (-5.0, 0.01, frozenset({"b"}))  # its cost risen far since
    split.costs.update({"a": (0.0, 50.0), "b": (0.0, 50.0)})
    split.spending = ["a", "b"]
    assert split.figures()["a"][0] > 2e-9  # the bound takes it raised
    assert split.trusted_figures() == {"a": 2e-9, "b": 3e-9}


def test_a_figure_measured_afresh_is_not_overwritten_by_the_one_dropped():
    split = TimeSlicedSplit()
    split.adopt({"a": (2e-9, 1e9)})
    split.doubted["a"] = (0.4, 0.1, frozenset({"b"}))
    kept = split.remeasure("a")
    split.alone["a"] = (8e-9, 2e9, timesliced.ALONE_READINGS)  # what the turn measured
    split.restore("a", kept)
    assert split.alone["a"] == (8e-9, 2e9, timesliced.ALONE_READINGS)
    assert split.in_doubt() == set()
    # nothing dropped (a container without a figure): nothing to put back
    split.restore("c", split.remeasure("c"))
    assert "c" not in split.alone


# ---- one read of a time-sliced GPU's samples as the periods it stands for ---------------------

OWNERS = {1: "a", 2: "b"}


def test_a_read_every_period_is_that_period_whole():
    assert read_as_periods({1000: [(1, 99)]}, OWNERS, 1) == ([["a"]], 99.0)


def test_periods_read_together_share_one_use():
    # on the H200, read every 0.4 s beside two processes each period read 99: 50 and 50
    given, busy = read_as_periods({1000: [(1, 50)], 1200: [(2, 49)]}, OWNERS, 2)
    assert busy == 99.0 and sorted(given) == [["a"], ["b"]]
    # read every second: 40 and 60, two periods of five and three
    given, busy = read_as_periods({1000: [(1, 40)], 1200: [(2, 60)]}, OWNERS, 5)
    assert busy == 100.0
    # spread, not in blocks (the change watch judges periods in order), the last one's last
    assert [g[0] for g in given] == ["b", "a", "b", "a", "b"]


def test_one_process_given_every_period_of_a_late_read_stands_for_all_of_them():
    given, busy = read_as_periods({1400: [(1, 66)]}, OWNERS, 2)
    assert given == [["a"], ["a"]] and busy == 66.0


def test_processes_listed_idle_are_given_nothing_and_strangers_are_nobodys():
    given, busy = read_as_periods({1000: [(1, 0), (9, 80)]}, OWNERS, 1)
    assert given == [[""]] and busy == 80.0
    # all listed idle: periods of an idle GPU, given to nobody
    assert read_as_periods({1000: [(1, 0)], 1200: [(2, 0)]}, OWNERS, 3) == ([[], [], []], 0.0)


def test_a_read_never_stands_for_fewer_periods_than_processes_or_more_than_all_use():
    given, busy = read_as_periods({1000: [(1, 70)], 1200: [(2, 60)]}, OWNERS, 1)
    assert sorted(given) == [["a"], ["b"]] and busy == 100.0


_reads = st.dictionaries(
    st.integers(min_value=0, max_value=10_000_000),  # stamps
    st.lists(st.tuples(st.integers(min_value=1, max_value=4), st.integers(0, 100)), min_size=1,
             max_size=3),
    min_size=1, max_size=6)


@hypothesis.given(at=_reads, periods=st.integers(min_value=1, max_value=12))
def test_any_read_stands_for_its_busy_processes_periods_and_their_summed_use(at, periods):
    owners = {1: "a", 2: "b", 3: "a"}  # pid 4 belongs to nobody
    given, busy = read_as_periods(at, owners, periods)
    busy_at = [(stamp, pid, value) for stamp, seen in at.items() for pid, value in seen
               if value > 0]
    values = {pid: [v for _, p, v in busy_at if p == pid] for _, pid, _ in busy_at}
    last = {pid: max(stamp for stamp, p, _ in busy_at if p == pid) for pid in values}
    if not values:  # an idle GPU: periods given to nobody
        assert busy == 0.0
        assert given == [[] for _ in range(max(1, periods, len(at)))]
        return
    means = {pid: sum(v) / len(v) for pid, v in values.items()}
    assert busy == pytest.approx(min(100.0, sum(means.values())))
    assert all(len(g) == 1 for g in given)
    # every busy process is given a period or more, nobody listed only idle is
    assert {g[0] for g in given} == {owners.get(pid, "") for pid in values}
    # about as many periods as passed, never fewer than busy processes
    assert len(given) >= len(values)
    assert abs(len(given) - max(periods, len(values))) <= len(values)
    # the newest process's last period is the read's last
    newest = max(values, key=lambda pid: (last[pid], pid))
    assert given[-1] == [owners.get(newest, "")]


def _alone_at(split: TimeSlicedSplit, reading: float, tokens: int, batches: int = 4) -> None:
    for _ in range(batches):
        split.share([["a"]], reading, {"a": tokens}, dt_s=0.2)


def test_a_figure_read_at_a_few_percent_is_measured_afresh_once_its_spending_grows():
    # on an H200, a turn at 3.5 % of the GPU read 3: a figure 13 % light, and its container,
    # spending nine times as much, ran at 37 % for its 30
    split = TimeSlicedSplit()
    _alone_at(split, 3.0, 1_000)
    assert split.steady("a") >= 3 and split.coarse() == set()
    split.share([["a"], ["b"]], 99.0, {"a": 2_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == set()  # twice the spending: not yet
    split.share([["a"], ["b"]], 99.0, {"a": 3_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == {"a"}
    split.remeasure("a")  # the turn measures it afresh: once
    _alone_at(split, 3.0, 1_000)
    split.share([["a"], ["b"]], 99.0, {"a": 9_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == set()
    # gone and back, it is a new container
    split.share([["b"]], 99.0, {"b": 5_000}, dt_s=0.2)
    _alone_at(split, 3.0, 1_000)
    split.share([["a"], ["b"]], 99.0, {"a": 9_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == {"a"}


def test_a_figure_read_well_above_a_few_percent_is_kept_however_the_spending_grows():
    split = TimeSlicedSplit()
    _alone_at(split, 12.0, 1_000)
    split.share([["a"], ["b"]], 99.0, {"a": 9_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == set()


@pytest.mark.parametrize(("below", "coarse"), [(1.0, True), (0.1, True), (0.0, False)])
def test_a_figure_is_taken_at_the_middle_of_its_truncated_percent(below, coarse):
    reading = timesliced.COARSE_READING - below
    # NVML truncates (the H200: 3.8 % read 3): a reading of r was r to r + 1 % of the GPU
    split = TimeSlicedSplit()
    _alone_at(split, reading, 1_000)
    assert split.figures()["a"] == pytest.approx(((reading + 0.5) / 5_000, 5_000))
    # coarse is judged on the reading, not on the half percent added to it
    split.share([["a"], ["b"]], 99.0, {"a": 3_000, "b": 5_000}, dt_s=0.2)
    assert split.coarse() == ({"a"} if coarse else set())



def _shared(split: TimeSlicedSplit, rng: random.Random, periods: int, cost_a: float
            ) -> list[dict[str, float]]:
    """`periods` batches of one period in which a and b spent alike, a's tokens buying
    `cost_a` times b's SM time, on a GPU counted 99 % busy; each batch's split."""
    got = []
    for _ in range(periods):
        spent = {"a": 1000, "b": 1000}
        owner, _ = _drawn(rng, spent, {"a": cost_a, "b": 1.0})
        got.append(split.share([[owner]], 99.0, spent, 0.1))
    return got


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_figures_seen_to_disagree_are_not_believed_when_a_change_cuts_the_costs_information(seed):
    # a played light while alone (its kernels a quarter of their time together): together,
    # the periods show its tokens buying what b's do, and the figures are not believed
    rng, split = random.Random(seed), TimeSlicedSplit()
    _alone(split, "a", 5.0, 1000, 10, others=("b",))
    _alone(split, "b", 20.0, 1000, 10, others=("a",))
    got = _shared(split, rng, 300, 1.0)[-1]
    assert got["a"] == pytest.approx(got["b"], rel=0.35)
    together = frozenset({"a", "b"})
    then, _, _ = split.disagreed[together]
    assert then > 20
    # a change found: the costs' information cut, where chance would let the figures agree
    # (the figures 1.32 apart in logs, the costs near 0, allowed 1.49 at that information),
    # and a measured afresh, playing light again
    for alloc_id, (log_cost, _) in split.costs.items():
        split.costs[alloc_id] = (log_cost, timesliced.RESTART_INFO)
    assert abs(math.log(5.5 / 20.5)) < math.log(timesliced.ALONE_AGREE) \
        + timesliced.DOUBT_SIGMAS * math.sqrt(2 / timesliced.RESTART_INFO)
    split.remeasure("a")
    _alone(split, "a", 5.0, 1000, 10, others=("b",))
    held = []
    for _ in range(60):
        (got,) = _shared(split, rng, 1, 1.0)
        assert together in split.disagreed  # charged by its periods, not at 27 % of b's
        held.append(got["a"] / got["b"])
    assert sum(held) / len(held) > 0.6
    # measured afresh honestly, its figure moved: believed at once
    split.remeasure("a")
    _alone(split, "a", 20.0, 1000, 10, others=("b",))
    _shared(split, rng, 1, 1.0)
    assert together not in split.disagreed


def test_a_disagreement_is_forgotten_once_costs_are_as_informed_as_then():
    split = TimeSlicedSplit()
    figures = {"a": 1.0, "b": 2.0}
    split.alone.update({a: (f, 1e9, timesliced.ALONE_READINGS) for a, f in figures.items()})
    split.costs.update({"a": (-0.35, 10.0), "b": (0.35, 10.0)})  # agreeing, little known
    split.periods = 1000
    split.disagreed[frozenset(figures)] = (60.0, 1000, dict(figures))
    assert not split._figures_agree(figures)
    # the information then fades as the costs' own does: 60 -> 10 over 537 periods
    split.periods += 530
    assert not split._figures_agree(figures)
    split.periods += 10
    assert split._figures_agree(figures) and not split.disagreed
    # a figure moved by more than ALONE_AGREE since the disagreement (measured afresh)
    split.disagreed[frozenset(figures)] = (60.0, split.periods, {"a": 1.0, "b": 1.0})
    assert split._figures_agree(figures)
    # ... not one a doubt raised (moved as the bound takes it, not as measured alone)
    split.disagreed[frozenset(figures)] = (60.0, split.periods, {"a": 1.1, "b": 1.9})
    assert not split._figures_agree({"a": 1.0, "b": 2.0 * 2.5})
    assert not split._figures_agree(figures)
    split.costs["a"] = (-1.5, 80.0)
    split.costs["b"] = (1.5, 80.0)
    assert not split._figures_agree(figures)
    assert split.disagreed[frozenset(figures)][0] == 80.0


def test_a_disagreement_is_forgotten_with_its_containers():
    split = TimeSlicedSplit()
    split.disagreed[frozenset({"a", "b"})] = (70.0, 0, {"a": 1.0, "b": 1.0})
    split.disagreed[frozenset({"a", "c"})] = (70.0, 0, {"a": 1.0, "c": 1.0})
    split.share([["a"]], 50.0, {"a": 1000, "c": 1000}, 0.1)  # b gone
    assert list(split.disagreed) == [frozenset({"a", "c"})]


# ---- a figure long at odds with the periods, measured afresh (`stale`) ----------------------


def _stale_after(split: TimeSlicedSplit, rng: random.Random, batches: int,
                 cost: dict[str, float]) -> list[set[str]]:
    """`batches` of one period in which every container spent about 1000 tokens, theirs buying
    `cost` SM time each, on a GPU counted 99 % busy: what `stale` said after each."""
    said = []
    for _ in range(batches):
        spent = {name: rng.randint(950, 1050) for name in cost}
        owner, _ = _drawn(rng, spent, cost)
        split.share([[owner]], 99.0, spent, 0.1)
        said.append(split.stale())
    return said


def _measured(readings: dict[str, float]) -> TimeSlicedSplit:
    """A split whose containers were each measured alone at their reading for 1000 tokens."""
    split = TimeSlicedSplit()
    for name, reading in readings.items():
        _alone(split, name, reading, 1000, 10, others=tuple(n for n in readings if n != name))
    return split


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_figure_long_at_odds_with_the_periods_is_measured_afresh_once(seed):
    # a and b read 10 % alone; together a's tokens buy a quarter of b's SM time (a change of
    # phase, lighter): a's figure over its cost is the heaviest, and once the costs know it
    # beyond chance for STALE_PERIODS it is asked to be measured afresh; b never is
    rng, split = random.Random(seed), _measured({"a": 10.0, "b": 10.0})
    said = _stale_after(split, rng, 600, {"a": 0.25, "b": 1.0})
    first = next(n for n, stale in enumerate(said) if stale)
    assert first >= timesliced.STALE_PERIODS and said[first] == {"a"}
    assert all(stale in (set(), {"a"}) for stale in said)
    # measured afresh, its figure the same (it plays heavy alone; or the periods read it
    # apart): not asked again while the figure stands, however long they disagree
    kept = split.remeasure("a")
    assert split.stale() == set() and split.questioned == {"a": kept[0][0]}
    _alone(split, "a", 10.0, 1000, 10, others=("b",))
    assert not any(_stale_after(split, rng, 600, {"a": 0.25, "b": 1.0}))
    # ... measured afresh as it is now, it agrees, and nothing is asked either
    split = _measured({"a": 10.0, "b": 10.0})
    _stale_after(split, rng, 600, {"a": 0.25, "b": 1.0})
    split.remeasure("a")
    _alone(split, "a", 2.5, 1000, 10, others=("b",))
    assert not any(_stale_after(split, rng, 600, {"a": 0.25, "b": 1.0}))


def test_a_questioned_figure_that_moved_may_be_asked_again():
    rng, split = random.Random(3), _measured({"a": 10.0, "b": 10.0})
    _stale_after(split, rng, 600, {"a": 0.25, "b": 1.0})
    split.remeasure("a")
    _alone(split, "a", 10.0, 1000, 10, others=("b",))  # the same: not asked again
    _alone(split, "a", 40.0, 1000, 10, others=("b",))  # ... moved four-fold since
    assert {"a"} in _stale_after(split, rng, 600, {"a": 0.25, "b": 1.0})
    # gone and back: forgotten with its container
    split.share([["b"]], 50.0, {"b": 1000}, 0.1)
    assert "a" not in split.questioned


@pytest.mark.parametrize("seed", [0, 1])
def test_a_heaviest_figure_another_agrees_with_is_not_asked(seed):
    # c read 2.5 % alone (it plays light) beside a and b at 10 %, all alike together: the
    # heaviest over its cost is a or b, corroborated by the other; c sets nobody's scale
    rng = random.Random(seed)
    split = _measured({"a": 10.0, "b": 10.0, "c": 2.5})
    assert not any(_stale_after(split, rng, 600, dict.fromkeys("abc", 1.0)))
    # c read 40 % (heavy): nobody agrees with it, and it is asked
    split = _measured({"a": 10.0, "b": 10.0, "c": 40.0})
    said = _stale_after(split, rng, 600, dict.fromkeys("abc", 1.0))
    assert {"c"} in said and all(stale in (set(), {"c"}) for stale in said)


def test_figures_agreeing_count_against_a_disagreement_and_little_known_costs_for_none():
    split = _measured({"a": 10.0, "b": 10.0})
    split.costs = {"a": (-1.0, 100.0), "b": (1.0, 100.0)}  # a's figure far over its cost
    stale = timesliced.STALE_PERIODS
    split._track_disagreement(split._scales("ab"), stale - 5)
    split.costs = {"a": (0.0, 100.0), "b": (0.0, 100.0)}  # agreeing for a while
    split._track_disagreement(split._scales("ab"), stale // 2)
    split.costs = {"a": (-1.0, 100.0), "b": (1.0, 100.0)}
    split._track_disagreement(split._scales("ab"), stale // 2)
    assert split.disagreeing == ("a", stale - 5) and split.stale() == set()
    split._track_disagreement(split._scales("ab"), 5)
    assert split.stale() == {"a"}
    # costs cut by a change know little: however far apart, no evidence yet
    split = _measured({"a": 10.0, "b": 10.0})
    split.costs = {"a": (-2.0, timesliced.CONFIRM_INFO - 1), "b": (2.0, 100.0)}
    split._track_disagreement(split._scales("ab"), 10 * stale)
    assert split.stale() == set()
    # nor with a container spending that has no figure (its first turn comes first)
    split._track_disagreement({}, 10 * stale)
    assert split.disagreeing == ("", 0)


def test_a_figures_age_counts_periods_since_it_was_last_measured_alone():
    rng, split = random.Random(4), _measured({"a": 10.0, "b": 10.0})
    # a measured in its ten batches alone, then b in its own
    assert split.aged(11) == set() and split.aged(10) == {"a"} and split.aged(0) == {"a", "b"}
    _stale_after(split, rng, 100, {"a": 1.0, "b": 1.0})
    assert split.aged(100) == {"a", "b"} and split.aged(101) == {"a"}
    # steady batches alone (once b's last periods are out of the samples) measure it again:
    # its age starts over
    _alone(split, "a", 10.0, 1000, timesliced.ALONE_QUIET + 1, others=("b",))
    assert split.aged(100) == {"b"} and split.aged(1) == {"b"} and "a" in split.aged(0)
    # a figure adopted after a restart is as old as the periods since
    split.adopt({"c": (1e-8, 1e3)})
    _stale_after(split, rng, 5, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert "c" in split.aged(5) and "c" not in split.aged(6)
    # one still being made has no age; a container gone is forgotten
    split.alone["c"] = (1e-8, 1e3, timesliced.ALONE_READINGS - 1)
    assert "c" not in split.aged(0)
    split.share([["a"]], 50.0, {"a": 1000, "b": 1000}, 0.1)
    assert "c" not in split.measured_at


def _lumpy_turn(per_launch: dict[str, float] | None, launches: list[int],
                tokens_each: int = 262_144) -> TimeSlicedSplit:
    """A turn alone for "a" (b paused) whose batches of 0.1 s hold `launches` launches of
    `tokens_each` tokens (its use read at 10 % whatever the batch held: NVML's periods and
    the ticks do not cover the same moments)."""
    split = TimeSlicedSplit()
    for _ in range(timesliced.TURN_QUIET):
        split.share([["a"]], 10.0, {"a": 4 * tokens_each, "b": 0}, 0.1, solo="a",
                    per_launch=per_launch)
    for n in launches:
        split.share([["a"]], 10.0, {"a": n * tokens_each, "b": 0}, 0.1, solo="a",
                    per_launch=per_launch)
    return split


def test_a_spending_that_steps_by_one_launch_of_several_is_steady():
    # a strict rate buys four or five launches of 262,144 tokens a tick, in turn: a quarter
    # apart, never within ALONE_STEADY of the last, and the turn ended without a figure
    alternating = [4, 5, 4, 5, 4, 5]
    assert _lumpy_turn(None, alternating).steady("a") < timesliced.ALONE_READINGS
    split = _lumpy_turn({"a": 262_144.0}, alternating)
    assert split.steady("a") == len(alternating)
    assert "a" in split.measured()
    # the figure: the batches' use over their spending, averaged (between the batches')
    read = 10 + timesliced.TRUNCATED
    assert read / (5 * 2_621_440) < split.alone["a"][0] < read / (4 * 2_621_440)
    # a real step is not one launch: from five to seven, the figure is made afresh
    assert _lumpy_turn({"a": 262_144.0}, [5, 5, 5, 7]).steady("a") == 1


def test_launches_too_big_for_a_batch_do_not_widen_what_counts_as_steady():
    # one or two launches a tick: one launch is half the spending, and batches that far
    # apart say nothing of a steady use per token
    assert _lumpy_turn({"a": 1_048_576.0}, [1, 2, 1, 2, 1, 2],
                       tokens_each=1_048_576).steady("a") == 1
    # a cost per launch not known (0) widens nothing either
    assert _lumpy_turn({"a": 0.0}, [4, 5, 4, 5]).steady("a") == 1


@pytest.mark.parametrize(("rate", "launch_rate", "step"), [
    (100.0, 10.0, 15.0),   # a launch within ALONE_STEADY already
    (100.0, 20.0, 20.0),   # one launch, a fifth of the spending: allowed
    (100.0, 25.0, 25.0),   # ... a quarter: still
    (100.0, 30.0, 15.0),   # ... more: ALONE_STEADY alone
    (100.0, 0.0, 15.0),
])
def test_steady_step(rate, launch_rate, step):
    assert timesliced._steady_step(rate, launch_rate) == pytest.approx(step)

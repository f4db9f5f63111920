"""Sharing a time-sliced GPU's use out among containers (`timesliced.TimeSlicedSplit`): NVML gives
each sample period whole to one process, with the whole GPU's use as its value."""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.timesliced import PERIODS_REMEMBERED, SHARED_PERIODS, TimeSlicedSplit


def test_use_is_split_by_tokens_at_once():
    split = TimeSlicedSplit()
    got = split.share([["a"]], 80.0, {"a": 300, "b": 100})
    # (one period given to b moves its weight a little: it counts as one period in many)
    assert got == pytest.approx({"a": 60.0, "b": 20.0}, abs=1)
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

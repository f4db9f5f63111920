"""Timer slack: far timers land on a shared grid (half seconds, whole seconds from about a
second ahead), never much early, at most one grid step late; near timers are untouched; periodic
tasks stay on their period and come to share wake-ups."""

from __future__ import annotations

import itertools
import math

from hypothesis import assume, given
from hypothesis import strategies as st

from vgpu_agent.timerslack import (
    EARLY_SHARE,
    GRID_S,
    MAX_EARLY_S,
    MIN_DELAY_S,
    WIDE_FROM_S,
    WIDE_GRID_S,
    grid_for,
    slack_deadline,
)

times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@given(now=times, delay=st.floats(min_value=MIN_DELAY_S, max_value=3600.0))
def test_a_far_timer_fires_on_the_grid_within_its_bounds(now, delay):
    when = now + delay
    assume(when - now >= MIN_DELAY_S)  # as the rule sees it, after rounding
    fired = slack_deadline(now, when)
    grid = WIDE_GRID_S if when - now >= WIDE_FROM_S else GRID_S
    assert grid_for(when - now) == grid
    steps = fired / grid
    assert math.isclose(steps, round(steps), abs_tol=1e-6)
    early = min(EARLY_SHARE * (when - now), MAX_EARLY_S)
    assert when - early - 1e-6 <= fired <= when + grid


def test_a_long_wait_ends_at_most_a_tenth_of_a_second_early():
    # a 60.09 s wait from 0.09 s, due at 60.18 s: 5 % early would have let it fire on 58 s
    assert slack_deadline(0.09, 60.18) == 61.0
    assert slack_deadline(0.0, 60.05) == 60.0  # within the cap: onto the grid point before


def test_the_grids_are_nested_so_half_and_whole_seconds_meet():
    assert math.isclose(WIDE_GRID_S / GRID_S, round(WIDE_GRID_S / GRID_S))
    assert MIN_DELAY_S < WIDE_FROM_S <= WIDE_GRID_S


@given(now=times, delay=st.floats(min_value=-10.0, max_value=MIN_DELAY_S, exclude_max=True))
def test_a_near_or_past_timer_is_kept(now, delay):
    when = now + delay
    assume(when - now < MIN_DELAY_S)  # as the rule sees it, after rounding
    assert slack_deadline(now, when) == when


def test_never_and_nan_are_kept():
    assert slack_deadline(5.0, math.inf) == math.inf
    assert math.isnan(slack_deadline(5.0, math.nan))


def wakes(period_s: float, phase_s: float, work_s: float, until_s: float) -> list[float]:
    """When a task that sleeps `period_s` after `work_s` of work wakes under the slack rule."""
    out, now = [], phase_s
    while now < until_s:
        now += work_s
        now = slack_deadline(now, now + period_s)
        out.append(now)
    return out


def test_a_periodic_task_keeps_its_period_and_does_not_drift():
    # a little work before re-arming, up to a slow thread hop of NVML calls (30 ms)
    for period in (0.5, 1.0, 5.0):
        for work_s in (0.0005, 0.005, 0.03 if period >= WIDE_FROM_S else 0.02):
            fired = wakes(period, phase_s=0.137, work_s=work_s, until_s=200.0)
            gaps = {round(b - a, 9) for a, b in itertools.pairwise(fired[1:])}
            assert gaps == {period}, (period, work_s, sorted(gaps)[:5])


def test_a_task_that_works_longer_than_the_allowance_keeps_its_wake_ups_on_the_grid():
    # 100 ms of work before re-arming a 1 s period: late by a step each time, never off-grid
    fired = wakes(1.0, phase_s=0.3, work_s=0.1, until_s=60.0)
    assert all(math.isclose(t, round(t), abs_tol=1e-9) for t in fired)
    assert all(1.0 <= b - a <= 2.0 + 1e-9 for a, b in itertools.pairwise(fired))


def test_tasks_of_any_phase_share_their_wake_ups():
    # the idle agent's periodic tasks: 0.5 s and 1 s periods, each started at its own moment
    tasks = [(0.5, 0.03), (0.5, 0.29), (1.0, 0.11), (1.0, 0.47), (1.0, 0.71), (1.0, 0.93)]
    instants = {round(t, 9) for period, phase in tasks
                for t in wakes(period, phase, 0.001, 60.0) if 10.0 <= t < 60.0}
    # unslacked they would wake 2 x 2 + 4 x 1 = 8 times a second
    assert len(instants) / 50.0 <= 1 / GRID_S


def test_one_second_tasks_of_any_phase_wake_the_process_once_a_second():
    tasks = [(1.0, 0.11), (1.0, 0.47), (1.0, 0.71), (1.0, 0.93), (5.0, 0.2), (60.0, 0.6)]
    instants = {round(t, 9) for period, phase in tasks
                for t in wakes(period, phase, 0.002, 120.0) if 10.0 <= t < 120.0}
    assert len(instants) == 110  # once a second, where each alone would wake once a second too

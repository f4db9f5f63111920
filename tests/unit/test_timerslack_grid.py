"""Timer slack: far timers land on a shared grid, never much early, at most one grid step late;
near timers are untouched; periodic tasks stay on their period and come to share wake-ups."""

from __future__ import annotations

import itertools
import math

from hypothesis import assume, given
from hypothesis import strategies as st

from vgpu_agent.timerslack import EARLY_S, GRID_S, MIN_DELAY_S, slack_deadline

times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@given(now=times, delay=st.floats(min_value=MIN_DELAY_S, max_value=3600.0))
def test_a_far_timer_fires_on_the_grid_within_its_bounds(now, delay):
    when = now + delay
    assume(when - now >= MIN_DELAY_S)  # as the rule sees it, after rounding
    fired = slack_deadline(now, when)
    steps = fired / GRID_S
    assert math.isclose(steps, round(steps), abs_tol=1e-6)
    assert when - EARLY_S - 1e-6 <= fired <= when + GRID_S


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
    for period in (0.5, 1.0, 5.0):
        fired = wakes(period, phase_s=0.137, work_s=EARLY_S / 4, until_s=200.0)
        gaps = {round(b - a, 9) for a, b in itertools.pairwise(fired[1:])}
        assert gaps == {period}, (period, sorted(gaps)[:5])


def test_tasks_of_any_phase_share_their_wake_ups():
    # the idle agent's periodic tasks: 0.5 s and 1 s periods, each started at its own moment
    tasks = [(0.5, 0.03), (0.5, 0.29), (1.0, 0.11), (1.0, 0.47), (1.0, 0.71), (1.0, 0.93)]
    instants = {round(t, 9) for period, phase in tasks
                for t in wakes(period, phase, 0.001, 60.0) if 10.0 <= t < 60.0}
    # unslacked they would wake 2 x 2 + 4 x 1 = 8 times a second
    assert len(instants) / 50.0 <= 1 / GRID_S

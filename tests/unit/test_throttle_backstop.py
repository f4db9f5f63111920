"""The backstop's judgement: limits plus documented allowances, one report per episode."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_agent.throttle.backstop import Backstop, BackstopParams

MIB = 1 << 20
KEY = ("alloc", 0)


def test_memory_beyond_the_limit_and_each_processes_context_is_a_breach_reported_once():
    b = Backstop(BackstopParams(context_bytes=500 * MIB))
    assert b.memory(KEY, 4_500 * MIB, 1, 4_000 * MIB) is None  # within limit + one context
    breach = b.memory(KEY, 4_501 * MIB, 1, 4_000 * MIB)
    assert breach is not None and breach.kind == "memory"
    assert breach.allowed == 4_500 * MIB and "4501 MiB" in breach.describe()
    assert b.memory(KEY, 9_000 * MIB, 1, 4_000 * MIB) is None  # the same episode
    assert b.memory(KEY, 1_000 * MIB, 1, 4_000 * MIB) is None  # cleared
    assert b.memory(KEY, 9_000 * MIB, 1, 4_000 * MIB) is not None  # a new episode
    assert b.memory(("other", 0), 80_000 * MIB, 3, 0) is None  # no limit, no breach


def test_sm_share_is_judged_on_a_covered_window_for_strict_containers_only():
    b = Backstop(BackstopParams(window_s=10, sm_margin_pct=5))
    for t in range(7):  # 6 s of 80%: not yet most of the window
        assert b.sm(KEY, float(t), 80.0, 30.0, strict=True) is None
    breach = None
    for t in range(7, 12):
        breach = breach or b.sm(KEY, float(t), 80.0, 30.0, strict=True)
    assert breach is not None and breach.kind == "sm" and breach.allowed == 35.0
    assert breach.measured == pytest.approx(80.0)
    lent = Backstop(BackstopParams(window_s=10))
    for t in range(20):  # work-conserving: running on capacity nobody uses is allowed
        assert lent.sm(KEY, float(t), 95.0, 30.0, strict=False) is None


def test_a_short_burst_inside_the_window_is_no_breach():
    b = Backstop(BackstopParams(window_s=10, sm_margin_pct=15))
    results = [b.sm(KEY, float(t), 100.0 if t % 10 == 0 else 30.0, 30.0, strict=True)
               for t in range(40)]
    assert results == [None] * 40


def test_forgetting_a_container_ends_its_episodes():
    b = Backstop(BackstopParams(context_bytes=0))
    assert b.memory(KEY, 2, 1, 1) is not None
    b.forget_except([])
    assert b.memory(KEY, 2, 1, 1) is not None


@pytest.mark.parametrize("kwargs,named", [
    ({"window_s": 0}, "window"), ({"window_s": float("nan")}, "window"),
    ({"sm_margin_pct": -1}, "SM margin"), ({"context_bytes": -1}, "context allowance"),
    ({"min_coverage": 0}, "coverage"),
])
def test_bad_parameters_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        BackstopParams(**kwargs)


@given(
    steps=st.lists(
        st.tuples(st.floats(min_value=0.01, max_value=3.0),
                  st.one_of(st.none(), st.floats(min_value=-5.0, max_value=120.0))),
        min_size=1, max_size=200,
    )
)
def test_the_kept_sum_judges_as_the_whole_window_would(steps):
    """The window's sum is kept as samples come and go; the mean it judges is the window's."""
    params = BackstopParams(window_s=10.0, sm_margin_pct=0.0, min_coverage=0.5)
    kept = Backstop(params)
    now, window = 0.0, []
    for gap, util in steps:
        now += gap
        breach = kept.sm(("a", 0), now, util, 50.0, strict=True)
        if util is not None:
            window.append((now, min(100.0, max(0.0, util))))
        window = [(t, u) for t, u in window if t >= now - params.window_s]
        if breach is not None:
            exact = math.fsum(u for _, u in window) / len(window)
            assert breach.measured == pytest.approx(exact, rel=1e-9, abs=1e-9)
        if window and now - window[0][0] >= params.window_s * params.min_coverage:
            mean = kept._sm[("a", 0)].mean()
            assert mean == pytest.approx(math.fsum(u for _, u in window) / len(window),
                                         rel=1e-9, abs=1e-9)

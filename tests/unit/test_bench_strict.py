"""`bench_strict`'s judgement of a strict container's share series (the figures it prints)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_strict.py"
    spec = importlib.util.spec_from_file_location("bench_strict_under_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _series(shares: dict[float, float], end_s: float, base: float) -> list[tuple[float, float]]:
    """Windows ending every 0.05 s (finer than the bench reads), `base` but where named."""
    steps = round(end_s / 0.05)
    return [(round(i * 0.05, 2), shares.get(round(i * 0.05, 2), base))
            for i in range(10, steps + 1)]


def test_the_unthrottled_first_tick_is_not_counted_as_over_the_limit():
    bench = _bench()
    # windows ending before 0.7 s cover the first tick, which runs unthrottled by design
    series = _series({0.5: 40.0, 0.6: 30.0}, 10.0, 5.0)
    peak, over_s, mean = bench.judged(series, 5.0)
    assert (peak, over_s) == (0.0, 0.0)
    assert mean == pytest.approx(5.0)


def test_a_share_over_the_limit_counts_its_peak_and_its_time():
    bench = _bench()
    # 7.5 % for three windows read 0.1 s apart, 5.4 % (within a tenth of 5) for one
    series = _series({2.0: 7.5, 2.1: 7.5, 2.2: 7.5, 2.3: 5.4, 2.05: 9.0}, 10.0, 5.0)
    peak, over_s, _ = bench.judged(series, 5.0)
    # 2.05 is between the bench's 0.1 s readings: not read
    assert peak == pytest.approx(2.5)
    assert over_s == pytest.approx(0.3)


def test_the_settled_mean_starts_five_seconds_in():
    bench = _bench()
    series = _series({t / 10: 1.0 for t in range(7, 55)}, 10.0, 4.0)
    _, _, mean = bench.judged(series, 5.0)
    assert mean == pytest.approx(4.0)  # the windows within 5.5 s are all left out
    short = _series({}, 5.2, 4.0)
    assert math.isnan(bench.judged(short, 5.0)[2])  # nothing settled

"""The bench node's simulated drivers (`tests/bench/bench_scrape.Accounting`): when what a token
buys changes, and how far from its share each container is counted."""

from __future__ import annotations

import itertools

from tests.bench import bench_scrape as node
from tests.bench.bench_scrape import SAMPLE_PERIOD_US, TOKENS_PER_PERCENT, Accounting


def _accounting(tmp_path, containers=4):
    rows = node.build_regions(tmp_path, 1, containers)
    return Accounting(tmp_path / "nvml", rows), rows


def test_steady_tokens_buy_the_same_work_whenever(tmp_path):
    accounting, rows = _accounting(tmp_path)
    uuid = next(iter(accounting.on_gpu))
    assert {accounting.per_percent(uuid, int(row["host_pid"]), stamp)
            for row in rows for stamp in range(0, 60_000_000, 250_000)} == {TOKENS_PER_PERCENT}


def test_each_container_changes_phase_at_its_own_moments_every_interval(tmp_path):
    accounting, rows = _accounting(tmp_path)
    accounting.changing, accounting.phase_every_us = True, 30_000_000
    uuid = next(iter(accounting.on_gpu))
    flips_at = []
    for row in rows:
        pid = int(row["host_pid"])
        values = [accounting.per_percent(uuid, pid, stamp)
                  for stamp in range(0, 120_000_000, 100_000)]
        assert set(values) == {TOKENS_PER_PERCENT, TOKENS_PER_PERCENT / 2}
        flips = [n for n in range(1, len(values)) if values[n] != values[n - 1]]
        # a change every 30 s, at the same moment of each interval
        assert [b - a for a, b in itertools.pairwise(flips)] == [300] * (len(flips) - 1)
        flips_at.append(flips[0] % 300)
    assert len(set(flips_at)) == len(rows)  # not all at once


def test_tracking_counts_each_container_periods_distance_from_its_share(tmp_path):
    rows = node.build_regions(tmp_path, 1, 6)
    now_ns = [1_765_000_000_000_000_000]  # NVML's clock, as this test moves it
    accounting = Accounting(tmp_path / "nvml", rows, clock=lambda: now_ns[0])
    on_gpu = accounting.on_gpu
    assert accounting.tracking() == (0.0, 0)
    totals = {pair: [0] * 6 for pairs in on_gpu.values() for pair, _ in pairs}
    first_us = (accounting.period + 1) * SAMPLE_PERIOD_US
    now_ns[0] = first_us * 1000
    accounting.update(totals)  # a period ended: where the counters stand is noted
    before = accounting.tracking()
    now_us = (accounting.period + 3) * SAMPLE_PERIOD_US
    elapsed_s = (now_us - accounting.read_us) / 1e6
    # per GPU: its first container-device at exactly its share, the others at half of theirs
    expected = []
    for pairs in on_gpu.values():
        share = 100 / len(pairs)
        for n, (pair, _) in enumerate(pairs):
            use = share if n == 0 else share / 2
            totals[pair][0] = round(use * TOKENS_PER_PERCENT * elapsed_s)
            expected += [abs(use - share)] * 3
    now_ns[0] = now_us * 1000
    accounting.update(totals)
    error, periods = (a - b for a, b in zip(accounting.tracking(), before, strict=True))
    assert periods == len(totals) * 3  # every container-device, three periods ended
    assert abs(error - sum(expected)) < 0.01 * periods
    assert error > 0

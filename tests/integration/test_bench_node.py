"""The node `bench_scrape.py` (and `bench_tick.py`) measure is one a device plugin could have
made: every GPU full, its limits adding up to 100 %, each slice held once. An over-committed
node keeps the law moving for reasons no real node has, and its figures would say nothing."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from tests.bench.bench_scrape import build_regions, containers_for, free_device_ids
from vgpu_agent.shm.regions import Region


@pytest.mark.parametrize(("devices", "per_gpu"), [(16, None), (144, 18), (256, None)])
def test_the_benchmark_node_is_a_valid_full_allocation(tmp_path, devices, per_gpu):
    rows = build_regions(tmp_path, 8, containers_for(devices))
    limits: dict[str, float] = defaultdict(float)
    slices: Counter[str] = Counter()
    held = 0
    for row in rows:
        region = Region.open(tmp_path / str(row["alloc_id"]))
        try:
            assert len(region.device_uuids) == row["devices"]
            for dev, uuid in enumerate(region.device_uuids):
                limits[uuid] += region.core_limit(dev)
                held += 1
            slices.update(region.device_ids)
        finally:
            region.close()
    assert held == devices
    # every GPU full, whatever it holds (the other sizes spread less evenly)
    assert len(limits) == 8 and all(v == pytest.approx(100.0, abs=0.01) for v in limits.values())
    per_gpu_held = Counter(slice_id.split("::")[0] for slice_id in slices)
    if per_gpu is not None:  # 128 containers: as many container-devices on every GPU
        assert set(per_gpu_held.values()) == {per_gpu}
    assert max(slices.values()) == 1  # no slice held twice


@pytest.mark.parametrize("devices", [16, 144, 256])
def test_allocate_asks_only_for_slices_no_container_holds(tmp_path, devices):
    rows = build_regions(tmp_path, 8, containers_for(devices))
    held = {str(i) for row in rows for i in row["device_ids"]}
    free = free_device_ids(8, held)
    assert free and not held & set(free)
    assert len(set(free)) == len(free)
    # every GPU keeps some free slices to ask for, even on the largest node
    assert len({slice_id.split("::")[0] for slice_id in free}) == 8


def test_the_benchmark_shims_spend_no_more_than_their_buckets_let_through(tmp_path):
    # The bench's shims write `state` as honest ones do: unlimited they spend what they want,
    # limited what the rate and burst in `control` allow, so the agent believes every claim.
    from tests.bench.bench_scrape import ShimSide
    from vgpu_agent.shm import layout
    from vgpu_agent.throttle.audit import believed_spend

    rows = build_regions(tmp_path, 2, 4)
    clock = [0]
    shim = ShimSide(tmp_path, rows, clock=lambda: clock[0])
    region = Region.open(tmp_path / str(rows[0]["alloc_id"]))
    try:
        def totals() -> int:
            return region.counters()[0]

        clock[0] += 100_000_000  # 100 ms of spending, unlimited
        shim.tick()
        assert totals() == 10 * ShimSide.DEMAND_PER_STEP
        rate, burst = 1_000_000, 20_000  # a fifth of what it wants
        region.set_rate(0, rate, burst)
        bucket, before = None, totals()
        for _ in range(20):
            clock[0] += 100_000_000
            shim.tick()
            claimed = totals() - before
            before = totals()
            assert claimed <= rate * 0.1 + burst
            believed, bucket = believed_spend(claimed, bucket, rate, burst, 0.1)
            assert believed == claimed
        assert claimed == pytest.approx(rate * 0.1, rel=0.05)  # hungry: all of its rate
        assert layout.is_unlimited(layout.POLICY_STRICT, 0, 0, 0)  # (0, 0): never configured
    finally:
        region.close()


@pytest.mark.parametrize(("overclaimed", "over_target", "policy", "stops"),
                         [(0, 0, "strict", False), (3, 0, "strict", True),
                          (0, 1, "strict", True), (0, 0, "work-conserving", True)])
def test_the_bench_stops_when_an_honest_container_is_cut_or_capped(overclaimed, over_target,
                                                                    policy, stops):
    # its containers are honest: a claim cut or a cap for use above its target is a false
    # catch, and figures measured beside one say nothing; nor do figures of containers under
    # another policy than the one the bench asked for (strict here)
    from tests.bench.bench_scrape import check_bound

    body = (b'vgpu_container_core_utilization_ratio{pod="pod-0",container="ctr-0"} 0.05\n'
            b'vgpu_container_core_policy_info{pod="pod-0",container="ctr-0",policy="%s",'
            b'policy_source="default"} 1\n'
            b'vgpu_region_events_total{event="tokens_overclaimed"} %d\n'
            b'vgpu_region_events_total{event="use_over_target"} %d\n'
            % (policy.encode(), overclaimed, over_target))
    if stops:
        with pytest.raises(SystemExit):
            check_bound(body, {"pod-0"})
    else:
        check_bound(body, {"pod-0"})


_WATCH_TOTALS = """
import sys, time
from pathlib import Path
from vgpu_agent.shm.regions import Region

regions = [Region.open(Path(p)) for p in sys.argv[1:]]
last = [None] * len(regions)
reads = falls = 0
print("ready", flush=True)
until = time.monotonic() + 1.0
while time.monotonic() < until:
    for n, region in enumerate(regions):
        now = region.counters()
        if last[n] is not None and any(a < b for a, b in zip(now, last[n])):
            falls += 1
        last[n] = now
        reads += 1
print(reads, falls)
"""


def test_the_benchmark_shims_totals_never_read_lower_to_a_reader_in_another_process(tmp_path):
    # The agent reads `state` while the bench's shims write it. A total read lower than the
    # one before is a dead process's slot reclaimed (the agent counts nothing), and the next
    # read claims everything since: a field written in parts (`struct.pack_into` zeroes it
    # first) read halfway stopped the bench on "honest claims cut". Written a field at a time
    # in one 8-byte store, as the shim's atomics are, it never reads lower.
    import subprocess
    import sys

    from tests.bench.bench_scrape import ShimSide

    rows = build_regions(tmp_path, 2, 4)
    clock = [0]
    shim = ShimSide(tmp_path, rows, clock=lambda: clock[0])
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCH_TOTALS, *(str(tmp_path / str(r["alloc_id"])) for r in rows)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watcher.stdout is not None and watcher.stderr is not None
    ready = watcher.stdout.readline().strip()
    assert ready == "ready", watcher.stderr.read()
    while watcher.poll() is None:
        clock[0] += 10_000_000  # a step each, unlimited: every total moves
        shim.tick()
    assert watcher.returncode == 0, watcher.stderr.read()
    reads, falls = map(int, watcher.stdout.read().split())
    assert reads > 1_000 and falls == 0


def test_the_benchmarks_time_sliced_driver_answers_as_the_h200_did():
    from tests.bench.bench_scrape import SAMPLE_PERIOD_US, time_sliced
    from vgpu_agent.throttle.timesliced import read_as_periods

    pids = [11, 12, 13]
    # five periods: the GPU 60 % used, then idle once, then 90 %; 13 never uses it
    periods = [(n, (40, 20, 0)) for n in (1, 2, 3)] + [(4, (0, 0, 0)), (5, (60, 30, 0))]
    got = time_sliced("GPU-x", pids, periods)
    assert {s.pid for s in got} <= {11, 12}  # drawn by use: never the idle process
    assert got == time_sliced("GPU-x", pids, periods)  # the same draw, whoever asks
    # one sample per process given a period, stamped with its last, worth its part of the use
    assert sum(s.sm_util for s in got) == pytest.approx((3 * 60 + 90) / 5, abs=1)
    assert all(s.timestamp_us % SAMPLE_PERIOD_US == 0 for s in got)
    # read every period: one process with the GPU's whole use
    one = time_sliced("GPU-x", pids, [(7, (40, 20, 0))])
    assert len(one) == 1 and one[0].sm_util == 60
    # and the controller reads it as the periods it stands for
    owner = {11: "a", 12: "b"}
    at: dict[int, list[tuple[int, int]]] = {}
    for s in got:
        at.setdefault(s.timestamp_us, []).append((s.pid, s.sm_util))
    given, busy = read_as_periods(at, owner, 5)
    assert busy == pytest.approx(sum(s.sm_util for s in got))
    assert sum(len(g) for g in given) >= len(got)
    # over many periods each process is given periods in proportion to its use
    many = [(n, (40, 20, 0)) for n in range(3_000)]
    firsts = Counter(time_sliced("GPU-x", pids, [p])[0].pid for p in many)
    assert firsts[11] / firsts[12] == pytest.approx(2.0, rel=0.15)

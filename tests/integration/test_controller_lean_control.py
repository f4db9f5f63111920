"""The controller's lean reads and trusted observations: `control` read once per region and tick
(agreeing with the per-device readers), observations that are what the checked constructor would
make of the same values, whatever a container writes into `state`, and one region's lies that
reach no other GPU's decisions."""

from __future__ import annotations

import asyncio
import itertools
import random
import struct
from pathlib import Path

import pytest

from tests.fakes.clock import ManualClock
from tests.fakes.shimstate import DeviceSpec, make_region, put_totals
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, RegionError, format_alloc_id
from vgpu_agent.throttle.audit import JITTER_S
from vgpu_agent.throttle.control import UNLIMITED_RATE, Decision, LoopState, Observation
from vgpu_agent.throttle.controller import WAIT_SPEND_FRACTION, ThrottleController
from vgpu_agent.throttle.fastlaw import control_step_gpu

UUIDS = tuple(f"GPU-dddddddd-0000-0000-0000-00000000000{n}" for n in range(4))
POLICIES = ("strict", "work-conserving", "off")


def file_region(root: Path, seq: int, uuids: tuple[str, ...], percents: tuple[float, ...],
                policy: str = "strict") -> Region:
    ids = [f"{uuid}::{seq}" for uuid in uuids]
    alloc_id = format_alloc_id(seq, ids, 1)
    make_region(root, alloc_id,
                [DeviceSpec(u, 1 << 30, p, policy) for u, p in zip(uuids, percents, strict=True)],
                ids, seq=seq)
    return Region.open(root / alloc_id)


def slow_controls(region: Region) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    rates: list[int] = []
    for dev in range(region.device_count):
        rates += region.rate(dev)
    return (tuple(rates), tuple(region.policy(d) for d in range(region.device_count)),
            region.priority)


def test_the_lean_control_read_agrees_with_the_per_device_readers(tmp_path):
    rng = random.Random(7)
    for seq in range(1, 41):
        count = rng.randint(1, 4)
        region = file_region(tmp_path, seq, UUIDS[:count],
                             tuple(rng.choice((5.0, 12.5, 50.0, 100.0)) for _ in range(count)),
                             rng.choice(POLICIES))
        try:
            assert region.controls() == slow_controls(region)
            for _ in range(5):
                dev = rng.randrange(count)
                region.set_rate(dev, rng.randrange(0, UNLIMITED_RATE + 1),
                                rng.randrange(0, UNLIMITED_RATE + 1))
                if rng.random() < 0.5:
                    region.set_policy(rng.choice(POLICIES), rng.randint(-5, 5))
                assert region.controls() == slow_controls(region)
            # written behind the object's back (straight into the file): read live by both
            with open(region.path / "control", "r+b") as f:
                f.seek(layout.control_device_offset(count - 1, "rate"))
                f.write(struct.pack("<Q", 4242))
            assert region.controls()[0][2 * (count - 1)] == 4242
            assert region.controls() == slow_controls(region)
        finally:
            region.close()


def test_a_closed_region_refuses_the_lean_control_read(tmp_path):
    region = file_region(tmp_path, 1, UUIDS[:1], (25.0,))
    region.close()
    with pytest.raises(RegionError, match="closed"):
        region.controls()


class Samples:
    """Per GPU, the same utilization for every process, a new sample at every call."""

    def __init__(self, pids: dict[str, list[int]], util: int = 20):
        self.pids, self.util, self.now_us = pids, util, 1_000

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self.now_us += 50_000
        return [ProcessSample(pid, self.now_us, self.util) for pid in self.pids.get(uuid, [])]


class Recorder:
    """The fast law, with every observation it was given and every decision it made kept."""

    def __init__(self) -> None:
        self.seen: list[Observation] = []
        self.decided: dict[str, list[Decision]] = {}

    def __call__(self, observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        self.seen.extend(observations)
        decisions = control_step_gpu(observations, states, dt_s, params)
        for key, decision in decisions.items():
            self.decided.setdefault(key, []).append(decision)
        return decisions


def controller(regions: list[Region], law: Recorder, clock: ManualClock) -> ThrottleController:
    run = ThrottleController(Samples({}), lambda: regions, clock=clock, law=law,
                             proc_root="/nonexistent")
    run.inline_read_s = 10.0  # on the loop: the test steps it tick by tick
    return run


def hostile_totals(rng: random.Random, before: tuple[int, int, int]) -> tuple[int, int, int]:
    """What a lying shim might leave in the header: totals that jump, drop, or sit at the top
    of what is plausible."""
    choice = rng.random()
    if choice < 0.3:
        return tuple(max(0, v - rng.randrange(0, 10**9)) for v in before)  # type: ignore[return-value]
    if choice < 0.4:
        return (layout.PLAUSIBLE_COUNTER,) * 3
    return tuple(  # type: ignore[return-value]
        min(layout.PLAUSIBLE_COUNTER, v + rng.randrange(0, 10**12)) for v in before)


async def test_observations_are_what_the_checked_constructor_makes_whatever_state_says(tmp_path):
    rng = random.Random(11)
    regions = [
        file_region(tmp_path, 1, UUIDS[:2], (30.0, 60.0)),
        file_region(tmp_path, 2, (UUIDS[1], UUIDS[0]), (20.0, 10.0), "work-conserving"),
        file_region(tmp_path, 3, UUIDS[:1], (50.0,), "off"),
    ]
    law, clock = Recorder(), ManualClock()
    run = controller(regions, law, clock)
    totals = {(r.alloc_id, d): (0, 0, 0) for r in regions for d in range(r.device_count)}
    rate_before: dict[str, int] = {}
    try:
        for tick in range(60):
            expected: dict[str, tuple[int, int, int, tuple[int, int], str, int]] = {}
            for region in regions:
                for dev in range(region.device_count):
                    key = (region.alloc_id, dev)
                    before, now = totals[key], hostile_totals(rng, totals[key])
                    put_totals(region.path, dev, *now)
                    totals[key] = now
                    moved = tuple(max(0, b - a) for a, b in zip(before, now, strict=True))
                    expected[f"{region.alloc_id}/{dev}"] = (
                        *(moved if tick else (0, 0, 0)), region.rate(dev),
                        region.policy(dev), region.priority)
            if tick % 7 == 3:  # the pod's annotations change the policy and priority
                regions[1].set_policy(rng.choice(("strict", "work-conserving")),
                                      rng.randint(0, 3))
                for dev in range(regions[1].device_count):
                    key = f"{regions[1].alloc_id}/{dev}"
                    expected[key] = (*expected[key][:4], regions[1].policy(dev),
                                     regions[1].priority)
            law.seen.clear()
            clock.ns += 100_000_000
            await run.tick()
            assert len(law.seen) == 5
            for obs in law.seen:
                assert Observation(*obs) == obs  # the checks pass: nothing invalid slipped by
                spent, launches, waited, written, policy, priority = expected[obs.key]
                assert obs.launches == launches
                rate = written if written != (0, 0) else (UNLIMITED_RATE, UNLIMITED_RATE)
                assert (obs.rate, obs.burst) == rate
                # waits as written, where a bucket can have made them: a rate, and spending
                # near it (`WAIT_SPEND_FRACTION` of what it let through in the tick's 0.1 s)
                near = rate[0] < UNLIMITED_RATE and obs.spent >= WAIT_SPEND_FRACTION * rate[0] * 0.1
                assert obs.waited_s == (waited / 1e9 if near else 0.0)
                if policy == "off" or rate[0] >= UNLIMITED_RATE:
                    assert obs.spent == spent  # the shim does not limit: every claim stands
                else:  # never more than the bucket let through (`throttle/audit.py`): its
                    # balance (a burst at most) and the refill, at the higher of this tick's
                    # and the last one's rate, plus what is lent
                    fastest = max(rate[0], rate_before.get(obs.key, 0))
                    assert 0 <= obs.spent <= spent
                    assert obs.spent <= 3 * rate[1] + fastest * (0.1 + JITTER_S) + 1
                rate_before[obs.key] = rate[0]
                assert (obs.policy, obs.priority) == (policy, priority)
                region = next(r for r in regions if obs.key.startswith(r.alloc_id))
                assert obs.limit == region.core_limit(int(obs.key.rsplit("/", 1)[1]))
        assert set(run.error_counts) == {"tokens_overclaimed"}  # the jumps were not believed
    finally:
        for region in regions:
            region.close()


async def run_pair(root: Path, hostile: bool) -> Recorder:
    """A region on GPU 0 and 1 (lying or not) and a neighbour on GPU 1, sharing nothing but the
    controller; a victim alone on GPU 2 and 3 (two devices)."""
    rng = random.Random(3)
    liar = file_region(root, 1, UUIDS[:2], (40.0, 40.0), "work-conserving")
    victim = file_region(root, 2, UUIDS[2:], (30.0, 70.0))
    regions = [liar, victim]
    law, clock = Recorder(), ManualClock()
    run = controller(regions, law, clock)
    spent = 0
    liar_totals = [(0, 0, 0), (0, 0, 0)]
    try:
        for _ in range(80):
            spent += 1_000_000
            for dev in range(2):
                put_totals(victim.path, dev, spent * (dev + 1), spent // 1000, 0)
                liar_totals[dev] = (hostile_totals(rng, liar_totals[dev]) if hostile
                                    else (spent, spent // 1000, 0))
                put_totals(liar.path, dev, *liar_totals[dev])
            if hostile and rng.random() < 0.2:
                with open(liar.path / "state", "r+b") as f:  # a header that is not one
                    f.write(b"\xff" * 16)
            elif hostile:
                with open(liar.path / "state", "r+b") as f:
                    f.write(layout.encode_state(2)[:32])
            clock.ns += 100_000_000
            await run.tick()
    finally:
        liar.close()
        victim.close()
    return law


async def test_a_lying_region_changes_no_decision_on_another_gpu(tmp_path):
    honest = await run_pair(tmp_path / "honest", hostile=False)
    lied = await run_pair(tmp_path / "hostile", hostile=True)
    victims = [key for key in honest.decided if key.startswith("000000000002")]
    assert len(victims) == 2
    for key in victims:
        assert lied.decided[key] == honest.decided[key]
    liars = [key for key in honest.decided if key.startswith("000000000001")]
    assert any(lied.decided.get(key) != honest.decided[key] for key in liars)  # it did lie


async def test_the_tick_yields_to_the_loop_between_gpus(tmp_path):
    regions = [file_region(tmp_path, seq, (UUIDS[seq - 1],), (25.0,)) for seq in range(1, 5)]
    events: list[str] = []

    def law(observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        events.append("law")
        return control_step_gpu(observations, states, dt_s, params)

    clock = ManualClock()
    run = ThrottleController(Samples({}), lambda: regions, clock=clock, law=law,
                             proc_root="/nonexistent")
    run.inline_read_s = 10.0

    async def neighbour() -> None:
        while True:
            events.append("other")
            if events.count("law") == 2 and not regions[3].closed:
                regions[3].close()  # collected while the tick is half done
            await asyncio.sleep(0)

    other = asyncio.create_task(neighbour())
    try:
        await asyncio.sleep(0)
        for _ in range(3):
            events.clear()
            clock.ns += 100_000_000
            await run.tick()
            laws = [n for n, e in enumerate(events) if e == "law"]
            # something else ran between every two GPUs' steering
            assert all("other" in events[a:b] for a, b in itertools.pairwise(laws))
        # the region closed mid-tick was skipped (no rate written to it, no beat), not an error
        assert events.count("law") == 3
        assert not run.error_counts
    finally:
        other.cancel()
        for region in regions:
            region.close()


@pytest.mark.parametrize("generation", [0, 7, 2**64 - 1, 2**64 - 2])
def test_rates_are_stored_as_the_layout_stores_them(tmp_path, generation):
    """The same bytes as `layout.set_rate` on a copy, a generation left odd by a writer that
    died mid-update (and one about to wrap) included; values the layout refuses still raise."""
    region = file_region(tmp_path, 1, UUIDS[:3], (10.0, 20.0, 30.0))
    try:
        with open(region.path / "control", "r+b") as f:
            f.seek(layout.CONTROL_OFFSETS["generation"])
            f.write(struct.pack("<Q", generation))
        rng = random.Random(generation)
        for _ in range(20):
            dev = rng.randrange(3)
            rate, burst = rng.randrange(layout.TOKEN_MAX + 1), rng.randrange(layout.TOKEN_MAX + 1)
            expected = bytearray((region.path / "control").read_bytes())
            layout.set_rate(expected, dev, rate, burst)
            region.set_rate(dev, rate, burst)
            assert (region.path / "control").read_bytes() == bytes(expected)
        for bad in (-1, layout.TOKEN_MAX + 1, 1.5, True):
            with pytest.raises(layout.RegionFormatError):
                region.set_rate(0, bad, 1)  # type: ignore[arg-type]
        with pytest.raises(IndexError):
            region.set_rate(3, 1, 1)
    finally:
        region.close()
    with pytest.raises(RegionError, match="closed"):
        region.set_rate(0, 1, 1)


@pytest.mark.parametrize(("tick_s", "calm_ticks", "max_tick_s"), [(0.1, 10, 0.4), (0.05, 4, 0.5)])
async def test_the_tick_slows_down_by_calm_time_not_calm_ticks(tmp_path, tick_s, calm_ticks,
                                                                max_tick_s):
    """One more `tick_s` per `calm_ticks` * `tick_s` seconds of calm: longer ticks do not make
    the slowing down itself slower. The first tick sees a new container (a change); the law
    decides the same from then on."""
    region = file_region(tmp_path, 1, UUIDS[:1], (30.0,))
    clock = ManualClock()
    run = ThrottleController(Samples({}), lambda: [region], clock=clock, law=Scripted({}),
                             proc_root="/nonexistent", tick_s=tick_s, calm_ticks=calm_ticks,
                             max_tick_s=max_tick_s, unlent_tick_s=max_tick_s)
    run.inline_read_s = 10.0
    span = calm_ticks * tick_s

    def interval() -> float:  # the GPU's own (at its longest, its next tick is on the grid)
        return run._paces[UUIDS[0]].interval_s

    try:
        await run.tick(paced=True)
        assert run.interval_s == interval() == pytest.approx(tick_s)
        elapsed, seen = 0.0, []  # calm since the first tick
        while interval() < max_tick_s - 1e-9:
            elapsed += run.interval_s
            clock.ns += round(run.interval_s * 1e9)
            await run.tick(paced=True)
            seen.append((elapsed, interval()))
            assert elapsed < 20
    finally:
        region.close()
    for at, interval in seen:
        expected = min(max_tick_s, tick_s * (1 + int(at / span + 1e-9)))
        assert interval == pytest.approx(expected)
    steps = round((max_tick_s - tick_s) / tick_s)
    assert seen[-1][0] == pytest.approx(steps * span, abs=max_tick_s)  # not sum of k * span


class Scripted:
    """A law deciding what the test says: the same rate and target every tick, the hungry flag
    flipping, and the target moved by `moves[tick]` points where given."""

    def __init__(self, moves: dict[int, float]):
        self.moves, self.calls = moves, 0

    def __call__(self, observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        self.calls += 1
        target = 30.0 + self.moves.get(self.calls, 0.0)
        return {o.key: Decision(1_000_000, 20_000, target, self.calls % 2 == 0, 10.0,
                                LoopState()) for o in observations}


@pytest.mark.parametrize(("moves", "fast_at"), [({}, set()), ({40: 0.4}, set()),
                                                ({40: 2.0}, {40, 41})])
async def test_calm_is_judged_by_what_the_law_decides(tmp_path, moves, fast_at):
    """A container flipping between waiting for tokens and not, at the same target and rate,
    lets the tick slow down; a target that moves past `calm_target_points` (and back) does not."""
    region = file_region(tmp_path, 1, UUIDS[:1], (30.0,))
    law, clock = Scripted(moves), ManualClock()
    run = ThrottleController(Samples({}), lambda: [region], clock=clock, law=law,
                             proc_root="/nonexistent", unlent_tick_s=0.4)
    run.inline_read_s = 10.0
    try:
        intervals = []  # the GPU's own (at its longest, its next tick is on the grid)
        for _ in range(50):
            clock.ns += round(run.interval_s * 1e9)
            await run.tick()
            intervals.append(run._paces[UUIDS[0]].interval_s)
        # the documented rule, with changes at the first tick (a new container) and `fast_at`
        expected, calm, interval = [], 0.0, 0.1
        for tick in range(1, 51):
            calm = 0.0 if tick == 1 or tick in fast_at else calm + interval
            interval = min(0.4, 0.1 * (1 + int(calm / 1.0 + 1e-9)))
            expected.append(interval)
        assert intervals == pytest.approx(expected)
        assert max(intervals[:39]) == pytest.approx(0.4)  # flips alone: slowed down all the way
        assert region.rate(0) == (1_000_000, 20_000)
    finally:
        region.close()


async def test_a_region_closed_between_its_two_reads_is_skipped_quietly(tmp_path):
    """Collected on the loop while the worker thread read its `state` and then its `control`:
    skipped, not counted; a `control` that cannot be read otherwise is counted."""
    kept = file_region(tmp_path, 1, UUIDS[:1], (30.0,))
    victim = file_region(tmp_path, 2, UUIDS[:1], (30.0,))
    broken = file_region(tmp_path, 3, UUIDS[:1], (30.0,))
    read_controls = victim.controls

    def close_first() -> tuple[tuple[int, ...], tuple[str, ...], int]:
        victim.close()
        return read_controls()

    def fail() -> tuple[tuple[int, ...], tuple[str, ...], int]:
        raise OSError("control unreadable")

    victim.controls = close_first  # type: ignore[method-assign]
    broken.controls = fail  # type: ignore[method-assign]
    law, clock = Recorder(), ManualClock()
    run = controller([kept, victim, broken], law, clock)
    try:
        clock.ns += 100_000_000
        await run.tick()
        assert [o.key for o in law.seen] == [f"{kept.alloc_id}/0"]
        assert run.error_counts == {"region_read": 1}
    finally:
        for region in (kept, victim, broken):
            region.close()

"""What a tick costs: the lean read of `state` headers, slots read only to place a new process,
the heartbeat at its own rate, a tick that slows down while all is calm, nothing without regions."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region, put_totals
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm import layout
from vgpu_agent.shm.api import RegionUsage
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.simulation.gpu import NoShim, SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import SIM_UUID
from vgpu_agent.throttle.controller import UNLENT_TICK_S, ThrottleController

BUSY = Workload(kernel_s=0.002)


def file_region(root: Path, seq: int = 1, devices: int = 1) -> Region:
    uuids = [f"GPU-cccccccc-0000-0000-0000-00000000000{d}" for d in range(devices)]
    ids = [f"{u}::{seq}" for u in uuids]
    alloc_id = format_alloc_id(seq, ids, 1)
    make_region(root, alloc_id, [DeviceSpec(u, 1 << 30, 30.0, "strict") for u in uuids], ids,
                seq=seq)
    return Region.open(root / alloc_id)


def test_counters_come_from_the_header_alone(tmp_path):
    region = file_region(tmp_path, devices=2)
    try:
        # slots the lean read must not need: a process with other figures (the totals set
        # after it, below its own)
        shim = ShimWriter(region.path)
        shim.process(0, 100, 4_000, 0, tokens=999_999, launches=7)
        shim.close()
        put_totals(region.path, 0, 1_000, 10, 5_000)
        put_totals(region.path, 1, 2_000, 20, 0)
        assert region.counters() == (1_000, 10, 5_000, 2_000, 20, 0)
    finally:
        region.close()


def test_a_peek_reads_the_header_without_the_file_checks(tmp_path, monkeypatch):
    """The looks between slow ticks read many headers for one answer: `peek_counters` reads
    what `counters` reads without the path `stat` (and the directory sweep) that `counters`
    makes at most every `_LEAN_POLICE_NS`; a `state` replaced meanwhile is found at the next
    policed read, and peeks read the file held until then."""
    import os
    import shutil

    from vgpu_agent.shm import regions as module

    region = file_region(tmp_path)
    try:
        put_totals(region.path, 0, 1_000, 10, 5)
        stats: list[object] = []
        real_stat = os.stat

        def counted(path: object, *args: object, **kwargs: object) -> os.stat_result:
            stats.append(path)
            return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(module.os, "stat", counted)
        for _ in range(50):
            assert region.peek_counters() == (1_000, 10, 5)
        assert stats == []
        region._policed_ns = None  # a policed read is due
        assert region.counters() == (1_000, 10, 5)
        assert len(stats) >= 1
        # the tenant replaces its `state` with one of other totals
        state = region.path / "state"
        shutil.copy(state, tmp_path / "forged")
        os.replace(tmp_path / "forged", state)
        put_totals(region.path, 0, 9_000, 90, 0)
        assert region.peek_counters() == (1_000, 10, 5)  # the file held
        region._policed_ns = None
        assert region.counters() == (9_000, 90, 0) and region.state_replaced == 1
        assert region.peek_counters() == (9_000, 90, 0)
    finally:
        region.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("magic", 0), ("abi_major", 2), ("device_count", 3), ("header_size", 64)],
)
def test_a_header_of_another_kind_is_unreadable_not_misread(tmp_path, field, value):
    region = file_region(tmp_path)
    try:
        with open(region.path / "state", "r+b") as f:
            f.seek(layout.STATE_OFFSETS[field])
            size = 8 if field == "magic" else 4
            f.write(value.to_bytes(size, "little"))
        assert region.counters() is None
        assert region.corrupt_reads == 1
    finally:
        region.close()


def test_a_later_minor_version_with_a_larger_header_is_read(tmp_path):
    region = file_region(tmp_path)
    try:
        put_totals(region.path, 0, 123, 4, 5)
        with open(region.path / "state", "r+b") as f:
            f.seek(layout.STATE_OFFSETS["abi_minor"])
            f.write((7).to_bytes(4, "little"))
            f.seek(layout.STATE_OFFSETS["header_size"])
            f.write((layout.STATE_HEADER_SIZE + 256).to_bytes(4, "little"))
            f.seek(layout.STATE_OFFSETS["total_size"])
            f.write((layout.STATE_SIZE + 256).to_bytes(8, "little"))
        assert region.counters() == (123, 4, 5)
    finally:
        region.close()


def test_implausible_counters_and_a_short_file_are_unreadable(tmp_path):
    region = file_region(tmp_path)
    try:
        put_totals(region.path, 0, 1 << 63, 1, 1)
        assert region.counters() is None
        (region.path / "state").write_bytes(b"\x00" * 64)  # truncated by the container
        assert region.counters() is None
    finally:
        region.close()


class SlotCounting(SimRegion):
    """A simulated region that counts how often its slots are read."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.slot_reads = 0

    def usage(self) -> RegionUsage:
        self.slot_reads += 1
        return super().usage()


async def test_slots_are_read_to_place_new_processes_not_every_tick():
    gpu = SimGpu(SIM_UUID)
    region = SlotCounting("a", (SIM_UUID,), (40.0,), ("strict",))
    gpu.shim_process("a", BUSY, region)
    controller = ThrottleController(SimBackend([gpu]), lambda: [region],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    for _ in range(30):
        gpu.advance(0.1)
        await controller.tick()
    assert 1 <= region.slot_reads <= 2  # placed once; then known by its samples
    assert controller.status[("a", 0)].measured_util is not None

    # A process on the GPU in no container: looked for at most once a second, then left
    # alone for a while; it never counts for the container.
    gpu.add_process("stranger", BUSY, NoShim())
    reads = region.slot_reads
    for _ in range(30):
        gpu.advance(0.1)
        await controller.tick()
    assert region.slot_reads - reads <= 2
    assert controller.status[("a", 0)].measured_util < 60


async def test_status_is_built_once_per_tick_and_follows_each_tick():
    """The backstop and every scrape ask for `status`; it changes only when a tick ends."""
    gpu, regions, controller = one_strict_container(40.0)
    await pace(controller, gpu, 5)
    first = controller.status
    assert controller.status is first  # no tick since: the same mapping
    await pace(controller, gpu, 1)
    assert controller.status is not first
    regions.append(SimRegion("b", (SIM_UUID,), (30.0,), ("strict",)))
    gpu.shim_process("b", BUSY, regions[1])
    await pace(controller, gpu, 1)
    assert set(controller.status) == {("a", 0), ("b", 0)}  # a new container shows at once
    regions.pop()
    await pace(controller, gpu, 1)
    assert set(controller.status) == {("a", 0)}  # and one gone goes


async def test_the_heartbeat_goes_out_at_its_own_rate():
    region = SimRegion("r", (SIM_UUID,), (30.0,), ("strict",))
    beats: list[int] = []
    real_beat = region.beat
    region.beat = lambda now: (beats.append(now), real_beat(now))  # type: ignore[method-assign]
    clock = {"ns": 10**12}

    class Quiet:
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            return []

    controller = ThrottleController(Quiet(), lambda: [region], clock=lambda: clock["ns"],
                                    heartbeat_s=0.5)
    for _ in range(20):
        clock["ns"] += 100_000_000
        await controller.tick()
    assert len(beats) == 4  # 2 s of 100 ms ticks, a beat every 0.5 s
    assert all(b - a == 500_000_000 for a, b in itertools.pairwise(beats))


def paced_controller(gpu: SimGpu, regions: list[SimRegion]) -> ThrottleController:
    """A controller on `gpu` ticking every 0.1 s, slowing to 0.4 s (2 s where nothing is lent)
    by 0.1 s per 0.5 s of calm; `regions` is read afresh every tick."""
    return ThrottleController(SimBackend([gpu]), lambda: list(regions),
                              clock=lambda: gpu.now_ns, tick_s=0.1, max_tick_s=0.4,
                              calm_ticks=5, evidence=SimHostEvidence([gpu]))


def record_ticks(controller: ThrottleController, elapsed_s: Callable[[], float]) -> list[float]:
    """When (`elapsed_s`, the plant's clock) each of the controller's ticks from now on ran."""
    ticks: list[float] = []
    tick = controller.tick

    async def timed(paced: bool = False) -> None:
        ticks.append(elapsed_s())
        await tick(paced)

    controller.tick = timed  # type: ignore[method-assign]
    return ticks


def one_strict_container(limit: float = 30.0
                         ) -> tuple[SimGpu, list[SimRegion], ThrottleController]:
    """A busy container held to `limit` on a GPU of its own, under `paced_controller`."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("a", (SIM_UUID,), (limit,), ("strict",))]
    gpu.shim_process("a", BUSY, regions[0])
    return gpu, regions, paced_controller(gpu, regions)


async def pace(controller: ThrottleController, gpu: SimGpu, ticks: int) -> list[float]:
    """Tick at the controller's own pace, as the agent's loop does; the intervals it chose."""
    intervals = []
    for _ in range(ticks):
        gpu.advance(controller.interval_s)
        await controller.tick()
        intervals.append(controller.interval_s)
    return intervals


async def test_the_tick_slows_down_while_calm_and_speeds_up_on_change():
    """Nothing lent (a strict container at its limit): up to `unlent_tick_s`; a new
    allocation brings the tick back to `tick_s` at once."""
    gpu, regions, controller = one_strict_container()
    assert controller.unlent_tick_s == UNLENT_TICK_S == 2.0
    beats_before = regions[0].heartbeat_ns
    intervals = await pace(controller, gpu, 120)
    assert intervals[0] == 0.1  # a new container is a change
    assert max(intervals) == pytest.approx(2.0)  # settled, nothing lent: twenty times slower
    assert gpu.shares(gpu.processes[0], 5)[-1][1] == pytest.approx(30, abs=2)  # still held
    # ticks two seconds apart still beat on each of them
    region_beat = regions[0].heartbeat_ns
    assert region_beat > beats_before and region_beat == gpu.now_ns

    regions.append(SimRegion("b", (SIM_UUID,), (50.0,), ("strict",)))  # a new allocation
    gpu.shim_process("b", BUSY, regions[1])
    gpu.advance(controller.interval_s)
    await controller.tick()
    assert controller.interval_s == 0.1


async def test_a_rate_that_jumps_in_a_slow_tick_brings_the_fast_tick_back():
    """A rate moved by a third at once is a change, however long the tick was."""
    gpu, _, controller = one_strict_container()
    await pace(controller, gpu, 120)
    assert controller.interval_s == pytest.approx(UNLENT_TICK_S)
    law = controller.law
    controller.law = lambda obs, states, dt_s, params: {
        key: d._replace(rate=round(d.rate * 1.35)) for key, d in law(obs, states, dt_s,
                                                                    params).items()}
    gpu.advance(controller.interval_s)
    await controller.tick()
    assert controller.interval_s == 0.1


async def test_a_reading_far_off_brings_the_fast_tick_back_until_the_next_one_decides():
    """A reading far beyond the noise moves the rate little (an outlier, unless the next
    reading says the same): that next reading should come soon, not a calm tick later."""
    gpu, _, controller = one_strict_container()
    await pace(controller, gpu, 120)
    assert controller.interval_s == pytest.approx(UNLENT_TICK_S)
    law = controller.law
    pending = [3.5]

    def surprised(obs, states, dt_s, params):
        decisions = law(obs, states, dt_s, params)
        return {key: d._replace(state=d.state._replace(surprise=pending[0]))
                for key, d in decisions.items()}

    controller.law = surprised
    gpu.advance(controller.interval_s)
    await controller.tick()
    assert controller.interval_s == 0.1
    pending[0] = 0.0  # decided: calm again, and the tick slows down as before
    intervals = await pace(controller, gpu, 60)
    assert intervals[-1] > 0.1


@pytest.mark.parametrize(("limits", "policies"), [
    ((30.0, 20.0), ("strict", "off")),  # `off` may grow into the others' share
    ((60.0, 60.0), ("strict", "strict")),  # limits that do not fit
])
async def test_where_only_a_tick_sees_a_reclaim_coming_the_calm_tick_grows_to_max_tick_only(
        limits, policies):
    """Where a waking container might need another's rate lowered and its tokens would not
    say so, the tick is kept at `max_tick_s` at most, however long all is calm."""
    gpu = SimGpu(SIM_UUID)
    regions = []
    for n, (limit, policy) in enumerate(zip(limits, policies, strict=True)):
        region = SimRegion(f"c{n}", (SIM_UUID,), (limit,), (policy,))
        regions.append(region)
        gpu.shim_process(f"c{n}", BUSY, region)
    controller = paced_controller(gpu, regions)
    intervals = await pace(controller, gpu, 150)
    assert 0.1 < max(intervals) <= 0.4 + 1e-9  # it did calm down, only not further
    assert controller.watch_s is None


@pytest.mark.parametrize(("limits", "policies", "idle"), [
    ((30.0, 70.0), ("work-conserving", "work-conserving"), "never spent"),  # its 70 % lent
    ((30.0, 20.0), ("strict", "strict"), "never spent"),  # no rate yet: it would run free
    ((30.0, 70.0), ("work-conserving", "strict"), "went idle"),  # spent, then lent its share
])
async def test_an_idle_container_is_watched_between_slow_ticks(limits, policies, idle):
    """Where the only reclaim to come is an idle container waking, the calm tick grows to
    `unlent_tick_s`, and in between that container's spending is looked at every
    `max_tick_s`: nothing while it stays idle, a wake-up as soon as it spends."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion(f"c{n}", (SIM_UUID,), (limit,), (policy,))
               for n, (limit, policy) in enumerate(zip(limits, policies, strict=True))]
    gpu.shim_process("c0", BUSY, regions[0])
    if idle == "went idle":
        gpu.shim_process("c1-early", Workload(kernel_s=0.002, busy=((0.0, 3.0),)), regions[1])
    controller = paced_controller(gpu, regions)
    intervals = await pace(controller, gpu, 150)
    assert max(intervals) == pytest.approx(UNLENT_TICK_S)
    assert controller.watch_s == pytest.approx(0.4)
    for _ in range(3):
        gpu.advance(0.4)
        assert not controller.watched_woke()
    gpu.shim_process("c1", Workload(kernel_s=0.002, busy=((gpu.elapsed_s, 1e9),)), regions[1])
    gpu.advance(0.4)
    assert controller.watched_woke()


@pytest.mark.parametrize("fault", ["raises", "corrupt", "backwards", "closed"])
async def test_an_idle_container_whose_header_turns_bad_brings_the_tick(fault):
    """What a watched container writes is its own: a header that cannot be read, or totals
    that went backwards, are not known to be idle, and bring the tick (which judges them);
    a region closed meanwhile is skipped."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("busy", (SIM_UUID,), (30.0,), ("work-conserving",)),
               SimRegion("idle", (SIM_UUID,), (70.0,), ("strict",))]
    gpu.shim_process("busy", BUSY, regions[0])
    gpu.shim_process("early", Workload(kernel_s=0.002, busy=((0.0, 3.0),)), regions[1])
    controller = paced_controller(gpu, regions)
    await pace(controller, gpu, 150)
    assert controller.watch_s is not None and not controller.watched_woke()
    idle = regions[1]
    if fault == "raises":
        def unreadable() -> tuple[int, ...]:
            raise OSError("state is gone")
        idle.counters = unreadable  # type: ignore[method-assign]
    elif fault == "corrupt":
        idle.counters = lambda: None  # type: ignore[method-assign,assignment,return-value]
    elif fault == "backwards":
        idle.counters = lambda: (0, 0, 0)  # type: ignore[method-assign]
    else:
        idle.closed = True  # collected meanwhile
    gpu.advance(0.4)
    assert controller.watched_woke() is (fault != "closed")


async def test_many_idle_containers_are_looked_at_in_chunks_that_yield(monkeypatch):
    """The look between slow ticks reads one header per idle container; with many of them it
    yields to the loop between chunks of `READ_CHUNK` reads, as the tick does, and still finds
    the one that woke in the last chunk."""
    import asyncio

    from vgpu_agent.throttle import controller as module

    idle_count = 2 * module.READ_CHUNK + 6
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("busy", (SIM_UUID,), (20.0,), ("work-conserving",))]
    regions += [SimRegion(f"idle{n}", (SIM_UUID,), (1.0,), ("strict",))
                for n in range(idle_count)]
    gpu.shim_process("busy", BUSY, regions[0])
    controller = paced_controller(gpu, regions)
    await pace(controller, gpu, 150)
    # the idle ones for their spending, the busy one for its launches' cost
    assert controller.watch_s is not None and len(controller._watched) == idle_count + 1

    turns = [0]
    seen: list[int] = []
    read = module._counters

    def counted(region: object, peek: bool = False) -> object:
        seen.append(turns[0])
        return read(region, peek)  # type: ignore[arg-type]

    async def other_work() -> None:  # what Allocate and scrapes are to the loop
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    monkeypatch.setattr(module, "_counters", counted)
    # the busy one is read at every look too (by default at one in LAUNCH_LOOKS)
    monkeypatch.setattr(module, "LAUNCH_LOOKS", 1)
    other = asyncio.create_task(other_work())
    try:
        await asyncio.sleep(0)
        gpu.advance(0.4)
        assert not await controller._watched_woke_in_chunks()
        chunks = [seen[n: n + module.READ_CHUNK] for n in range(0, len(seen), module.READ_CHUNK)]
        assert len(seen) == idle_count + 1 and len(chunks) == 3
        assert all(len(set(chunk)) == 1 for chunk in chunks)  # no yield inside a chunk
        assert chunks[0][0] < chunks[1][0] < chunks[2][0]  # the loop ran between chunks
        gpu.shim_process("last", Workload(kernel_s=0.002, busy=((gpu.elapsed_s, 1e9),)),
                         regions[-1])
        gpu.advance(0.4)
        assert await controller._watched_woke_in_chunks() and controller.watched_woke()
    finally:
        other.cancel()


async def test_a_lender_waking_between_slow_ticks_is_served_as_soon_as_at_fast_ticks():
    """A work-conserving borrower has the GPU while its 70 % neighbour is idle; the neighbour
    wakes 30 s in, a slow tick after the last. The first tick after its first launch comes
    within `max_tick_s` (the look that finds it, then the tick), and the neighbour has its
    share back as soon as where the tick never grew past `max_tick_s`."""
    from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun

    async def run(unlent_tick_s: float | None) -> tuple[list[float], float]:
        sim = ControlledRun((
            ContainerSpec("borrower", 30, BUSY),
            ContainerSpec("owner", 70, Workload(kernel_s=0.002, busy=((30.0, 1e9),))),
        ), paced=True)
        if unlent_tick_s is not None:
            sim.controller.unlent_tick_s = unlent_tick_s
        ticks = record_ticks(sim.controller, lambda: sim.gpu.elapsed_s)
        await sim.advance(33.0)
        owner = sim.procs["owner"][0]
        back = next(t for t, share in sim.gpu.shares(owner, 0.1) if t > 30 and share >= 60)
        return ticks, back

    ticks, back = await run(None)
    slow = [b - a for a, b in itertools.pairwise(ticks) if b < 30]
    assert max(slow) == pytest.approx(UNLENT_TICK_S)  # it did slow down while the owner slept
    first_after = min(t for t in ticks if t > 30)
    assert first_after - 30 <= 0.4 + 0.1 + 1e-9
    _, back_fast = await run(0.4)  # never slower than `max_tick_s`
    assert back <= back_fast + 0.2


@pytest.mark.parametrize(("ppm", "lends"), [
    (333_333, False),  # a GPU cut in three: limits a hair under 100 % leave crumbs to lend
    (333_334, False),  # and a hair over it, over-committed by two parts per million
    (333_000, True),  # a tenth of a point spare: a loan, however small, is one
])
async def test_limits_rounded_to_parts_per_million_are_no_loan(ppm, lends):
    """Three busy work-conserving thirds of a GPU, their limits as `control` keeps them (parts
    per million): what rounding leaves spare, or over-commits, is no loan, nor limits that do
    not fit, either of which would keep the tick at `max_tick_s`. A real loan is one; with
    every container busy there is nobody to watch, and the tick grows all the same."""
    gpu = SimGpu(SIM_UUID)
    regions = []
    for n in range(3):
        region = SimRegion(f"c{n}", (SIM_UUID,), (ppm / 10_000,), ("work-conserving",))
        regions.append(region)
        gpu.shim_process(f"c{n}", BUSY, region)
    controller = paced_controller(gpu, regions)
    intervals = await pace(controller, gpu, 150)
    assert max(intervals) == pytest.approx(UNLENT_TICK_S)
    # nobody idle to watch: the busy are watched for their launches' cost alone
    assert controller._watched and all(w[2] == math.inf for w in controller._watched)
    statuses = controller.status.values()
    assert any(d.target > d.limit + 0.01 for d in statuses) == lends
    for process in gpu.processes:  # and every third still gets its share
        assert gpu.shares(process, 5)[-1][1] == pytest.approx(100 / 3, abs=2)


@pytest.mark.parametrize("fault", ["raises", "corrupt"])
async def test_a_region_that_cannot_be_read_keeps_the_tick_at_max_tick(fault):
    """What an unreadable region's container does is not known: however calm the rest, the
    tick grows to `max_tick_s` only, as where something is lent."""

    class Unreadable(SimRegion):
        def counters(self) -> tuple[int, ...] | None:  # type: ignore[override]
            if fault == "raises":
                raise OSError("state is gone")
            return None  # what a corrupt header reads as

    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("a", (SIM_UUID,), (30.0,), ("strict",)),
               Unreadable("b", (SIM_UUID,), (20.0,), ("strict",))]
    gpu.shim_process("a", BUSY, regions[0])
    controller = paced_controller(gpu, regions)
    intervals = await pace(controller, gpu, 120)
    assert max(intervals) == pytest.approx(0.4)
    assert controller.error_counts.get("region_usage" if fault == "raises" else "region_corrupt")
    regions.pop()  # gone: nothing unknown is left, and the tick may slow down further
    await pace(controller, gpu, 40)
    assert controller.interval_s == pytest.approx(UNLENT_TICK_S)


def test_a_tick_kept_fast_stays_fast_and_bad_unlent_ticks_are_refused():
    kept = ThrottleController(SimBackend([]), list, tick_s=0.1, max_tick_s=0.1)
    assert kept.unlent_tick_s == 0.1
    assert ThrottleController(SimBackend([]), list, tick_s=0.2, max_tick_s=2.0,
                              heartbeat_s=1.0).unlent_tick_s == 2.0
    for bad in (0.2, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="unlent tick"):
            ThrottleController(SimBackend([]), list, tick_s=0.1, max_tick_s=0.4,
                               unlent_tick_s=bad)
    # nor a figure's longest age that is no duration (0 is: never by age)
    assert ThrottleController(SimBackend([]), list, figure_max_age_s=0.0).figure_max_age_s == 0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"longest age must be >= 0 s .* got"):
            ThrottleController(SimBackend([]), list, figure_max_age_s=bad)


async def test_without_regions_a_tick_asks_nothing():
    class Counting:
        calls = 0

        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            self.calls += 1
            return []

    backend = Counting()
    controller = ThrottleController(backend, list, calm_ticks=5)
    for _ in range(5):
        await controller.tick()
    assert backend.calls == 0 and controller.hops == 0
    # no GPU to pace: the loop sleeps for want of regions, and the first one is steered at once
    assert controller.interval_s == pytest.approx(0.1) and controller._idle


def test_bad_pacing_settings_are_refused():
    with pytest.raises(ValueError, match="max_tick_s"):
        ThrottleController(SimBackend([]), list, tick_s=0.5, max_tick_s=0.1)
    with pytest.raises(ValueError, match="heartbeat_s"):
        ThrottleController(SimBackend([]), list, heartbeat_s=0)
    for idle in (0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="idle tick"):
            ThrottleController(SimBackend([]), list, tick_s=0.1, max_tick_s=0.4, idle_tick_s=idle)


async def test_without_regions_the_loop_sleeps_until_a_region_is_added():
    """An idle controller ticks once, then sleeps: `wake` (from any thread, as the region
    store calls it) brings the next tick at once, and it then ticks at its own pace."""
    import asyncio
    import threading

    gpu = SimGpu(SIM_UUID)
    regions: list[SimRegion] = []
    controller = ThrottleController(SimBackend([gpu]), lambda: list(regions), tick_s=0.02,
                                    max_tick_s=0.05, idle_tick_s=30.0)
    controller.wake()  # not running yet: nothing to wake, no error
    task = asyncio.create_task(controller.run())
    try:
        await asyncio.sleep(0.3)
        assert controller.ticks == 1  # 15 ticks' worth of time asleep
        regions.append(SimRegion("a", (SIM_UUID,), (30.0,), ("strict",)))
        threading.Thread(target=controller.wake).start()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if controller.ticks > 1:
                break
        assert controller.ticks == 2  # woken within a tick, not after idle_tick_s
        await asyncio.sleep(0.3)
        assert controller.ticks >= 7  # regions: ticking at 0.02-0.05 s again
        regions.clear()  # the last region gone: one tick forgets it, then asleep again
        await asyncio.sleep(0.1)
        asleep = controller.ticks
        await asyncio.sleep(0.3)
        assert controller.ticks == asleep
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    controller.wake()  # stopped: a late wake is harmless


async def test_an_idle_controller_still_ticks_every_idle_tick_without_a_wake():
    """A region that appears without a wake (missed) is seen within `idle_tick_s`."""
    import asyncio

    gpu = SimGpu(SIM_UUID)
    regions: list[SimRegion] = []
    controller = ThrottleController(SimBackend([gpu]), lambda: list(regions), tick_s=0.02,
                                    max_tick_s=0.05, idle_tick_s=0.15)
    task = asyncio.create_task(controller.run())
    try:
        await asyncio.sleep(0.5)
        assert 3 <= controller.ticks <= 5
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task



async def test_the_loop_looks_at_idle_containers_between_slow_ticks():
    """`run` sleeps to the next tick in steps of `watch_s` while there are idle containers to
    look at, and ticks at once when one of them woke (`watched_woke`'s test)."""
    import asyncio

    controller = ThrottleController(SimBackend([]), list, tick_s=0.02, max_tick_s=0.05,
                                    unlent_tick_s=1.0)
    woke = [False]
    looks = [0]
    ticks: list[float] = []
    loop = asyncio.get_running_loop()

    async def tick(paced: bool = False) -> None:  # a calm tick of a lending GPU, someone to watch
        ticks.append(loop.time())
        controller.interval_s = 1.0
        controller._watched = [object()]  # type: ignore[list-item]

    def woke_among(watched: list[object], start: int = 0) -> bool:
        looks[0] += 1
        return woke[0]

    controller.tick = tick  # type: ignore[method-assign]
    controller._woke_among = woke_among  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(controller.run())
    try:
        await asyncio.sleep(0.3)
        assert len(ticks) == 1 and looks[0] >= 4  # asleep to the slow tick, looking meanwhile
        woke[0] = True
        woken_at = loop.time()
        for _ in range(30):
            await asyncio.sleep(0.01)
            if len(ticks) > 1:
                break
        assert len(ticks) == 2 and ticks[1] - woken_at < 0.1  # within a look, not the tick
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_region_added_ends_a_calm_sleep_though_no_sooner_than_a_tick():
    """`wake` (the region store calls it for every region it adds) brings the next tick at
    once even between slow calm ticks, so that a new container is followed before it
    launches; wakes in a row (a kubelet admitting one container after another) tick the
    controller no faster than `tick_s`."""
    import asyncio

    controller = ThrottleController(SimBackend([]), list, tick_s=0.05, max_tick_s=0.1,
                                    unlent_tick_s=2.0)
    ticks: list[float] = []
    loop = asyncio.get_running_loop()

    async def tick(paced: bool = False) -> None:  # calm, nothing lent: the slowest tick
        ticks.append(loop.time())
        controller.interval_s = 2.0

    controller.tick = tick  # type: ignore[method-assign]
    task = asyncio.create_task(controller.run())
    try:
        await asyncio.sleep(0.3)
        assert len(ticks) == 1
        woken_at = loop.time()
        controller.wake()
        await asyncio.sleep(0.03)
        assert len(ticks) == 2 and ticks[1] - woken_at < 0.03
        for _ in range(20):  # a wake every 10 ms for 0.2 s
            controller.wake()
            await asyncio.sleep(0.01)
        assert 4 <= len(ticks) <= 7
        assert all(b - a >= 0.05 - 0.005 for a, b in itertools.pairwise(ticks))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

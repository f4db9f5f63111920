"""Launches that cost other tokens bring a calm GPU's slow tick: between slow ticks, the
devices that launch are looked at for their tokens per launch, so that an application whose
kernels change (and with them what a token buys) is not left to take its neighbours' share
until the next slow tick; a tenant flipping its kernels costs no more ticks than a lending GPU."""

from __future__ import annotations

import itertools
import math

import pytest

from vgpu_agent.simulation.gpu import SimGpu, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import SIM_UUID, ContainerSpec, ControlledRun
from vgpu_agent.throttle import controller as module
from vgpu_agent.throttle.controller import (
    LAUNCH_COST_MOVE,
    LAUNCH_LOOKS,
    UNLENT_TICK_S,
    WATCH_LAUNCHES,
    _Device,
    _launch_cost_moved,
)

from .test_controller_lean_tick import paced_controller, record_ticks

BUSY = Workload(kernel_s=0.002)
CHANGE_S = 40.0  # well after the GPU's tick has grown to `unlent_tick_s`


def two_busy(after: Workload) -> tuple[SimGpu, list[SimRegion]]:
    """A 40 / 60 split of two busy containers; at CHANGE_S the first one's application goes
    on with `after`'s kernels."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("a", (SIM_UUID,), (40.0,), ("work-conserving",)),
               SimRegion("b", (SIM_UUID,), (60.0,), ("work-conserving",))]
    gpu.shim_process("a", Workload(kernel_s=0.002, busy=((0.0, CHANGE_S),)), regions[0])
    gpu.shim_process("a-after", Workload(kernel_s=after.kernel_s, blocks=after.blocks,
                                         busy=((CHANGE_S, math.inf),)), regions[0])
    gpu.shim_process("b", BUSY, regions[1])
    return gpu, regions


async def calm_until(controller: module.ThrottleController, gpu: SimGpu, until_s: float
                     ) -> list[float]:
    """Tick at the controller's own pace until the next tick would pass `until_s`."""
    intervals = []
    while gpu.elapsed_s + controller.interval_s < until_s:
        gpu.advance(controller.interval_s)
        await controller.tick()
        intervals.append(controller.interval_s)
    return intervals


@pytest.mark.parametrize(("after", "wakes"), [
    (Workload(kernel_s=0.004, blocks=512), True),  # half the tokens a launch, four times the SM
    (Workload(kernel_s=0.001, blocks=2048), True),  # twice the tokens, a quarter of the SM time
    (Workload(kernel_s=0.002, blocks=1024), False),  # the same kernels in a new process
])
async def test_launches_that_cost_other_tokens_bring_the_slow_tick(after, wakes):
    gpu, regions = two_busy(after)
    controller = paced_controller(gpu, regions)
    intervals = await calm_until(controller, gpu, CHANGE_S - 0.5)
    assert intervals[-1] == pytest.approx(UNLENT_TICK_S)  # nothing lent: the slowest tick
    # both are watched for their launches' cost, neither for its spending (both are busy)
    assert controller.watch_s == pytest.approx(0.4)
    assert sorted(w[0].key for w in controller._watched) == ["a/0", "b/0"]
    assert all(w[2] == math.inf and w[3] == pytest.approx(BUSY.cost) for w in controller._watched)
    looks = 0
    while gpu.elapsed_s + 0.4 <= CHANGE_S:
        gpu.advance(0.4)
        looks += 1
        assert not controller.watched_woke()  # the same kernels: nothing to tick for
    assert looks >= 1
    woke_at = None
    for _ in range(LAUNCH_LOOKS + 2):
        gpu.advance(0.4)
        if controller.watched_woke():
            woke_at = gpu.elapsed_s
            break
    if wakes:  # each is read at one look in LAUNCH_LOOKS, and one may straddle the change
        assert woke_at is not None and woke_at - CHANGE_S <= 0.4 * (LAUNCH_LOOKS + 1) + 1e-9
    else:
        assert woke_at is None


async def test_a_wake_by_launch_costs_ticks_at_max_tick_until_calm_again():
    """Kernels of another grid whose tokens buy what they did (NVML will show nothing): the
    wake's tick finds all calm, and the GPU ticks every `max_tick_s` from there (the samples
    that would show a change may come a second later), not at once back at 2 s; then the
    calm tick grows to 2 s again."""
    gpu, regions = two_busy(Workload(kernel_s=0.001, blocks=512))  # same SM time per token
    controller = paced_controller(gpu, regions)
    await calm_until(controller, gpu, CHANGE_S - 0.5)
    assert controller.interval_s == pytest.approx(UNLENT_TICK_S)
    while not controller.watched_woke():
        gpu.advance(0.4)
        assert gpu.elapsed_s < CHANGE_S + 0.4 * (LAUNCH_LOOKS + 2)
    await controller.tick(paced=True)
    assert controller.interval_s == pytest.approx(0.4)
    statuses = controller.status.values()
    assert all(abs(d.target - d.limit) < 0.5 for d in statuses)  # nothing for the law to do
    intervals = await calm_until(controller, gpu, CHANGE_S + 30)
    assert intervals[0] == pytest.approx(0.4) and max(intervals) == pytest.approx(UNLENT_TICK_S)


async def test_launching_devices_are_read_at_one_look_in_launch_looks_idle_ones_at_each(
        monkeypatch):
    """Reading every launching device's header every 0.4 s cost too much at a hundred
    containers: each is read at one look in LAUNCH_LOOKS, an idle one (whose waking reclaims
    a share) at every look."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion(name, (SIM_UUID,), (limit,), ("work-conserving",))
               for name, limit in (("a", 20.0), ("b", 20.0), ("c", 20.0), ("idle", 40.0))]
    for region in regions[:3]:
        gpu.shim_process(region.alloc_id, BUSY, region)
    controller = paced_controller(gpu, regions)
    await calm_until(controller, gpu, 40.0)
    assert sorted((w[0].key, w[2] < math.inf, w[3] > 0) for w in controller._watched) == [
        ("a/0", False, True), ("b/0", False, True), ("c/0", False, True),
        ("idle/0", True, False)]
    reads: dict[str, int] = {}
    read = module._counters

    def counted(region: SimRegion, peek: bool = False) -> tuple[int, ...] | None:
        reads[region.alloc_id] = reads.get(region.alloc_id, 0) + 1
        return read(region, peek)

    monkeypatch.setattr(module, "_counters", counted)
    looks = 4 * LAUNCH_LOOKS
    for _ in range(looks):
        gpu.advance(0.4 / LAUNCH_LOOKS / 2)  # well within the slow tick
        assert not controller.watched_woke()
    assert reads == {"a": looks // LAUNCH_LOOKS, "b": looks // LAUNCH_LOOKS,
                     "c": looks // LAUNCH_LOOKS, "idle": looks}


async def test_a_launching_devices_turn_holds_when_others_leave_the_watched_list(monkeypatch):
    """The watched list is rebuilt at every tick from the GPUs not yet due, so other devices
    leave it and come back between looks; a device's turn among the looks is its own, so it
    is read at exactly one look in LAUNCH_LOOKS whatever its place in the list (by place, it
    could be skipped at several looks in a row)."""
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion(name, (SIM_UUID,), (20.0,), ("work-conserving",))
               for name in ("a", "b", "c", "d", "e")]
    for region in regions:
        gpu.shim_process(region.alloc_id, BUSY, region)
    controller = paced_controller(gpu, regions)
    await calm_until(controller, gpu, 40.0)
    watched = list(controller._watched)
    assert sorted(w[0].key for w in watched) == ["a/0", "b/0", "c/0", "d/0", "e/0"]
    read_at: dict[str, list[int]] = {}
    read = module._counters
    look = 0

    def counted(region: SimRegion, peek: bool = False) -> tuple[int, ...] | None:
        read_at.setdefault(region.alloc_id, []).append(look)
        return read(region, peek)

    monkeypatch.setattr(module, "_counters", counted)
    for look in range(1, 8 * LAUNCH_LOOKS + 1):
        # the first entries come and go, shifting the places of those after them
        controller._watched = watched[look % 3:]
        gpu.advance(0.05)  # well within the slow tick
        assert not controller.watched_woke()
    for key in ("d", "e"):  # always in the list
        gaps = [b - a for a, b in itertools.pairwise(read_at[key])]
        assert gaps and set(gaps) == {LAUNCH_LOOKS}, (key, read_at[key])


async def test_an_unpaced_tick_makes_no_look(monkeypatch):
    """Unpaced (the simulator's fixed-rate runs), every GPU is steered at every tick: the look
    a paced tick makes first, at the watched devices of GPUs not due, would only read headers
    twice (and a reader that stalls would stall twice)."""
    gpu, regions = two_busy(BUSY)
    controller = paced_controller(gpu, regions)
    await calm_until(controller, gpu, CHANGE_S - 0.5)
    assert controller._watched
    looks: list[int] = []

    async def look() -> bool:
        looks.append(1)
        return False

    monkeypatch.setattr(controller, "_watched_woke_in_chunks", look)
    gpu.advance(0.5)
    await controller.tick()
    assert looks == []
    gpu.advance(0.5)
    await controller.tick(paced=True)
    assert looks == [1]


async def test_a_container_alone_is_watched_for_its_launches_only_where_strict():
    """A phase change of a container alone takes from nobody, unless it is held to its limit
    even alone (strict): then its launches are watched too."""
    for policy, watched in (("work-conserving", False), ("strict", True)):
        gpu = SimGpu(SIM_UUID)
        regions = [SimRegion("a", (SIM_UUID,), (30.0,), (policy,))]
        gpu.shim_process("a", BUSY, regions[0])
        controller = paced_controller(gpu, regions)
        await calm_until(controller, gpu, 40.0)
        assert (controller.watch_s is not None) is watched, policy
        assert [w[3] > 0 for w in controller._watched] == ([True] if watched else [])


def device_with_totals(spent: int, launches: int, read_ns: int = 1) -> _Device:
    device = _Device(object(), 0, "a", SIM_UUID, (spent, launches, 0))  # type: ignore[arg-type]
    device.read_ns = read_ns
    return device


def test_a_launch_cost_is_judged_over_enough_launches_from_the_last_look():
    device = device_with_totals(1_000, 10)  # 100 tokens a launch at the last tick
    per_launch = 100.0
    # too few launches to say: kept for the next look, which judges them all together
    assert not _launch_cost_moved(device, 1_000 + 40 * (WATCH_LAUNCHES - 1),
                                  10 + WATCH_LAUNCHES - 1, per_launch)
    assert device.looked is None
    assert _launch_cost_moved(device, 1_000 + 40 * (WATCH_LAUNCHES + 1), 10 + WATCH_LAUNCHES + 1,
                              per_launch)
    # judged from this look on: the next launches cost what they did at the tick
    spent, launches = device.looked[1:]  # type: ignore[index]
    assert not _launch_cost_moved(device, spent + 100 * 20, launches + 20, per_launch)
    # a move just inside the factor is no change, just outside it is one
    spent, launches = device.looked[1:]  # type: ignore[index]
    inside = round(100 * LAUNCH_COST_MOVE * 0.99)
    assert not _launch_cost_moved(device, spent + inside * 20, launches + 20, per_launch)
    spent, launches = device.looked[1:]  # type: ignore[index]
    outside = round(100 * LAUNCH_COST_MOVE * 1.01)
    assert _launch_cost_moved(device, spent + outside * 20, launches + 20, per_launch)


def test_a_look_from_before_the_last_tick_is_not_used():
    device = device_with_totals(1_000, 10, read_ns=1)
    assert _launch_cost_moved(device, 1_000 + 50 * 20, 30, 100.0)  # looked, at tick 1
    # the next tick read new totals: the look before it says nothing of what followed
    device.previous, device.read_ns = (5_000, 100, 0), 2
    assert not _launch_cost_moved(device, 5_000 + 100 * 20, 120, 100.0)


@pytest.mark.parametrize("totals", [(0, 0), (500, 5), (2_000, 5), (500, 50)])
def test_totals_that_went_backwards_start_afresh(totals):
    """The shim reclaims a dead process's slot and its totals drop; what a container writes is
    its own: no change is read into it, and the next look judges from the new totals."""
    device = device_with_totals(1_000, 10)
    spent, launches = totals  # one or both below the tick's 1_000 tokens and 10 launches
    assert not _launch_cost_moved(device, spent, launches, 100.0)
    assert device.looked == (1, spent, launches)
    assert not _launch_cost_moved(device, spent + 100 * 20, launches + 20, 100.0)
    assert _launch_cost_moved(device, spent + 100 * 20 + 300 * 20, launches + 40, 100.0)


async def test_a_phase_change_in_a_calm_tick_is_steered_within_a_look():
    """Two applications change phase just after a 2 s calm tick, one's tokens coming to buy
    four times the SM time, the other's a quarter (the bench's scenario 6, ideal plant). With
    the look, the first tick after it comes within two looks (the first may straddle the
    change), not at the next slow tick, and the 60 % container is back at its share sooner."""
    long = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)
    costly = Workload(kernel_s=0.004, blocks=512, threads_per_block=256)

    async def run(change_s: float, watch: bool) -> tuple[list[float], ControlledRun]:
        with pytest.MonkeyPatch.context() as patch:
            if not watch:
                patch.setattr(module, "LAUNCH_COST_MOVE", math.inf)
            sim = ControlledRun((
                ContainerSpec("costlier", 40, long, switch_to=costly, switch_at_s=change_s),
                ContainerSpec("cheaper", 60, costly, switch_to=long, switch_at_s=change_s),
            ), paced=True)
            ticks = record_ticks(sim.controller, lambda: sim.gpu.elapsed_s)
            await sim.advance(min(change_s, CHANGE_S) + 8)
        return ticks, sim

    # the change comes 0.1 s after a slow tick: the next one is 2 s away (the same processes
    # changing much later tick the same until then)
    ticks, _ = await run(1e6, watch=False)
    change_s = next(a for a, b in itertools.pairwise(ticks)
                    if a > CHANGE_S - 5 and b - a == pytest.approx(UNLENT_TICK_S)) + 0.1
    outcome = {}
    for watch in (True, False):
        ticks, sim = await run(change_s, watch)
        first_after = min(t for t in ticks if t > change_s)
        cheaper = [share for t, share in _container_shares(sim, "cheaper") if t > change_s]
        back = next(n for n, share in enumerate(cheaper) if share >= 55) * 0.1
        outcome[watch] = (first_after - change_s, back)
    assert outcome[True][0] <= 0.4 * (LAUNCH_LOOKS + 1) + 1e-9
    assert outcome[False][0] == pytest.approx(UNLENT_TICK_S - 0.1)
    assert outcome[True][1] < outcome[False][1]


def _container_shares(sim: ControlledRun, name: str) -> list[tuple[float, float]]:
    """A container's share over 0.1 s windows: the sum of its processes'."""
    per = [sim.gpu.shares(p, 0.1) for p in sim.procs[name]]
    return [(per[0][i][0], sum(s[i][1] for s in per)) for i in range(len(per[0]))]


async def test_a_tenant_flipping_its_kernels_ticks_its_gpu_no_faster_than_a_lending_one():
    """A container alternating kernels of two sizes every 0.3 s brings a tick at each look:
    its GPU is steered every `max_tick_s` (as a GPU that lends is), not faster, and its
    neighbour keeps its share."""
    flips = tuple((t, t + 0.3) for t in (x * 0.6 for x in range(200)))
    flops = tuple((t + 0.3, t + 0.6) for t, _ in flips)
    gpu = SimGpu(SIM_UUID)
    regions = [SimRegion("flipper", (SIM_UUID,), (40.0,), ("work-conserving",)),
               SimRegion("steady", (SIM_UUID,), (60.0,), ("work-conserving",))]
    gpu.shim_process("flip", Workload(kernel_s=0.002, blocks=1024, busy=flips), regions[0])
    gpu.shim_process("flop", Workload(kernel_s=0.001, blocks=512, busy=flops), regions[0])
    gpu.shim_process("steady", BUSY, regions[1])
    controller = paced_controller(gpu, regions)
    sim_ticks = record_ticks(controller, lambda: gpu.elapsed_s)
    # the agent's loop: sleep to the next tick in looks of `watch_s`, tick at once on a wake
    next_at = 0.0
    while gpu.elapsed_s < 60:
        await controller.tick(paced=True)
        next_at = gpu.elapsed_s + max(controller.interval_s, controller.tick_s)
        watch_s = controller.watch_s
        while watch_s is not None and next_at - gpu.elapsed_s > watch_s:
            gpu.advance(watch_s)
            if controller.watched_woke():
                next_at = gpu.elapsed_s
                break
        gpu.advance(max(0.0, next_at - gpu.elapsed_s))
    late = [b - a for a, b in itertools.pairwise(sim_ticks) if a > 20]
    assert min(late) >= controller.tick_s - 1e-9
    assert len(late) <= 40 / 0.4 * 1.1  # about one tick per look, not ten a second
    steady = gpu.processes[2]
    shares = [share for t, share in gpu.shares(steady, 5) if t > 20]
    assert min(shares) == pytest.approx(60, abs=3)


async def test_launch_costs_are_noted_only_where_a_look_comes_before_the_next_tick(
        monkeypatch):
    """Noting each launching device's tokens per launch costs the tick's time: it is done for
    a GPU whose next tick is further off than `max_tick_s` (a look between ticks reads them),
    not at its fast ticks, which see a change of kernels themselves."""
    noted: list[int] = []
    original = module._watch_launch_costs

    def counting(watching, steered):  # type: ignore[no-untyped-def]
        noted.append(len(steered))
        original(watching, steered)

    monkeypatch.setattr(module, "_watch_launch_costs", counting)
    gpu, regions = two_busy(BUSY)
    controller = paced_controller(gpu, regions)
    intervals = await calm_until(controller, gpu, 1.2)  # the first ticks: 0.1 s, then slower
    assert intervals and max(intervals) <= controller.max_tick_s + 1e-9
    assert noted == []
    intervals = await calm_until(controller, gpu, 30.0)
    assert intervals[-1] == pytest.approx(UNLENT_TICK_S)
    assert noted and set(noted) == {2}  # both devices, at each slow tick
    assert sorted(w[0].key for w in controller._watched) == ["a/0", "b/0"]

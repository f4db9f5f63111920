"""The controller on a GPU whose NVML gives each sample period whole to one process, with the
whole GPU's use as its value (measured on an H200 with two processes and no MPS). Read as
per-process samples, a container that was given a period looked as busy as the GPU and was
throttled towards nothing; the shares are judged here by the SM time each really got."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from tests.bench.bench_launch_holds import check_kernels
from tests.bench.bench_throttle import COSTLY, LONG
from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.simulation.gpu import NoShim, SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import (
    ContainerSpec,
    ControlledRun,
    PlantSpec,
    Scenario,
    run_controlled,
)
from vgpu_agent.throttle import timesliced
from vgpu_agent.throttle.controller import ThrottleController

UUID = "GPU-time-sliced"


async def shares(specs, seconds: float = 40.0, period_s: float = 0.2) -> list[float]:
    gpu = SimGpu(UUID, sample_period_s=period_s,
                 imperfections=replace(REAL, nvml_attribution="time-sliced"))
    regions = [SimRegion(f"c{i}", (UUID,), (pct,), (policy,))
               for i, (pct, policy, _) in enumerate(specs)]
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=kernel_s), r)
             for r, (_, _, kernel_s) in zip(regions, specs, strict=True)]
    controller = ThrottleController(SimBackend([gpu]), lambda: regions,
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    for _ in range(round(seconds / 0.1)):
        gpu.advance(0.1)
        await controller.tick()
    assert controller.error_counts == {}
    return [gpu.shares(p, 15)[-1][1] for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize("period_s", [0.2, 1.0])
async def test_two_strict_containers_keep_their_shares_and_neither_starves(period_s):
    small, large = await shares([(30, "strict", 0.0002), (50, "strict", 0.0002)],
                                period_s=period_s)
    assert small == pytest.approx(30, abs=4)
    assert large == pytest.approx(50, abs=4)


@pytest.mark.slow
async def test_work_conserving_containers_still_share_out_the_idle_gpu():
    a, b = await shares([(20, "work-conserving", 0.0002), (20, "work-conserving", 0.0002)])
    assert a + b > 85
    assert min(a, b) > 30


@pytest.mark.slow
async def test_unequal_kernels_are_charged_by_the_periods_they_take():
    # 2 ms kernels against 0.2 ms ones: the same tokens buy ten times the SM time
    small, large = await shares([(30, "strict", 0.0002), (50, "strict", 0.002)], seconds=60)
    assert small > 20  # at first split by tokens alone, then corrected: never starved
    assert large <= 56


def liar_and_honest():
    gpu = SimGpu(UUID, sample_period_s=0.2,
                 imperfections=replace(REAL, nvml_attribution="time-sliced"))
    honest = SimRegion("honest", (UUID,), (40.0,), ("strict",))
    liar = SimRegion("liar", (UUID,), (40.0,), ("strict",))
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=0.0002), r) for r in (honest, liar)]
    controller = ThrottleController(SimBackend([gpu]), lambda: [honest, liar],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    return gpu, procs, liar.processes[0], controller


@pytest.mark.slow
@pytest.mark.parametrize("factor", [10, 100])
async def test_a_container_overstating_its_tokens_leaves_its_neighbours_share_alone(factor):
    # "liar" writes `factor` times what it spent into `state`, from its first tick. Its
    # periods correct what its tokens claim (the costs are learned period by period, its
    # claims are held to its bucket, and a rate that does not bind is halved), so its
    # neighbour keeps its share in every 10 s window of the first 70 s, not only the last,
    # and the liar takes no more than its own after the first.
    gpu, (honest, liar), slot, controller = liar_and_honest()
    for _ in range(700):
        gpu.advance(0.1)
        slot.tokens_spent[0] *= factor
        await controller.tick()
        slot.tokens_spent[0] //= factor
    honest_windows = [share for _, share in gpu.shares(honest, 10)][::100]
    liar_windows = [share for _, share in gpu.shares(liar, 10)][::100]
    assert len(honest_windows) == 7
    assert min(honest_windows) >= 38, honest_windows
    assert max(liar_windows[1:]) <= 43, liar_windows
    assert honest_windows[-1] == pytest.approx(40, abs=3)
    assert 30 <= liar_windows[-1] <= 43  # (its claims held to its cap may leave it below)


async def test_tokens_past_what_the_rate_allowed_are_not_counted():
    # one tick's claim of a thousand times its spending: charged no more than its rate and
    # burst allowed, it cannot make its neighbour look idle for that tick
    gpu, _, slot, controller = liar_and_honest()
    for _ in range(100):
        gpu.advance(0.1)
        await controller.tick()
    honest_key = ("honest", 0)
    readings = []
    for n in range(10):  # a tick with a new sample for the honest container
        gpu.advance(0.1)
        lie = n % 2 == 1
        if lie:
            slot.tokens_spent[0] *= 1000
        await controller.tick()
        if lie:
            slot.tokens_spent[0] //= 1000
        readings.append(controller.status[honest_key].measured_util)
    assert min(r for r in readings if r is not None) > 10


@pytest.mark.slow
async def test_a_container_claiming_no_tokens_does_not_starve_its_neighbour():
    # "liar" leaves its tokens at 0 in `state`, as a container without the shim would: it is
    # charged its part of the periods, smoothly, so the neighbour is not read as using the
    # whole GPU in the periods the liar was not given. The liar cannot be steered by a rate
    # it does not spend; the backstop sees it over its limit.
    gpu, (honest, _), slot, controller = liar_and_honest()
    for _ in range(400):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        slot.tokens_spent[0] = 0
        await controller.tick()
        slot.tokens_spent[0] = spent
    assert gpu.shares(honest, 30)[-1][1] > 25  # 1 % when charged batch by batch
    assert controller.status[("liar", 0)].measured_util > 50  # limit 40 + the backstop's 10


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 25])
async def test_a_tenant_bypassing_the_shim_and_writing_a_token_now_and_then_does_not_starve(
        every):
    # "liar" runs without the shim (its launches held by nothing) and writes one token into
    # `state` every `every` ticks, nothing between. Every tick it spends none (or is paused
    # for its neighbour's turn alone, which counts it as spending none) it is charged its part
    # of the periods. Taken for one without the shim only after a few seconds without a
    # token, it was charged nothing in those ticks and its use fell on its neighbour: held
    # at 0.2-1.4 % of its 40 (`BENCHMARKS.md`).
    gpu, (honest, liar), slot, controller = liar_and_honest()
    liar.gate = NoShim()
    told = 0
    for tick in range(400):
        gpu.advance(0.1)
        told += tick % every == 0
        slot.tokens_spent[0] = slot.launches[0] = told
        await controller.tick()
    assert min(share for t, share in gpu.shares(honest, 10) if t >= 20) > 35


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [20, 1000])
async def test_a_container_understating_its_tokens_leaves_its_neighbours_share_alone(fraction):
    # "liar" writes a fraction of what it spent into `state` (never 0: see the test above),
    # hoping to be charged little of the GPU's use and its neighbour the rest. Its part of the
    # periods, which NVML gives and the host attributes, says what it really used.
    gpu, (honest, liar), slot, controller = liar_and_honest()
    for _ in range(600):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        slot.tokens_spent[0] = max(1, spent // fraction)
        await controller.tick()
        slot.tokens_spent[0] = spent
    assert gpu.shares(honest, 20)[-1][1] == pytest.approx(40, abs=5)
    assert gpu.shares(liar, 20)[-1][1] < 47


def _changing_pair(seed: int, policy: CorePolicy = "work-conserving",
                   back_at_s: float = math.inf) -> ControlledRun:
    """A 40/60 pair whose phases change at 30 s (and back at `back_at_s`): the tokens of
    "costlier" come to buy four times the SM time (twice as long kernels, half the blocks),
    those of "cheaper" a quarter (the bench's scenario 6)."""
    return ControlledRun(
        (ContainerSpec("costlier", 40, LONG, policy, switch_to=COSTLY, switch_at_s=30.0,
                       switch_back_at_s=back_at_s),
         ContainerSpec("cheaper", 60, COSTLY, policy, switch_to=LONG, switch_at_s=30.0,
                       switch_back_at_s=back_at_s)),
        plant=PlantSpec(replace(REAL, nvml_attribution="time-sliced"), seed=seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 3])
async def test_a_change_of_phase_is_followed(seed):
    # Halfway, the tokens of "costlier" start to buy four times the SM time (twice as long
    # kernels, half the blocks) and those of "cheaper" a quarter. Over the last 10 s:
    # costlier at most 54 % for its 40 (seed 0; 35-54 over the last 5 s of seeds 0-9; 39-47
    # over seeds 0-3 while the simulated driver lost 2 % of its periods); 60-66 % when the
    # split's weights were moving averages over 100 periods, which had not forgotten the
    # first phase 30 s later.
    run = _changing_pair(seed)
    await run.advance(40.0)
    # Both figures in doubt are measured afresh one after the other: over 5-10 s after the
    # change cheaper ran at 46-54 % (35-57 over seeds 0-5); when each re-measure waited 3 s
    # (after the doubt, then after the other's turn), at 20-30 %, its neighbour at 44-62 %.
    cheaper_soon = run.gpu.shares(run.procs["cheaper"][-1], 5)[-1][1]
    assert cheaper_soon >= 40
    await run.advance(20.0)
    assert run.controller.error_counts == {}
    costlier, cheaper = (run.gpu.shares(run.procs[name][-1], 10)[-1][1]
                         for name in ("costlier", "cheaper"))
    assert costlier <= 56
    assert cheaper >= 44
    uuid = run.gpu.uuid
    assert run.controller.time_sliced_gpus == {uuid}
    found = run.controller.phase_changes[uuid]
    assert found >= 1
    # the containers gone, the GPU is forgotten; what was found still counts
    run.regions.clear()
    await run.controller.tick()
    assert run.controller.time_sliced_gpus == frozenset()
    assert run.controller.phase_changes == {uuid: found}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 3, 8, 13, 21])
async def test_a_second_change_of_phase_is_measured_too(seed):
    # The strict pair changes phase at 30 s and back at 90 s. The first change's re-measures
    # spent each container's second try; without tries coming back, the one whose tokens came
    # to buy a quarter of the time was charged at its old figure and ran at 9 % of its 40 from
    # the second change to the end (seeds 0, 2-6 and 8-10, each of those tried). With them,
    # at 30 % or more 20-30 s after it in 16 seeds of 24, at 9-10 % in 3 (8 before the law
    # re-learned after turns): there a false alarm of the watch in the minute before the
    # change had spent the tries (which seeds it hits moves with any change to the dynamics),
    # or (seed 3) its turn measured the new figure, the last batch's spending stepped by a
    # launch, and the figure from before the turn was put back. Then 19 and 2. Seed 13: its
    # re-measure spent four and five launches a tick in turn, never steady, and gave no
    # figure; seed 21: a false alarm had spent its try. Now 23 at 30 % or more and none
    # starved; seed 0 at 27.4 (39.8 before): right after both turns the watch took the costs
    # still catching up for a change of both, both figures were raised and both containers
    # held under their limits to the end. With the watch not asked while costs it cut
    # re-learn: 35.1-41.6 over these seeds.
    run = _changing_pair(seed, "strict", back_at_s=90.0)
    await run.advance(120.0)
    assert run.controller.error_counts == {}
    costlier = sum(run.gpu.shares(p, 10)[-1][1] for p in run.procs["costlier"])
    assert costlier >= 30  # starved, it ran at 9-10 %


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2])
async def test_costs_relearning_after_a_change_are_not_taken_for_another(seed):
    # After each change the watch cut both costs, and 5-10 s on, while they were still
    # re-learning, took their departures from the periods for a second change: both figures
    # were put in doubt again, and the pair ended at 27.4 / 54.8 and 31.9 / 51.7 % of their
    # 40 / 60 (four changes found, two of them real). The watch now waits for the costs it cut.
    run = _changing_pair(seed, "strict", back_at_s=90.0)
    await run.advance(120.0)
    assert run.controller.phase_changes == {run.gpu.uuid: 2}
    costlier, cheaper = (sum(run.gpu.shares(p, 10)[-1][1] for p in run.procs[name])
                         for name in ("costlier", "cheaper"))
    assert costlier >= 35 and cheaper >= 55, (costlier, cheaper)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7, 18])
async def test_a_neighbours_stale_figure_does_not_let_a_strict_container_run_over(seed):
    # At the change back the cheaper container's tokens come to buy four times more, and it
    # runs over its strict 60 until its periods show the change and its turn measures it
    # (2-4 s). Its neighbour's figure, four times too heavy now, stood in doubt while that
    # one waited for a try, and shared by the figures the cheaper one was charged 57 for
    # the 75-84 it did: 81-87 % over its worst 10 s in 8 seeds of 24. Now at most 73.
    run = _changing_pair(seed, "strict", back_at_s=90.0)
    await run.advance(120.0)
    cheaper = [sum(values) for values in zip(*(
        [share for end_s, share in run.gpu.shares(p, 10) if end_s >= 90.0]
        for p in run.procs["cheaper"]), strict=True)]
    assert max(cheaper) <= 70


async def test_a_gpu_whose_samples_are_per_process_is_not_read_as_time_sliced():
    # two processes on one stamp: per-process samples (the split is dropped, nothing counted)
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=REAL)
    regions = [SimRegion(f"c{i}", (UUID,), (40.0,), ("strict",)) for i in range(2)]
    for region in regions:
        gpu.shim_process(region.alloc_id, Workload(kernel_s=0.0002), region)
    controller = ThrottleController(SimBackend([gpu]), lambda: regions,
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    for _ in range(30):
        gpu.advance(0.1)
        await controller.tick()
    assert controller.time_sliced_gpus == frozenset()
    assert controller.phase_changes == {}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_a_borrower_cut_back_when_the_owner_wakes_is_not_starved(seed):
    # The borrower has the GPU alone for 30 s, then the owner wakes. While the owner was idle
    # the driver listed its process at 0 beside the borrower's in each period: read as proof
    # of per-process samples, that made the next periods (each given whole to one process,
    # the GPU's whole use as its value) look like the borrower using all of the GPU on ever
    # less spending; its k fell a hundredfold, then its zero readings looked like samples
    # NVML missed, and it ran at 0.2 % for its 30 until the end (seed 0).
    long = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)
    owner = Workload(kernel_s=0.002, blocks=2048, threads_per_block=128,
                     busy=((30.0, float("inf")),))
    run = ControlledRun(
        (ContainerSpec("borrower", 30, long), ContainerSpec("owner", 70, owner)),
        plant=PlantSpec(replace(REAL, nvml_sigma=3.0, nvml_attribution="time-sliced"),
                        sample_period_s=1.0, seed=seed))
    await run.advance(50.0)
    borrower, owned = (run.gpu.shares(run.procs[name][0], 10)[-1][1]
                       for name in ("borrower", "owner"))
    assert borrower == pytest.approx(30, abs=5)
    assert owned == pytest.approx(70, abs=5)


class _Missing(SimBackend):
    """The simulated driver, with the busy process's sample missed in chosen reads (NVML's
    buffer is finite): only the idle process, listed at 0, is left in them."""

    def __init__(self, gpu: SimGpu, pid: int):
        super().__init__([gpu])
        self.pid, self.missed = pid, set()

    def process_utilization(self, uuid, since_us):
        samples = super().process_utilization(uuid, since_us)
        mine = [s.timestamp_us for s in samples if s.pid == self.pid]
        if since_us and len(samples) > 1 and mine and len(self.missed) < 3:
            self.missed.add(mine[-1])
        return [s for s in samples if not (s.pid == self.pid and s.timestamp_us in self.missed)]


async def test_a_missed_sample_beside_an_idle_process_is_not_an_idle_period():
    gpu = SimGpu(UUID, sample_period_s=0.2,
                 imperfections=replace(REAL, nvml_sigma=0.0, missed_samples=0.0,
                                       nvml_attribution="time-sliced"))
    busy = SimRegion("busy", (UUID,), (30.0,), ("work-conserving",))
    idle = SimRegion("idle", (UUID,), (70.0,), ("work-conserving",))
    proc = gpu.shim_process("busy", Workload(kernel_s=0.002), busy)
    gpu.shim_process("idle", Workload(kernel_s=0.002, busy=((1e6, 2e6),)), idle)
    backend = _Missing(gpu, proc.pid)
    controller = ThrottleController(backend, lambda: [busy, idle], clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]), nvml_poll_periods=2)
    seen = []
    for _ in range(100):
        gpu.advance(0.1)
        await controller.tick()
        measured = controller.status[("busy", 0)].measured_util
        if measured is not None:
            seen.append(measured)
    assert len(backend.missed) == 3
    # alone on the GPU, it uses all of it, missed samples or not (50 when one of a batch's
    # two periods was read as idle, and 0 for a read of the idle process alone; its k then
    # doubled)
    assert min(seen[5:]) > 90
    assert gpu.shares(proc, 2)[-1][1] > 90


@pytest.mark.parametrize("attribution", ["time-sliced", "per-process"])
async def test_split_shares_are_followed_at_once_and_samples_wait_for_confirmation(attribution):
    # A far-off reading waits for the next to confirm it where it is one of NVML's samples
    # (skewed for a small share); a time-sliced GPU's split shares are estimates, and a jump
    # there is the split re-learning, which the law follows at once.
    gpu = SimGpu(UUID, sample_period_s=0.2,
                 imperfections=replace(REAL, nvml_attribution=attribution))
    regions = [SimRegion(f"c{i}", (UUID,), (pct,), ("strict",)) for i, pct in enumerate((30, 50))]
    for region in regions:
        gpu.shim_process(region.alloc_id, Workload(kernel_s=0.0002), region)
    controller = ThrottleController(SimBackend([gpu]), lambda: regions,
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    law, confirming = controller.law, []

    def recording(observations, states, dt_s, params):
        confirming.append(params.confirm_surprises)
        return law(observations, states, dt_s, params)

    controller.law = recording
    for _ in range(50):
        gpu.advance(0.1)
        await controller.tick()
    assert controller.params.confirm_surprises  # the agent's own tuning is left alone
    split = attribution == "time-sliced"
    assert (UUID in controller.time_sliced_gpus) == split
    assert confirming[-20:] == [not split] * 20


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 4])
async def test_a_heavy_strict_container_measured_first_is_held_once_its_neighbour_is_measured(
        seed, monkeypatch):
    # A GPU whose use is all work (no holds), a strict 50 % container of 200 us kernels
    # measured first beside a strict 30 % one of 20 us. Until the neighbour has a figure it is
    # charged at the first's figure times costs learned over tens of seconds, and the first's
    # share, diluted by that estimate, ran over its limit (highest 5 s from 15 s on: 57.6 and
    # 62.5) while turns waited a minute. Costs twofold apart bring the neighbour's turn 3 s on
    # (48.7 and 50.5; 48.7-52.9 over seeds 0-15, the first's `k` re-learned where the
    # neighbour's figure moved its charge).
    async def highest_from_15_s() -> float:
        limits = {"c0": 50.0, "c1": 30.0}
        specs = (ContainerSpec("c0", 50, check_kernels(200e-6), policy="strict"),
                 ContainerSpec("c1", 30, check_kernels(20e-6), policy="strict"))
        imperfections = replace(REAL, nvml_attribution="time-sliced", nvml_sigma=3.0)
        run = await run_controlled(Scenario("heavy first", specs, lambda n, t: limits[n], 40.0),
                                   plant=PlantSpec(imperfections, 1 / 6, seed=seed), paced=True)
        assert not run.errors, run.errors
        got = [share for t, share in run.series["c0"] if t > 15]
        return max(statistics.fmean(got[n:n + 50]) for n in range(len(got) - 49))

    assert await highest_from_15_s() <= 50 + 2
    monkeypatch.setattr(timesliced, "_LOG_APART", math.inf)  # costs never far enough apart
    assert await highest_from_15_s() > 55

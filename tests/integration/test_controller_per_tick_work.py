"""What the controller does each tick, and what it does only once: rates written only when they
change (and rewritten when someone else changed them), limits read once per region, the regions
read on the loop in chunks and NVML in one worker hop per tick while it is slow, and counters that restart from a baseline after a
region could not be read."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.fakes.clock import ManualClock
from tests.fakes.hostproc import FakeHostProc
from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm.api import CorePolicy, RegionUsage
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import SIM_UUID
from vgpu_agent.throttle import controller as controller_module
from vgpu_agent.throttle.control import UNLIMITED_RATE, LoopState, Observation
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.fastlaw import control_step_gpu

GIB = 1 << 30
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
BUSY = Workload(kernel_s=0.002)


class Samples:
    """A backend serving fixed per-process utilization, recording the threads it is called on."""

    def __init__(self, util: dict[int, int]):
        self.util = util
        self.now_us = 1_000
        self.threads: set[int] = set()
        self.asked: dict[str, int] = {}  # calls per GPU

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self.threads.add(threading.get_ident())
        self.asked[uuid] = self.asked.get(uuid, 0) + 1
        self.now_us += 100_000
        return [ProcessSample(pid, self.now_us, util) for pid, util in self.util.items()]


def file_region(root: Path, seq: int, uuids: tuple[str, ...], percent: float = 25.0) -> Region:
    ids = [f"{uuid}::{seq}" for uuid in uuids]
    alloc_id = format_alloc_id(seq, ids, 1_000 + seq)
    make_region(root, alloc_id, [DeviceSpec(u, 4 * GIB, percent, "strict") for u in uuids], ids,
                seq=seq)
    return Region.open(root / alloc_id)


async def test_unchanged_rates_are_not_rewritten(tmp_path):
    region = file_region(tmp_path, 1, (UUID_A,))
    clock = ManualClock()
    controller = ThrottleController(Samples({}), lambda: [region], clock=clock)
    try:
        # Idle: no model, so the never-configured rate becomes "unlimited" once and stays.
        clock.advance(0.1)
        await controller.tick()
        assert region.rate(0) == (UNLIMITED_RATE, UNLIMITED_RATE)
        generation = region.generation
        for _ in range(10):
            clock.advance(0.1)
            await controller.tick()
        assert region.generation == generation  # nothing changed, nothing written
        # while the heartbeat still goes out, once a second
        assert 0 <= clock.ns - region.heartbeat_ns < controller.heartbeat_ns
    finally:
        region.close()


class CountingRegion(SimRegion):
    """A region that counts how often its limits are read."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.limit_reads = 0
        self.policy_reads = 0

    def core_limit(self, dev: int) -> float:
        self.limit_reads += 1
        return super().core_limit(dev)

    def policy(self, dev: int) -> CorePolicy:
        self.policy_reads += 1
        return super().policy(dev)


class Steered:
    """One simulated GPU, one container in `region`, the real controller; regions swappable."""

    def __init__(self, region: SimRegion):
        self.gpu = SimGpu(SIM_UUID)
        self.region = region
        self.gpu.shim_process("c", BUSY, region)
        self.controller = ThrottleController(SimBackend([self.gpu]), lambda: [self.region],
                                             clock=lambda: self.gpu.now_ns,
                                             evidence=SimHostEvidence([self.gpu]))

    async def advance(self, ticks: int) -> None:
        for _ in range(ticks):
            self.gpu.advance(0.1)
            await self.controller.tick()


async def test_limits_are_read_once_per_region_and_again_for_a_reopened_one():
    counting = CountingRegion("a", (SIM_UUID,), (40.0,), ("strict",))
    run = Steered(counting)
    await run.advance(20)
    # The limit never changes; policy and priority do when the pod's annotations change, so
    # they are read at every tick (a lookup in the region object, no file read).
    assert (counting.limit_reads, counting.policy_reads) == (1, 20)
    assert run.controller.status[("a", 0)].limit == 40

    # The same allocation under a new handle (reopened): its limits are read from it.
    reopened = CountingRegion("a", (SIM_UUID,), (20.0,), ("strict",),
                              processes=counting.processes, rates=counting.rates)
    run.region = reopened
    await run.advance(10)
    assert (reopened.limit_reads, reopened.policy_reads) == (1, 10)
    assert run.controller.status[("a", 0)].limit == 20
    assert counting.limit_reads == 1  # the old handle is no longer asked


async def test_a_rate_changed_behind_its_back_is_put_back_on_the_next_tick():
    region = SimRegion("s", (SIM_UUID,), (40.0,), ("strict",))
    run = Steered(region)
    await run.advance(30)
    decided = run.controller.status[("s", 0)]
    assert region.rates[0] == (decided.rate, decided.burst)
    writes = region.rate_writes

    region.rates[0] = (1234, 56)  # a previous agent, a stray tool: not this controller
    await run.advance(1)
    now = run.controller.status[("s", 0)]
    assert region.rates[0] == (now.rate, now.burst) != (1234, 56)
    assert now.rate == pytest.approx(decided.rate, rel=0.2)  # the model was not thrown off
    assert region.rate_writes == writes + 1


class FlakyRegion(SimRegion):
    """A region whose `state` cannot be read while `broken` is set."""

    broken: bool = False

    def usage(self) -> RegionUsage:
        if self.broken:
            raise OSError("state file vanished")
        return super().usage()

    def counters(self) -> tuple[int, ...]:
        if self.broken:
            raise OSError("state file vanished")
        return super().counters()


async def test_a_region_unreadable_for_a_tick_restarts_from_a_baseline():
    seen: list[Observation] = []

    def spy(observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        seen.extend(observations)
        return control_step_gpu(observations, states, dt_s, params)

    flaky = FlakyRegion("f", (SIM_UUID,), (50.0,), ("strict",))
    run = Steered(flaky)
    run.controller.law = spy
    await run.advance(10)
    assert seen[-1].spent > 0  # steady: every tick counts what it spent

    flaky.broken = True
    await run.advance(5)  # the shim goes on spending while nobody can read it
    flaky.broken = False
    seen.clear()
    await run.advance(1)
    # What was spent unseen is not charged to one tick: the first reading is a baseline.
    assert [o.spent for o in seen] == [0]
    await run.advance(1)
    assert seen[-1].spent > 0
    assert run.controller.error_counts["region_usage"] == 5
    assert ("f", 0) in run.controller.status


@pytest.mark.parametrize("cheap", [False, True])
async def test_slow_nvml_takes_one_worker_hop_per_tick_cheap_nvml_none_and_regions_none(
    tmp_path, monkeypatch, cheap
):
    regions = [file_region(tmp_path, 1, (UUID_A,)), file_region(tmp_path, 2, (UUID_B,)),
               file_region(tmp_path, 3, (UUID_A, UUID_B))]
    shims = [ShimWriter(r.path) for r in regions]
    for n, shim in enumerate(shims):
        shim.process(0, 100 + n, 5_000 + n, 0, tokens=1_000)
    backend = Samples({5_000: 30, 5_001: 20, 5_002: 10})
    host = FakeHostProc(tmp_path / "proc")
    for n, region in enumerate(regions):
        host.container_process(5_000 + n, region.path, inner_pid=100 + n)
    hops = {"n": 0}
    real_to_thread = asyncio.to_thread

    async def counting_to_thread(func, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        hops["n"] += 1
        return await real_to_thread(func, *args, **kwargs)

    monkeypatch.setattr(controller_module.asyncio, "to_thread", counting_to_thread)
    read_on: set[int] = set()  # the threads each region's `state` header was read on
    for region in regions:
        def counters(real=region.counters):  # type: ignore[no-untyped-def]
            read_on.add(threading.get_ident())
            return real()
        region.counters = counters  # type: ignore[method-assign]
    clock = ManualClock()
    # "slow": any NVML call counts as slow; "cheap": any counts as cheap
    controller = ThrottleController(backend, lambda: regions, clock=clock,
                                    inline_read_s=60.0 if cheap else 0.0, proc_root=host.path)
    try:
        for _ in range(4):
            clock.advance(0.1)
            await controller.tick()
        if cheap:
            # the first tick cannot know what reads cost: one hop, then none
            assert hops["n"] == controller.hops == 1
            assert threading.get_ident() in backend.threads
        else:
            assert hops["n"] == controller.hops == 4  # two GPUs, three regions: one hop a tick
            assert threading.get_ident() not in backend.threads
        assert read_on == {threading.get_ident()}  # the regions, always on the loop
        # every call counted for its GPU, made on the loop or in the worker
        calls = controller.nvml_utilization_calls
        assert {uuid: made for uuid, (made, _) in calls.items()} == backend.asked
        assert set(backend.asked) == {UUID_A, UUID_B}
        assert all(seconds > 0 for _, seconds in calls.values())
        status = controller.status
        assert status[(regions[0].alloc_id, 0)].measured_util == 30
        assert status[(regions[1].alloc_id, 0)].measured_util == 20
        assert status[(regions[2].alloc_id, 0)].uuid == UUID_A
        assert status[(regions[2].alloc_id, 1)].uuid == UUID_B
        assert controller.error_counts == {}
    finally:
        for shim in shims:
            shim.close()
        for region in regions:
            region.close()


async def test_an_unexpected_nvml_failure_in_the_worker_is_counted_and_logged_once_in_full():
    region = SimRegion("r", ("GPU-x",), (30.0,), ("strict",))

    class Broken:
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            time.sleep(0.002)  # a driver in trouble takes its time to fail
            raise RuntimeError("driver returned garbage")

    clock = ManualClock()
    controller = ThrottleController(Broken(), lambda: [region], clock=clock)
    with capture_logs() as logs:
        for _ in range(3):
            clock.advance(0.1)
            await controller.tick()
    assert controller.error_counts["nvml"] == 3
    # failed calls cost the node too: counted with the time they took
    made, seconds = controller.nvml_utilization_calls["GPU-x"]
    assert made == 3 and seconds >= 3 * 0.002
    failures = [e for e in logs if e["event"] == "throttle_nvml_failed"]
    assert len(failures) == 3
    assert failures[0].get("exc_info")  # the first with its traceback
    assert "exc_info" not in failures[1] and failures[1]["failures"] == 2
    assert 0 <= clock.ns - region.heartbeat_ns < controller.heartbeat_ns
    assert region.rates[0] == (UNLIMITED_RATE, UNLIMITED_RATE)


def test_a_closed_region_refuses_rate_reads_and_beats(tmp_path):
    region = file_region(tmp_path, 1, (UUID_A,))
    region.beat(7)
    assert region.heartbeat_ns == 7
    with pytest.raises(ValueError, match="-1 is not allowed"):
        region.beat(-1)
    region.close()
    with pytest.raises(Exception, match="is closed"):
        region.rate(0)
    with pytest.raises(Exception, match="is closed"):
        region.beat(8)


def _strict_node(gpu: SimGpu, shares: tuple[tuple[str, float], ...], poll_periods: int
                 ) -> tuple[list, SimBackend, ThrottleController]:
    """Strict containers busy on `gpu` at `shares`, steered by a controller asking NVML every
    `poll_periods` periods: their processes, the driver (counting its calls), the controller."""
    regions = [SimRegion(name, (SIM_UUID,), (pct,), ("strict",)) for name, pct in shares]
    procs = [gpu.shim_process(r.alloc_id, BUSY, r) for r in regions]
    backend = SimBackend([gpu])
    controller = ThrottleController(backend, lambda: regions, clock=lambda: gpu.now_ns,
                                    evidence=SimHostEvidence([gpu]),
                                    nvml_poll_periods=poll_periods)
    return procs, backend, controller


async def _calls_each_second(gpu: SimGpu, backend: SimBackend,
                             controller: ThrottleController, seconds: int) -> list[int]:
    """Tick every 0.1 s for `seconds`: NVML's calls in each second."""
    per_second = []
    for _ in range(seconds):
        before = backend.calls
        for _ in range(10):
            gpu.advance(0.1)
            await controller.tick()
        per_second.append(backend.calls - before)
    return per_second


@pytest.mark.parametrize(("period_s", "poll_periods"),
                         [(1.0, 1), (0.2, 1), (1 / 6, 1), (0.2, 2), (1 / 6, 3)])
async def test_nvml_is_asked_once_a_period_not_every_tick(period_s, poll_periods):
    # The call costs about 2 ms of CPU on a real driver, whatever it returns: ticks between
    # two of NVML's periods do without it, and the shares are held all the same. Asked every
    # few periods (`nvml_poll_periods`), it answers with the samples in between.
    gpu = SimGpu(SIM_UUID, sample_period_s=period_s)
    procs, backend, controller = _strict_node(gpu, (("a", 30.0), ("b", 50.0)), poll_periods)

    async def calls_in(seconds: float) -> int:
        before = backend.calls
        for _ in range(round(seconds / 0.1)):
            gpu.advance(0.1)
            await controller.tick()
        return backend.calls - before

    await calls_in(5)  # learning the period (the simulated driver keeps no history before)
    polls = 10 / period_s / poll_periods
    assert polls - 1 <= await calls_in(10) <= polls + 2  # one a tick would be 100
    # the controller's own count (`vgpu_gpu_nvml_process_utilization_calls_total`) is the driver's
    assert controller.nvml_utilization_calls[SIM_UUID][0] == backend.calls
    assert [gpu.shares(p, 5)[-1][1] for p in procs] == pytest.approx([30, 50], abs=2)


@pytest.mark.parametrize("seed", [0, 1])
async def test_asked_every_few_periods_a_gpu_still_learning_is_asked_every_period(seed):
    # NVML every other period (`nvml_poll_periods` 2) on a noisy plant (sigma 8): after the
    # cold start every period is asked for while the estimates are loose, every other period
    # once they are tight, and the shares are held.
    gpu = SimGpu(SIM_UUID, imperfections=replace(REAL, nvml_sigma=8.0), seed=seed)
    procs, backend, controller = _strict_node(
        gpu, (("a", 20.0), ("b", 30.0), ("c", 50.0)), poll_periods=2)
    per_second = await _calls_each_second(gpu, backend, controller, 20)
    assert min(per_second[:2]) >= 6  # every period (6 a second) while learning
    assert sum(per_second[10:]) <= 33  # every other period once tight: 30, not 60
    assert [gpu.shares(p, 10)[-1][1] for p in procs] == pytest.approx([20, 30, 50], abs=2.5)


@pytest.mark.parametrize(("containers", "calls_a_second"), [(2, 6), (1, 3)])
async def test_a_time_sliced_gpu_shared_by_two_is_asked_every_period(containers, calls_a_second):
    # Read two periods at once, a time-sliced driver answers one sample per process for both
    # (who was given which is lost): where two containers spend, every period is asked for
    # whatever `nvml_poll_periods` says, and the GPU is steered as if it were 1; a container
    # alone reads the same either way, and is asked every other period.
    async def run(poll_periods: int) -> tuple[list[int], list[float]]:
        gpu = SimGpu(SIM_UUID, imperfections=replace(REAL, nvml_sigma=0.0,
                                                     nvml_attribution="time-sliced"))
        procs, backend, controller = _strict_node(
            gpu, (("a", 30.0), ("b", 50.0))[:containers], poll_periods)
        calls = await _calls_each_second(gpu, backend, controller, 15)
        return calls, [gpu.shares(p, 5)[-1][1] for p in procs]

    calls, shares = await run(2)
    assert calls[5:] == [calls_a_second] * 10
    every_period = await run(1)
    if containers == 2:
        assert (calls, shares) == every_period
    else:
        assert shares == pytest.approx([30], abs=1)
        assert every_period[0][5:] == [6] * 10


@pytest.mark.parametrize(("state", "loose"), [
    (LoopState(), False),  # never spent: nothing to learn from samples
    (LoopState(tokens_per_pct=1e5, target=50.0, spread=0.03**2), False),  # 1.5 points
    (LoopState(tokens_per_pct=1e5, target=50.0, spread=0.05**2), True),  # 2.5 points
    (LoopState(tokens_per_pct=1e5, target=5.0, spread=0.3**2), False),  # a small share
    (LoopState(tokens_per_pct=1e5, target=50.0, spread=0.0, lower_bound=True), True),
    (LoopState(tokens_per_pct=1e5, target=50.0, spread=0.0, surprise=-12.0), True),
])
def test_a_gpu_is_loose_while_a_share_is_uncertain_by_more_than_two_points(state, loose):
    calm = LoopState(tokens_per_pct=2e5, target=30.0, spread=0.01**2)
    assert controller_module._loose([calm, state]) is loose
    assert controller_module._loose([calm]) is False


@pytest.mark.parametrize(("spent", "launches", "changed"), [
    (100 * 2_000, 100, True),  # each launch twice as dear: new kernels, NVML's news to come
    (100 * 400, 100, True),  # a third
    (100 * 1_200, 100, False),  # within LAUNCH_COST_MOVE
    (7 * 4_000, 7, False),  # too few launches to tell
])
def test_a_gpu_whose_kernels_changed_is_loose(spent, launches, changed):
    before = {"a": LoopState(tokens_per_pct=1e5, cost_per_launch=1_000.0),
              "new": LoopState()}
    observations = [Observation("a", 30.0, "strict", spent=spent, launches=launches),
                    Observation("new", 30.0, "strict", spent=50_000, launches=50)]
    assert controller_module._kernels_changed(observations, before) is changed
    assert controller_module._kernels_changed(observations, {}) is False


@pytest.mark.parametrize("periods", [0, 11, 1.5, True])
def test_nvml_poll_periods_out_of_range_are_refused(periods):
    with pytest.raises(ValueError, match="from 1 to 10"):
        ThrottleController(SimBackend([]), list, nvml_poll_periods=periods)


async def tick_beside(controller: ThrottleController, each_turn: Callable[[], None]) -> None:
    """One tick, with another task on the loop calling `each_turn` whenever it runs."""
    done = asyncio.Event()

    async def another_task() -> None:
        while not done.is_set():
            each_turn()
            await asyncio.sleep(0)

    other = asyncio.create_task(another_task())
    await asyncio.sleep(0)
    await controller.tick()
    done.set()
    await other


async def test_the_loop_runs_between_chunks_of_region_reads():
    """Allocate and scrapes wait for one chunk of reads at most, not for all of a busy node's."""
    regions = [SimRegion(f"r{n}", ("GPU-x",), (1.0,), ("strict",))
               for n in range(2 * controller_module.READ_CHUNK + 5)]
    read = {"n": 0}
    for region in regions:
        def counters(real=region.counters):  # type: ignore[no-untyped-def]
            read["n"] += 1
            return real()
        region.counters = counters  # type: ignore[method-assign]
    controller = ThrottleController(Samples({}), lambda: regions, clock=ManualClock())
    seen_between: list[int] = []
    await tick_beside(controller, lambda: seen_between.append(read["n"]))
    assert read["n"] == len(regions)
    chunk = controller_module.READ_CHUNK
    # it ran after the first chunk and after the second, before all were read
    assert chunk in seen_between and 2 * chunk in seen_between


async def test_the_loop_runs_between_one_gpus_steering_and_the_next():
    """Allocate and scrapes wait for one GPU's steering at most, not for all eight."""
    regions = [SimRegion(f"r{n}", (f"GPU-{n % 8}",), (10.0,), ("strict",)) for n in range(24)]
    controller = ThrottleController(Samples({}), lambda: regions, clock=ManualClock())
    order: list[str] = []
    steer = controller._steer_gpu

    def steering(uuid, *args):  # type: ignore[no-untyped-def]
        order.append(uuid)
        return steer(uuid, *args)
    controller._steer_gpu = steering  # type: ignore[method-assign]

    def loop_ran() -> None:
        if order and order[-1] != "loop":
            order.append("loop")

    await tick_beside(controller, loop_ran)
    steered = [entry for entry in order if entry != "loop"]
    assert sorted(steered) == [f"GPU-{n}" for n in range(8)]
    # after every GPU but the last, the other task ran before the next GPU was steered
    assert order[: 2 * 8 - 1] == [e for gpu in steered for e in (gpu, "loop")][: 2 * 8 - 1]


def test_a_controller_without_its_c_parts_says_so_once_each(monkeypatch):
    """Installed without a compiler: the same law, steering and read in Python, slower."""
    monkeypatch.setattr(controller_module, "NATIVE", False)
    monkeypatch.setattr(controller_module, "NOT_NATIVE_REASON", "built from another version")
    monkeypatch.setattr(controller_module, "NATIVE_STEERING", False)
    monkeypatch.setattr(controller_module, "NOT_NATIVE_STEERING_REASON", "steering: no compiler")
    monkeypatch.setattr(controller_module, "NATIVE_READ", False)
    monkeypatch.setattr(controller_module, "NOT_NATIVE_READ_REASON", "read: another layout")
    monkeypatch.setattr(controller_module, "NATIVE_SPLIT", False)
    monkeypatch.setattr(controller_module, "NOT_NATIVE_SPLIT_REASON", "split: no compiler")
    with capture_logs() as logs:
        controller = ThrottleController(Samples({}), list)
    events = [e["event"] for e in logs]
    assert events == ["throttle_law_not_native", "throttle_steering_not_native",
                      "throttle_read_not_native", "throttle_split_not_native"]
    # each says why
    assert [e["reason"] for e in logs] == ["built from another version", "steering: no compiler",
                                           "read: another layout", "split: no compiler"]
    assert not controller.native_steering  # (it steers every device in Python)
    # a C read built before its batch read: said once, with why (the header read stays C)
    monkeypatch.setattr(controller_module, "NATIVE_READ", True)
    monkeypatch.setattr(controller_module, "NOT_BATCH_READ_REASON", "built before batches")
    with capture_logs() as logs:
        ThrottleController(Samples({}), list)
    assert [(e["event"], e["reason"]) for e in logs if "read" in e["event"]] == [
        ("throttle_batch_read_not_native", "built before batches")]
    monkeypatch.setattr(controller_module, "NOT_BATCH_READ_REASON", None)
    monkeypatch.setattr(controller_module, "NATIVE", True)
    monkeypatch.setattr(controller_module, "NATIVE_STEERING", True)
    monkeypatch.setattr(controller_module, "NATIVE_READ", True)
    monkeypatch.setattr(controller_module, "NATIVE_SPLIT", True)
    with capture_logs() as logs:
        ThrottleController(Samples({}), list)
    assert logs == []


class Closable(SimRegion):
    """A simulated region the store can close (collect) while a tick is under way; a closed
    region reads as nothing, as `Region.counters` does."""

    closed = False

    def counters(self) -> tuple[int, ...] | None:  # type: ignore[override]
        return None if self.closed else super().counters()


async def test_a_region_collected_between_chunks_of_reads_is_skipped_not_an_error():
    regions = [Closable(f"r{n}", ("GPU-x",), (1.0,), ("strict",))
               for n in range(controller_module.READ_CHUNK + 8)]
    last = regions[-1]
    controller = ThrottleController(Samples({}), lambda: regions, clock=ManualClock())

    async def collect() -> None:  # runs at the tick's first yield, after the first chunk
        last.closed = True

    collecting = asyncio.create_task(collect())
    await controller.tick()
    await collecting
    assert controller.error_counts == {}
    steered = {alloc_id for alloc_id, _ in controller.status}
    assert steered == {r.alloc_id for r in regions[:-1]}


async def test_slow_nvml_stays_off_the_loop_through_ticks_that_ask_it_nothing():
    """NVML's period here is a second, so most ticks ask it nothing: those must not make the
    next tick, which asks every GPU, call it on the loop (at 2 ms a call on a real driver,
    eight GPUs held the loop 18 ms, and Allocate waited)."""

    class SlowOncePerSecond(Samples):
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            self.threads.add(threading.get_ident())
            time.sleep(0.003)
            return [ProcessSample(pid, self.now_us, util) for pid, util in self.util.items()]

    regions = [SimRegion(f"r{n}", (uuid,), (20.0,), ("strict",))
               for n, uuid in enumerate((UUID_A, UUID_B))]
    backend = SlowOncePerSecond({5_000: 10})
    clock = ManualClock()
    # one call cheap enough alone, two (every GPU) not
    controller = ThrottleController(backend, lambda: regions, clock=clock, inline_read_s=0.005)
    for tick in range(40):
        clock.advance(0.1)
        if tick % 10 == 0:
            backend.now_us += 1_000_000  # a new sample each second
        await controller.tick()
    assert backend.threads and threading.get_ident() not in backend.threads
    assert controller.hops >= 4

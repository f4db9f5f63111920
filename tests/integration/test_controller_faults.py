"""Faults inside the controller's own work: one GPU's steering, a heartbeat, the figure file, a
whole tick. Each is counted and logged, the rest of the node is still steered, and the work
comes back once the fault is gone."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from structlog.testing import capture_logs

from tests.bench.bench_launch_holds import scenario
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, SimProcess, Workload
from vgpu_agent.simulation.imperfections import H200_TIME_SLICED, IDEAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import ControlledRun, PlantSpec
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.figurefile import FigureFile

BUSY = Workload(kernel_s=0.002)


class _Node:
    """Two simulated GPUs, one strict 30 % container each, one controller for both."""

    def __init__(self, second: type[SimRegion] = SimRegion) -> None:
        self.gpus = [SimGpu(uuid, imperfections=IDEAL) for uuid in ("GPU-a", "GPU-b")]
        self.regions = [kind(f"c{n}", (gpu.uuid,), (30.0,), ("strict",), seq=n)
                        for n, (gpu, kind) in enumerate(zip(self.gpus, (SimRegion, second),
                                                            strict=True))]
        self.procs: list[SimProcess] = [
            gpu.shim_process(f"p{n}", BUSY, region)
            for n, (gpu, region) in enumerate(zip(self.gpus, self.regions, strict=True))]
        self.controller = ThrottleController(
            SimBackend(self.gpus), lambda: list(self.regions), clock=lambda: self.gpus[0].now_ns,
            evidence=SimHostEvidence(self.gpus))

    async def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.1)):
            for gpu in self.gpus:
                gpu.advance(0.1)
            await self.controller.tick()

    def share(self, n: int, last_s: float = 1.0) -> float:
        return self.gpus[n].shares(self.procs[n], last_s)[-1][1]


async def test_a_gpu_whose_steering_fails_is_counted_and_the_others_are_still_steered():
    node = _Node()
    controller = node.controller
    steer = controller._steer_gpu

    def failing(uuid, *args, **kwargs):  # type: ignore[no-untyped-def]
        if uuid == "GPU-a":  # the first GPU steered: the ones after it must still be
            raise RuntimeError("steering broke")
        return steer(uuid, *args, **kwargs)

    controller._steer_gpu = failing  # type: ignore[method-assign]
    with capture_logs() as logs:
        await node.advance(4)
    assert node.share(1) == pytest.approx(30, abs=2)
    assert node.share(0) > 90  # never steered: as unthrottled as it started
    failures = controller.error_counts["gpu"]
    assert failures >= 30
    said = [e for e in logs if e["event"] == "throttle_gpu_failed"]
    assert {e["uuid"] for e in said} == {"GPU-a"}
    # the first with its traceback, the rest counted without one
    assert said[0]["log_level"] == "error" and "exc_info" in said[0]
    assert said[-1]["log_level"] == "warning" and said[-1]["failures"] == failures
    # both still beat: a failed GPU's containers are not left for dead
    assert all(0 <= node.gpus[0].now_ns - r.heartbeat_ns < controller.heartbeat_ns
               for r in node.regions)
    # the fault gone, the GPU is steered again
    controller._steer_gpu = steer  # type: ignore[method-assign]
    await node.advance(5)
    assert node.share(0) == pytest.approx(30, abs=2)
    assert node.share(1) == pytest.approx(30, abs=2)
    assert controller.error_counts["gpu"] == failures


class _Unbeaten(SimRegion):
    def beat(self, now_ns: int) -> None:
        raise OSError("control file gone read-only")


async def test_a_heartbeat_that_fails_is_counted_and_the_container_is_still_steered():
    node = _Node(second=_Unbeaten)
    beaten = node.regions[0]
    node.regions.reverse()  # the failing one is listed, and beaten, first
    with capture_logs() as logs:
        await node.advance(4)
    assert node.controller.error_counts["beat"] >= 3  # beats go out once a second
    assert {e["alloc_id"] for e in logs if e["event"] == "throttle_beat_failed"} == {"c1"}
    assert node.share(1) == pytest.approx(30, abs=2)
    assert node.share(0) == pytest.approx(30, abs=2)
    assert 0 <= node.gpus[0].now_ns - beaten.heartbeat_ns < 10**9


async def test_a_figure_file_that_cannot_be_written_is_retried_and_nothing_is_lost(tmp_path):
    # the figure file's directory is a regular file: every write fails, as on a full or
    # read-only disk
    blocked = tmp_path / "state"
    blocked.write_text("not a directory")
    store = FigureFile(blocked / "figures.json")
    sc, _ = scenario((30, 30), 20e-6, alone=1, together_s=30)
    run = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=0),
                        paced=True, figure_file=store)
    with capture_logs() as logs:
        await run.advance(15)
    failed = run.controller.error_counts["figures_save"]
    assert failed >= 1
    said = [e for e in logs if e["event"] == "throttle_figures_save_failed"]
    assert said and said[0]["path"] == str(blocked / "figures.json")
    # steering went on: each strict container within a point or two of its limit at most
    for name in run.procs:
        tail = [share for _, share in run.gpu.shares(run.procs[name][0], 5.0)[-1:]]
        assert tail[0] <= 30 + 2, (name, tail)
    # the disk back, the figures are written at the next save, none lost
    blocked.unlink()
    blocked.mkdir()
    await run.advance(12)
    saved = json.loads((blocked / "figures.json").read_text())
    assert run.controller.error_counts["figures_save"] == failed
    assert sorted(saved["gpus"][run.gpu.uuid]) == sorted(run.procs)


async def test_the_loop_survives_a_tick_that_throws():
    region = SimRegion("r", ("GPU-x",), (30.0,), ("strict",))

    class Quiet:
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            return []

    controller = ThrottleController(Quiet(), lambda: [region], tick_s=0.01)
    tick = controller.tick
    thrown = {"n": 0}

    async def sometimes(paced: bool = False) -> None:
        if thrown["n"] < 3:
            thrown["n"] += 1
            raise RuntimeError("tick broke")
        await tick(paced=paced)

    controller.tick = sometimes  # type: ignore[method-assign]
    with capture_logs() as logs:
        task = asyncio.create_task(controller.run())
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert controller.error_counts["tick"] == 3
    assert [e["event"] for e in logs].count("throttle_tick_failed") == 3
    assert controller.ticks >= 5  # ticking went on after the failures
    assert region.heartbeat_ns > 0


class _SlotsUnreadable(SimRegion):
    """A region whose header reads but whose process slots cannot be (truncated under the
    reader), until `mended`."""

    mended = False

    def usage(self):  # type: ignore[no-untyped-def]
        if not self.mended:
            raise OSError("state file truncated")
        return super().usage()


async def test_slots_that_cannot_be_read_are_counted_and_the_host_still_places_the_processes():
    node = _Node(second=_SlotsUnreadable)
    with capture_logs() as logs:
        await node.advance(4)
    failures = node.controller.error_counts["region_usage"]
    assert failures >= 1
    assert {e["alloc_id"] for e in logs if e["event"] == "throttle_region_unreadable"} == {"c1"}
    # its process placed on the host's word (its slots only supply claims to check)
    assert node.share(1) == pytest.approx(30, abs=2)
    assert node.share(0) == pytest.approx(30, abs=2)
    node.regions[1].mended = True  # type: ignore[attr-defined]
    await node.advance(3)
    assert node.controller.error_counts["region_usage"] == failures
    assert node.share(1) == pytest.approx(30, abs=2)

"""Run scenarios on a simulated GPU: under the real throttle controller, under the peer model, or
with no limiter at all (what the GPU's own time-slicing gives saturating processes).

The controlled run wires the real `ThrottleController` (and so the real control law) to the
simulator: its clock is the simulated clock, its backend serves the simulator's NVML samples, its
regions are the simulated containers' regions. Shares are measured from the simulator's ground
truth (SM time actually used), not from what the controller believed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.simulation.gpu import (
    NoShim,
    SimBackend,
    SimGpu,
    SimHostEvidence,
    SimProcess,
    Workload,
)
from vgpu_agent.simulation.imperfections import REAL, Imperfections
from vgpu_agent.simulation.peer import PeerGate, PeerGpu, PeerWatchers
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.control import ControlParams
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.figurefile import FigureFile

SIM_UUID = "GPU-5a11ce00-0000-4000-8000-000000000001"


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    limit: float  # percent
    workload: Workload
    policy: CorePolicy = "work-conserving"
    priority: int = 0
    processes: int = 1
    # From `switch_at_s` on its processes run `switch_to` instead (an application moving to
    # another phase: its tokens then buy a different SM time, which the law must re-learn).
    switch_to: Workload | None = None
    switch_at_s: float = math.inf
    # ... and from `switch_back_at_s` on `workload` again (a second change of phase)
    switch_back_at_s: float = math.inf

    def __post_init__(self) -> None:
        if not (self.switch_back_at_s > self.switch_at_s or self.switch_back_at_s == math.inf):
            raise ValueError(f"container {self.name!r}: switch_back_at_s must come after "
                             f"switch_at_s ({self.switch_at_s!r} s), got "
                             f"{self.switch_back_at_s!r}")

    def phases(self) -> list[tuple[str, Workload]]:
        """(name suffix, workload) for each set of `processes` processes it runs."""
        if self.switch_to is None or not math.isfinite(self.switch_at_s):
            return [("", self.workload)]
        back = self.switch_back_at_s
        phases = [("", _within(self.workload, 0.0, self.switch_at_s)),
                  ("-after", _within(self.switch_to, self.switch_at_s, back))]
        if math.isfinite(back):
            phases.append(("-back", _within(self.workload, back, math.inf)))
        return phases


def _within(workload: Workload, start: float, end: float) -> Workload:
    """The workload, busy only inside [start, end)."""
    busy = tuple((max(a, start), min(b, end)) for a, b in workload.busy
                 if max(a, start) < min(b, end))
    return replace(workload, busy=busy or ((start, start),))


@dataclass(frozen=True)
class Scenario:
    name: str
    containers: tuple[ContainerSpec, ...]
    expected: Callable[[str, float], float]  # the share container `name` should have at time t
    duration_s: float = 60.0
    changes: tuple[float, ...] = ()  # moments the expected shares change (besides t=0)


@dataclass(frozen=True)
class PlantSpec:
    """The simulated GPU a scenario runs on: its imperfections and NVML's sample period."""

    imperfections: Imperfections = REAL
    sample_period_s: float = 1 / 6
    seed: int = 0

    def gpu(self, uuid: str, per_process_samples: bool = True) -> SimGpu:
        return SimGpu(uuid, per_process_samples=per_process_samples,
                      sample_period_s=self.sample_period_s, imperfections=self.imperfections,
                      seed=self.seed)


@dataclass
class RunResult:
    scenario: Scenario
    series: dict[str, list[tuple[float, float]]]  # name -> (window end s, share percent)
    cpu_s: float
    window_s: float
    # what the controller counted (a container it took for a liar, a tick that failed)
    errors: dict[str, int] = field(default_factory=dict)
    nvml_calls: int = 0  # NVML's per-process utilization asked for, all GPUs


@dataclass(frozen=True)
class Stats:
    mean_abs_error: float  # points, steady state, all containers
    p95_error: float
    median_error: float = math.nan
    p99_error: float = math.nan
    settling_s: list[float | None] = field(default_factory=list)  # per change incl. t=0; None=never

    @property
    def worst_settling_s(self) -> float:
        return max((math.inf if s is None else s) for s in self.settling_s) if self.settling_s \
            else 0.0


def _series(gpu: SimGpu, procs: dict[str, list[SimProcess]], window_s: float
            ) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for name, plist in procs.items():
        per = [gpu.shares(p, window_s) for p in plist]
        out[name] = [(per[0][i][0], sum(s[i][1] for s in per)) for i in range(len(per[0]))] \
            if per else []
    return out


class ControlledRun:
    """A simulated GPU whose containers the real controller steers; step it with `advance`."""

    def __init__(self, containers: tuple[ContainerSpec, ...], *, tick_s: float = 0.1,
                 params: ControlParams | None = None, per_process_samples: bool = True,
                 uuid: str = SIM_UUID, plant: PlantSpec | None = None, paced: bool = False,
                 nvml_poll_periods: int = 1, figure_file: FigureFile | None = None,
                 solo_turns: bool = True, figure_max_age_s: float = 0.0):
        self.gpu = (plant or PlantSpec()).gpu(uuid, per_process_samples)
        # paced: tick at the controller's own pace (`interval_s`: tick_s, slower while all is
        # calm), as the agent's loop does; otherwise every tick_s
        self.paced = paced
        self.regions: dict[str, SimRegion] = {}
        self.procs: dict[str, list[SimProcess]] = {}
        for seq, spec in enumerate(containers):
            region = SimRegion(spec.name, (uuid,), (spec.limit,), (spec.policy,),
                               priority=spec.priority, seq=seq)
            self.regions[spec.name] = region
            self.procs[spec.name] = [
                self.gpu.shim_process(f"{spec.name}-{i}{suffix}", workload, region)
                for suffix, workload in spec.phases() for i in range(spec.processes)
            ]
        self.tick_s = tick_s
        self._due_s = tick_s  # when, on the plant's clock, the next tick is due
        self._look_s: float | None = None  # and when idle containers are next looked at
        self.params, self.nvml_poll_periods = params, nvml_poll_periods
        self.solo_turns, self.figure_max_age_s = solo_turns, figure_max_age_s
        self.controller = self._controller(figure_file)

    def _controller(self, figure_file: FigureFile | None) -> ThrottleController:
        return ThrottleController(
            SimBackend([self.gpu]), lambda: list(self.regions.values()), tick_s=self.tick_s,
            params=self.params, clock=lambda: self.gpu.now_ns,
            evidence=SimHostEvidence([self.gpu]), nvml_poll_periods=self.nvml_poll_periods,
            figure_file=figure_file, solo_turns=self.solo_turns,
            figure_max_age_s=self.figure_max_age_s,
        )

    def restart_controller(self, figure_file: FigureFile | None = None) -> None:
        """A new controller in place of the old, as when the agent restarts: it knows nothing
        its predecessor learned but what `figure_file` kept. The containers run on, at the
        rates last written."""
        self.controller = self._controller(figure_file)

    async def advance(self, seconds: float) -> None:
        """Run the plant `seconds` on, ticking the controller whenever a tick is due. The
        schedule outlives the call: a caller stepping in pieces shorter than the tick (0.05 s
        pieces ticked it 20 times a second, paced or not) gets the run one call would."""
        end = self.gpu.elapsed_s + seconds
        controller = self.controller
        while self.gpu.elapsed_s < end - 1e-9:
            look_at = self._look_s if self._look_s is not None else math.inf
            self.gpu.advance(min(self._due_s, look_at, end) - self.gpu.elapsed_s)
            now = self.gpu.elapsed_s
            if now < self._due_s - 1e-9:
                if now >= look_at - 1e-9:  # a look between ticks: tick now if one woke
                    if controller.watched_woke():
                        self._due_s = now
                    else:
                        self._look_s = self._next_look(look_at)
                if now < self._due_s - 1e-9:
                    continue
            await controller.tick(paced=self.paced)
            # paced, as the agent's loop: until the first GPU is due, no sooner than `tick_s`
            self._due_s = now + (max(controller.interval_s, self.tick_s) if self.paced
                                 else self.tick_s)
            self._look_s = self._next_look(now)

    def _next_look(self, after: float) -> float | None:
        """When, paced, idle containers are next looked at (`watch_s` after `after`, as the
        agent's loop does between slow ticks); None when nothing is watched or the next tick
        comes first."""
        watch_s = self.controller.watch_s if self.paced else None
        if watch_s is None or after + watch_s >= self._due_s - 1e-9:
            return None
        return after + watch_s


async def run_controlled(scenario: Scenario, *, tick_s: float = 0.1, window_s: float = 0.5,
                         params: ControlParams | None = None, plant: PlantSpec | None = None,
                         paced: bool = False, nvml_poll_periods: int = 1,
                         solo_turns: bool = True, figure_max_age_s: float = 0.0) -> RunResult:
    started = time.process_time()
    run = ControlledRun(scenario.containers, tick_s=tick_s, params=params, plant=plant,
                        paced=paced, nvml_poll_periods=nvml_poll_periods,
                        solo_turns=solo_turns, figure_max_age_s=figure_max_age_s)
    await run.advance(scenario.duration_s)
    calls = sum([made for made, _ in run.controller.nvml_utilization_calls.values()])
    return RunResult(scenario, _series(run.gpu, run.procs, window_s),
                     time.process_time() - started, window_s, dict(run.controller.error_counts),
                     calls)


def run_peer(scenario: Scenario, *, window_s: float = 0.5, peer_gpu: PeerGpu | None = None,
             plant: PlantSpec | None = None) -> RunResult:
    """The same workloads on the same plant, limited by the peer model instead of the controller."""
    started = time.process_time()
    peer_gpu = peer_gpu or PeerGpu()
    gpu = (plant or PlantSpec()).gpu(SIM_UUID)
    procs: dict[str, list[SimProcess]] = {}
    watched: dict[str, tuple[PeerGate, list[SimProcess]]] = {}
    for spec in scenario.containers:
        gate = PeerGate(spec.limit, spec.workload.blocks, peer_gpu)
        procs[spec.name] = [
            gpu.add_process(f"{spec.name}-{i}{suffix}", workload, gate.launching(workload.blocks))
            for suffix, workload in spec.phases() for i in range(spec.processes)
        ]
        watched[spec.name] = (gate, procs[spec.name])
    watchers = PeerWatchers(gpu, watched)
    while gpu.elapsed_s < scenario.duration_s - 1e-9:
        gpu.advance(0.01)
        watchers.run_due()
    return RunResult(scenario, _series(gpu, procs, window_s), time.process_time() - started,
                     window_s)


def run_unlimited(scenario: Scenario, *, window_s: float = 0.5,
                  plant: PlantSpec | None = None) -> RunResult:
    """The same workloads on the same plant with no limiter: every launch runs when its
    process wants it, and the GPU's context switching alone splits its time. The baseline a
    limiter has to beat (a limiter that never throttles, as the peer model's full bucket does
    for tens of seconds, scores exactly this)."""
    started = time.process_time()
    gpu = (plant or PlantSpec()).gpu(SIM_UUID)
    procs = {spec.name: [gpu.add_process(f"{spec.name}-{i}{suffix}", workload, NoShim())
                         for suffix, workload in spec.phases() for i in range(spec.processes)]
             for spec in scenario.containers}
    while gpu.elapsed_s < scenario.duration_s - 1e-9:
        gpu.advance(0.01)
    return RunResult(scenario, _series(gpu, procs, window_s), time.process_time() - started,
                     window_s)


def evaluate(result: RunResult, *, tolerance: float = 2.0, settle_exclude_s: float = 5.0,
             hold_s: float = 2.0) -> Stats:
    """Steady-state errors (from `settle_exclude_s` after each change) and settling times.

    Settling after a change: from the change to the first window end after which every
    container's share stays within `tolerance` of its expected share for `hold_s`.
    """
    sc = result.scenario
    bounds = [0.0, *sc.changes, sc.duration_s]
    errors: list[float] = []
    for name, points in result.series.items():
        for t, share in points:
            start = max(b for b in bounds[:-1] if b <= t - 1e-9)  # last change before window end
            if t - result.window_s >= start + settle_exclude_s - 1e-9:
                errors.append(abs(share - sc.expected(name, t - result.window_s / 2)))
    errors.sort()
    mae = sum(errors) / len(errors) if errors else math.nan

    def pct(q: float) -> float:
        return errors[min(len(errors) - 1, int(q * len(errors)))] if errors else math.nan

    settling: list[float | None] = []
    times = [t for t, _ in next(iter(result.series.values()))]
    for i, change in enumerate(bounds[:-1]):
        end = bounds[i + 1]
        ok = [
            all(abs(result.series[n][j][1] - sc.expected(n, t - result.window_s / 2)) <= tolerance
                for n in result.series)
            for j, t in enumerate(times)
        ]
        found: float | None = None
        for t in times:
            if t < change + result.window_s - 1e-9 or t > end - hold_s:
                continue
            span = [ok[k] for k, tt in enumerate(times) if t <= tt <= t + hold_s]
            if all(span):
                found = t - change
                break
        settling.append(found)
    return Stats(mae, pct(0.95), median_error=pct(0.5), p99_error=pct(0.99), settling_s=settling)

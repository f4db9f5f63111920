"""Core-throttle benchmark: the real controller vs a model of the peer limiter, on simulated GPUs.

Six scenarios of 60 simulated seconds each, on the ideal plant and on the imperfect one (the
simulator's defaults) with NVML noise of sigma 3 and 8 points and samples every 1/6 s and every
second. For each: steady-state mean absolute error of every container's share (percentage
points, 0.5 s windows of true SM time), its p50/p95/p99, and the settling time to within +/-2
points after each change, for ours and the peer model on the same plant, with the ratio, and
the error with no limiter at all (`none`: every launch runs when its process wants it, the GPU's
time-slicing alone splits it). The peer's bucket holds `g_total` blocks (8.65 M for the modelled
GPU), tens of seconds of these workloads' launches, so in some cells it does not throttle
measurably within a run, and its error is `none`'s; the last lines list those cells, and any where ours
did worse than no limiter.

Goals: ideal plant: error <= 2 points, settling <= 2 s; sigma 3: error <= 1 point, settling
<= 2 s (samples every 1/6 s) or 4 s (every second); sigma 8: <= 2 points, <= 4 s / 6 s; and
always at most half the peer model's error on the same plant.

Each noisy cell runs on `--seeds N` seeds of the plant (its noise, jitter and missed samples;
8 by default) and prints the median MAE, p95 and p99, and per change the median settling with
the worst in brackets; a cell meets the goals when its medians do. Fewer seeds mislead near a
goal: the same tree's medians over three seeds and over eight put cells on either side of it.
`cpu s` is the controller's CPU a run (this machine's), `nvml/s` how often it asked NVML for
per-process samples, a simulated second, the seeds' median (each ask costs about 2.2 ms of CPU
on an H200; `--nvml-poll-periods` moves it).

`bound s` (per-process attribution) is the median settling of an estimator that learns every
new workload's cost from the plant's NVML samples as well as they allow and is otherwise ideal
(`simulation/bound.py`): no law that learns costs from the samples settles sooner, and a
settling goal below it asks for more than the samples hold (a law may still beat it by a
belief that happens to be right: the cold start's equal parts in scenario 1, for instance).
It is printed twice, "with/without": the estimator knowing that a full GPU's shares add up to
it, and not. This law does not use that sum (it cannot tell a full GPU from its own estimates
of the shares, which the sum would correct), so a settling goal between the two asks it for
what only the sum gives; the last lines list the missed cells where that is so.
On a time-sliced GPU the samples tell shares only by how many periods go to each container's
processes, which settles no cell of two containers or more within 30 s (the module computes
it: scenario 4 at 6 Hz, 19 s, the others never); there the split's belief that costs are
equal (`throttle/timesliced.py`) is what settles the cells whose containers' costs are equal,
so no bound is printed. Where no turn alone fits the plant's sample period (`soloturn.turn_fits`:
samples every second) the periods are all a law learns costs from, and for a cell that misses
half the peer model's error the last lines give the same estimator's median steady error: where
it is above half the peer's, the goal asks for more than the periods hold, unless a belief
happens to be right (equal costs: scenarios 1 and 5, where ours is within half the peer's).

For a missed settling goal that both bounds put within reach, the last lines give the law's own
settling on the same plant and seeds with exact readings (NVML's noise off, its rounding and
missed samples kept): what the plant's transients alone cost it, which the bound does not model
(each process keeps work queued ahead of the GPU, so SM time lags spending, most after the
unthrottled first tick; spending comes in whole launches, one or two a tick for long kernels).

Where a cell's steady error is above its goal (per-process attribution), the last lines give
the same estimator's median steady error over the cell's steady windows, once knowing that a
full GPU's shares add up to it and once not: a goal below the first asks for more than the
samples hold; between the two, it asks a law to use the GPU's sum, which this one does not.

    python tests/bench/bench_throttle.py [--only NAME] [--plant NAME] [--duration S] [--seeds N]
                                         [--attribution per-process|time-sliced]
                                         [--launch-hold-us US]
                                         [--sample-lag-ms MS] [--sample-lag-jitter-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

# this tree's code, not whichever checkout is installed (comparisons run older trees)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench import machine
from vgpu_agent.config import Config
from vgpu_agent.logging import configure as configure_logging
from vgpu_agent.simulation.bound import BoundSpec, Learner, median_bound, steady_error_bound
from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import IDEAL, REAL
from vgpu_agent.simulation.runner import (
    ContainerSpec,
    PlantSpec,
    RunResult,
    Scenario,
    Stats,
    evaluate,
    run_controlled,
    run_peer,
    run_unlimited,
)
from vgpu_agent.throttle.soloturn import turn_fits

FOREVER = math.inf
# what the agent ships (`throttle_nvml_poll_periods`), so that the table is of its configuration
AGENT_POLL_PERIODS = next(f.default for f in fields(Config)
                          if f.name == "throttle_nvml_poll_periods")
LONG = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)
# Twice as long with half the blocks: four times LONG's SM time per token.
COSTLY = Workload(kernel_s=0.004, blocks=512, threads_per_block=256)


def _fixed(shares: dict[str, float]):
    return lambda name, t: shares[name]


def scenarios(duration_s: float) -> list[Scenario]:
    half = duration_s / 2
    owner_busy = Workload(kernel_s=0.002, blocks=2048, threads_per_block=128,
                          busy=((half, FOREVER),))
    return [
        Scenario(
            "1 three saturating 20/30/50",
            tuple(ContainerSpec(n, lim, LONG) for n, lim in (("a", 20), ("b", 30), ("c", 50))),
            _fixed({"a": 20, "b": 30, "c": 50}),
            duration_s,
        ),
        Scenario(
            "2 alone, 30% strict",
            (ContainerSpec("solo", 30, LONG, policy="strict"),),
            _fixed({"solo": 30}),
            duration_s,
        ),
        Scenario(
            "3 work-conserving reclaim",
            (
                ContainerSpec("borrower", 30, LONG),
                ContainerSpec("owner", 70, owner_busy),
            ),
            lambda name, t: (100.0 if name == "borrower" else 0.0) if t < half
            else (30.0 if name == "borrower" else 70.0),
            duration_s,
            changes=(half,),
        ),
        Scenario(
            "4 20us and 5ms kernels",
            (
                # 66 blocks fill half of a 132-SM GPU: on the imperfect plant two of its
                # kernels pack, so its SM time per token depends on how fast it launches.
                ContainerSpec("short", 40, Workload(kernel_s=20e-6, blocks=66,
                                                    threads_per_block=128, queue_s=0.005,
                                                    streams=4)),
                ContainerSpec("long", 60, Workload(kernel_s=0.005, blocks=4096,
                                                   threads_per_block=512, queue_s=0.01)),
            ),
            _fixed({"short": 40, "long": 60}),
            duration_s,
        ),
        Scenario(
            "5 ten at 10% each",
            # Unequal tenants: 1 to 3 processes each (time-slicing alone would favour the
            # containers with more processes) and kernels from 0.5 to 5 ms.
            tuple(ContainerSpec(f"c{i}", 10,
                                Workload(kernel_s=0.0005 * (i + 1), blocks=256 * (i + 1)),
                                processes=1 + i % 3)
                  for i in range(10)),
            _fixed({f"c{i}": 10 for i in range(10)}),
            duration_s,
        ),
        Scenario(
            "6 new phases: x4, x1/4",
            # Halfway both applications change phase: the tokens of one then buy four times
            # the SM time (it would take its neighbour's share), of the other a quarter (it
            # would starve) until the law has re-learned both.
            (
                ContainerSpec("costlier", 40, LONG, switch_to=COSTLY, switch_at_s=half),
                ContainerSpec("cheaper", 60, COSTLY, switch_to=LONG, switch_at_s=half),
            ),
            _fixed({"costlier": 40, "cheaper": 60}),
            duration_s,
            changes=(half,),
        ),
    ]


@dataclass(frozen=True)
class Plant:
    name: str
    spec: PlantSpec
    max_error: float
    max_settling_s: float


PLANTS = (
    Plant("ideal", PlantSpec(IDEAL), 2.0, 2.0),
    Plant("s3/6Hz", PlantSpec(replace(REAL, nvml_sigma=3.0), 1 / 6), 1.0, 2.0),
    Plant("s3/1Hz", PlantSpec(replace(REAL, nvml_sigma=3.0), 1.0), 1.0, 4.0),
    Plant("s8/6Hz", PlantSpec(replace(REAL, nvml_sigma=8.0), 1 / 6), 2.0, 4.0),
    Plant("s8/1Hz", PlantSpec(replace(REAL, nvml_sigma=8.0), 1.0), 2.0, 6.0),
)


def attainable(sc: Scenario, plant: PlantSpec) -> Scenario:
    """The scenario with what the plant can deliver: while two or more containers share a full
    GPU, contexts take turns and the switches cost `switch_s` per `timeslice_s` of everyone's
    time, so limits adding up to 100% are met in proportion, a little lower."""
    imp = plant.imperfections
    capacity = 1 - imp.switch_s / imp.timeslice_s
    names = [c.name for c in sc.containers]

    def expected(name: str, t: float) -> float:
        shares = [sc.expected(n, t) for n in names]
        full = sum(shares) >= 99.9 and sum(1 for v in shares if v > 0) > 1
        return sc.expected(name, t) * (capacity if full else 1.0)

    return replace(sc, expected=expected)


def bound_segments(sc: Scenario, plant: PlantSpec, tick_s: float, *, use_sum: bool = True
                   ) -> list[tuple[list[Learner], BoundSpec]]:
    """Per stretch between the scenario's changes, what the best estimator of costs from the
    plant's NVML samples (`simulation/bound.py`) learns: each change's containers with the
    shares the scenario names (not those `attainable` scales), those whose workload went on
    unchanged counted as known. `use_sum`: it knows a full GPU's shares add up to it (a
    container alone is known from its first tick either way)."""
    segments = []
    edges = [0.0, *sc.changes, sc.duration_s]
    for change, end in itertools.pairwise(edges):
        learners = []
        for spec in sc.containers:
            share = sc.expected(spec.name, change + 1e-6)
            if share <= 0:
                continue
            before = change > 0 and sc.expected(spec.name, change - 1e-6) > 0
            known = before and spec.switch_at_s != change
            learners.append(Learner(share, spec.processes, known))
        # A container alone ran its unthrottled first tick on the whole GPU (every workload
        # here fills it), which tells its cost exactly, as a full GPU tells its shares' sum.
        full = len(learners) == 1 or (use_sum and sum(c.share for c in learners) >= 99.9)
        segments.append((learners, BoundSpec(plant.imperfections, plant.sample_period_s,
                                             tick_s, full=full, horizon_s=end - change)))
    return segments


def settling_bound(sc: Scenario, plant: PlantSpec, tick_s: float, *, use_sum: bool = True
                   ) -> float:
    """The longest, over the scenario's changes, of the best estimator's median settling
    (`use_sum`: knowing that a full GPU's shares add up to it, as `bound_segments`)."""
    return max(median_bound(learners, spec)
               for learners, spec in bound_segments(sc, plant, tick_s, use_sum=use_sum))


def steady_bounds(sc: Scenario, plant: PlantSpec, tick_s: float) -> tuple[float, float]:
    """The best estimator's median steady-state error, knowing a full GPU's sum and not."""
    return (steady_error_bound(bound_segments(sc, plant, tick_s)),
            steady_error_bound(bound_segments(sc, plant, tick_s, use_sum=False)))


def periods_bound(sc: Scenario, plant: PlantSpec, tick_s: float, runs: int = 200
                  ) -> float | None:
    """On a time-sliced GPU where no turn alone fits the samples, the median steady error of
    an estimator learning costs from the periods as well as they allow; None where turns fit
    (a figure measured alone tells more than the periods, and the law may beat this)."""
    if turn_fits(plant.sample_period_s):
        return None
    sliced = replace(plant, imperfections=replace(plant.imperfections,
                                                  nvml_attribution="time-sliced"))
    return steady_error_bound(bound_segments(sc, sliced, tick_s), runs=runs)


def _seconds(s: float | None) -> float:
    return math.inf if s is None else s


def _median_stats(runs: list[Stats]) -> tuple[Stats, str]:
    """The median of each figure over seeds, and the settling text: median (worst) per change."""
    def med(values: list[float]) -> float:
        return statistics.median(values)

    changes = len(runs[0].settling_s)
    settled: list[float | None] = []
    texts = []
    for i in range(changes):
        times = [_seconds(r.settling_s[i]) for r in runs]
        middle, worst = med(times), max(times)
        settled.append(None if math.isinf(middle) else middle)
        texts.append(("never" if math.isinf(middle) else f"{middle:.1f}")
                     + (f"({'never' if math.isinf(worst) else f'{worst:.1f}'})"
                        if len(runs) > 1 else ""))
    stats = Stats(med([r.mean_abs_error for r in runs]), med([r.p95_error for r in runs]),
                  median_error=med([r.median_error for r in runs]),
                  p99_error=med([r.p99_error for r in runs]), settling_s=settled)
    return stats, "/".join(texts)


def spec_of(plant: Plant, args: argparse.Namespace) -> PlantSpec:
    """The plant as the run's options have it (attribution, holds), before its seed."""
    return replace(plant.spec, imperfections=replace(
        plant.spec.imperfections, nvml_attribution=args.attribution,
        launch_hold_s=args.launch_hold_us * 1e-6, sample_lag_s=args.sample_lag_ms * 1e-3,
        sample_lag_jitter_s=args.sample_lag_jitter_ms * 1e-3))


def exact_settling(sc: Scenario, plant: PlantSpec, seeds: range,
                   args: argparse.Namespace) -> float:
    """The law's settling (the slowest change's median over `seeds`) on `plant` with NVML's
    noise off: its rounding to whole percents and its missed samples kept."""
    runs = []
    for seed in seeds:
        spec = replace(plant, seed=seed,
                       imperfections=replace(plant.imperfections, nvml_sigma=0.0))
        runs.append(evaluate(run_ours(attainable(sc, spec), spec, args)))
    return _median_stats(runs)[0].worst_settling_s


def run_ours(sc: Scenario, spec: PlantSpec, args: argparse.Namespace) -> RunResult:
    """The agent's controller on `sc` and `spec`, ticking as the command line asks."""
    return asyncio.run(run_controlled(sc, plant=spec, paced=args.paced, tick_s=args.tick,
                                      nvml_poll_periods=args.nvml_poll_periods))


def _when(settling_s: float) -> str:
    """A settling time as the summary lines print it."""
    return "never" if math.isinf(settling_s) else f"{settling_s:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the scenarios whose name contains this")
    parser.add_argument("--plant", help="run only the plants whose name contains this")
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds each")
    parser.add_argument("--paced", action="store_true",
                        help="tick at the controller's own pace (slower while calm), as the "
                             "agent does; by default every 0.1 s")
    parser.add_argument("--attribution", choices=("per-process", "time-sliced"),
                        default="per-process",
                        help="how NVML attributes a sample period (see simulation/"
                             "imperfections.py): time-sliced is what an H200 did with two "
                             "processes and no MPS")
    parser.add_argument("--launch-hold-us", type=float, default=0.0,
                        help="busy NVML counts per launch while processes take turns "
                             "(time-sliced only; the H200 fitted 130: simulation/"
                             "imperfections.py)")
    parser.add_argument("--sample-lag-ms", type=float, default=0.0,
                        help="every plant's samples readable only this long after their stamp "
                             "(not measured on a real driver: simulation/imperfections.py)")
    parser.add_argument("--sample-lag-jitter-ms", type=float, default=0.0,
                        help="... plus up to this much more, drawn per period")
    parser.add_argument("--tick", type=float, default=0.1,
                        help="the controller's tick_s (its fastest tick), s")
    parser.add_argument("--nvml-poll-periods", type=int, default=AGENT_POLL_PERIODS,
                        help="NVML asked once every this many sample periods (the agent's "
                             "throttle_nvml_poll_periods; default: the agent's, "
                             f"{AGENT_POLL_PERIODS})")
    parser.add_argument("--seeds", type=int, default=8,
                        help="plant seeds per noisy cell (medians printed; the ideal plant has "
                             "no randomness and runs once)")
    parser.add_argument("--log-level", default="error",
                        choices=("debug", "info", "warning", "error"),
                        help="the controller's events at this level or above, to stderr (the "
                             "table alone on stdout)")
    args = parser.parse_args()
    configure_logging(log_format="console", level=args.log_level)
    if not 0 <= args.launch_hold_us < 100_000:
        parser.error(f"--launch-hold-us must be in [0, 100000), got {args.launch_hold_us}")
    for name in ("sample_lag_ms", "sample_lag_jitter_ms"):
        if not 0 <= getattr(args, name) < 1_000:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1000), "
                         f"got {getattr(args, name)}")
    print(f"machine: {machine.describe()}; "
          f"NVML attribution {args.attribution}, asked every "
          + ("period" if args.nvml_poll_periods == 1 else
             f"{args.nvml_poll_periods} periods (every period while estimates are loose or "
             "periods time-sliced)")
          + (f", {args.launch_hold_us:g} us held per launch" if args.launch_hold_us else "")
          + (f", samples readable {args.sample_lag_ms:g} ms (+ up to "
             f"{args.sample_lag_jitter_ms:g}) after their stamps"
             if args.sample_lag_ms or args.sample_lag_jitter_ms else ""))
    print("share = true SM time over 0.5 s windows; error in percentage points; steady state "
          "= from 5 s after each change; settling to +/-2 points held 2 s, per change (s); "
          "expected shares of a full GPU less the plant's context-switch cost")
    header = (f"{'plant':6} {'scenario':28} | {'ours MAE':>8} {'p50':>5} {'p95':>5} {'p99':>5} "
              f"{'settle s':>8} {'bound s':>9} | {'peer MAE':>8} {'p50':>5} {'p95':>5} {'p99':>5} "
              f"{'settle s':>8} | {'none MAE':>8} | {'peer/ours':>9} | {'goals':>6} | {'cpu s':>5} "
              f"{'nvml/s':>6}")
    print(header)
    print("-" * len(header))
    missed: list[str] = []
    beyond: list[str] = []  # missed settling goals below the bound
    needs_sum: list[str] = []  # ... above it, but below the bound without a full GPU's sum
    reachable: list[str] = []  # ... within both bounds, with the law's settling on exact readings
    over: list[str] = []  # steady errors above their goal, with the samples' bounds
    beneath: list[str] = []  # half the peer's error below what the periods allow (no turns)
    idle_peer: list[str] = []  # cells where the peer model did not throttle measurably
    worse_than_none: list[str] = []  # cells where ours did worse than no limiter at all
    counted: dict[str, int] = {}
    for plant in PLANTS:
        if args.plant and args.plant not in plant.name:
            continue
        for sc in scenarios(args.duration):
            if args.only and args.only not in sc.name:
                continue
            seeds = range(1 if plant.name == "ideal" else max(1, args.seeds))
            ours_runs, peer_runs, none_runs, cpu_s, calls = [], [], [], 0.0, []
            for seed in seeds:
                spec = replace(spec_of(plant, args), seed=seed)
                seeded = attainable(sc, spec)
                ours_run = run_ours(seeded, spec, args)
                cpu_s += ours_run.cpu_s
                calls.append(ours_run.nvml_calls / sc.duration_s)
                for kind, count in ours_run.errors.items():
                    counted[kind] = counted.get(kind, 0) + count
                ours_runs.append(evaluate(ours_run))
                peer_runs.append(evaluate(run_peer(seeded, plant=spec)))
                none_runs.append(evaluate(run_unlimited(seeded, plant=spec)))
            ours, ours_settle = _median_stats(ours_runs)
            peer, peer_settle = _median_stats(peer_runs)
            unlimited = statistics.median([r.mean_abs_error for r in none_runs])
            # The peer's bucket holds g_total blocks (8.65 M here), tens of seconds of these
            # workloads' launches: where its error is that of no limiter, it did not throttle
            # measurably (inferred from the errors; a trace shows it, BENCHMARKS.md).
            if abs(peer.mean_abs_error - unlimited) < 0.05 and unlimited >= 1.0:
                idle_peer.append(f"{plant.name} {sc.name[:1]}")
            if ours.mean_abs_error > unlimited:
                worse_than_none.append(f"{plant.name} {sc.name} (ours "
                                       f"{ours.mean_abs_error:.2f}, none {unlimited:.2f})")
            # Errors below 0.01 points are at the simulator's resolution: do not divide by them.
            ratio = peer.mean_abs_error / max(ours.mean_abs_error, 0.01)
            ratio_text = (f"{ratio:9.1f}" if ours.mean_abs_error >= 0.01
                          else f"{'>' + format(ratio, '.0f'):>9}")
            met = (ours.mean_abs_error <= plant.max_error
                   and ours.worst_settling_s <= plant.max_settling_s
                   and ours.mean_abs_error <= peer.mean_abs_error / 2)
            per_process = args.attribution == "per-process"
            bound = settling_bound(sc, plant.spec, args.tick) if per_process else math.nan
            unsummed = (settling_bound(sc, plant.spec, args.tick, use_sum=False)
                        if per_process else math.nan)
            if not met:
                missed.append(f"{plant.name} {sc.name}")
                if bound > plant.max_settling_s:
                    beyond.append(f"{plant.name} {sc.name} ({bound:.1f} s)")
                elif (unsummed > plant.max_settling_s
                      and ours.worst_settling_s > plant.max_settling_s):
                    needs_sum.append(f"{plant.name} {sc.name} (ours "
                                     f"{_when(ours.worst_settling_s)}, bound {bound:.1f} s, "
                                     f"{unsummed:.1f} s without the sum)")
                elif (per_process and plant.name != "ideal"
                      and ours.worst_settling_s > plant.max_settling_s):
                    exact = exact_settling(sc, spec_of(plant, args), seeds, args)
                    reachable.append(f"{plant.name} {sc.name} (ours "
                                     f"{_when(ours.worst_settling_s)}, exact readings "
                                     f"{_when(exact)}, goal {plant.max_settling_s:g} s)")
            if ours.mean_abs_error > plant.max_error and args.attribution == "per-process":
                with_sum, alone = steady_bounds(sc, plant.spec, args.tick)
                over.append(f"{plant.name} {sc.name} ({ours.mean_abs_error:.2f}; bound "
                            f"{with_sum:.2f}, {alone:.2f} without the sum)")
            if args.attribution == "time-sliced" and ours.mean_abs_error > peer.mean_abs_error / 2:
                periods = periods_bound(sc, plant.spec, args.tick)
                if periods is not None and periods > peer.mean_abs_error / 2:
                    beneath.append(f"{plant.name} {sc.name} (ours {ours.mean_abs_error:.2f}, "
                                   f"peer {peer.mean_abs_error:.2f}, periods' bound "
                                   f"{periods:.2f})")
            bound_text = "-" if math.isnan(bound) else f"{bound:.1f}/{unsummed:.1f}"
            print(f"{plant.name:6} {sc.name:28} | {ours.mean_abs_error:8.2f} "
                  f"{ours.median_error:5.2f} {ours.p95_error:5.2f} {ours.p99_error:5.2f} "
                  f"{ours_settle:>8} {bound_text:>9} | {peer.mean_abs_error:8.2f} "
                  f"{peer.median_error:5.2f} "
                  f"{peer.p95_error:5.2f} {peer.p99_error:5.2f} {peer_settle:>8} | "
                  f"{unlimited:8.2f} | {ratio_text} | {'met' if met else 'MISSED':>6} | {cpu_s / len(seeds):5.1f} "
                  f"{statistics.median(calls):6.2f}")
            sys.stdout.flush()
    print("all goals met" if not missed else f"goals MISSED in {len(missed)}: {'; '.join(missed)}")
    if beyond:
        print(f"of which the settling goal is below the bound in {len(beyond)}, so that no law "
              f"learning costs from these samples meets it: {'; '.join(beyond)}")
    if needs_sum:
        print(f"of the others, the settling goal is below what the samples allow a law that "
              f"does not use a full GPU's sum (as this one does not) in {len(needs_sum)}: "
              f"{'; '.join(needs_sum)}")
    if reachable:
        print(f"within both bounds, missed in {len(reachable)} (ours, and the law's settling on "
              f"the same plant and seeds with exact readings: what the plant's transients alone "
              f"cost it): {'; '.join(reachable)}")
    if over:
        print(f"steady error above its goal in {len(over)} (ours; the median steady error of "
              f"an estimator as good as the samples allow, and of one that does not use a full "
              f"GPU's sum): {'; '.join(over)}")
    if beneath:
        print(f"half the peer model's error below what the periods allow (no turn alone fits "
              f"the samples; the median steady error of an estimator learning costs from the "
              f"periods as well as they allow) in {len(beneath)}: {'; '.join(beneath)}")
    if idle_peer:
        print(f"the peer model's error within 0.05 points of no limiter's (it did not throttle "
              f"measurably: bypassed alone on its GPU, scenario 2, else its full bucket "
              f"outlasting the run's phases) in {len(idle_peer)}: {', '.join(idle_peer)}")
    if worse_than_none:
        print(f"ours worse than no limiter at all in {len(worse_than_none)}: "
              f"{'; '.join(worse_than_none)}")
    # Every container here is honest: one taken for a liar (`tokens_overclaimed`) is a false
    # catch, and a failed tick a defect.
    print("controller counted: " + (", ".join(f"{k} {v}" for k, v in sorted(counted.items()))
                                    if counted else "nothing"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Strict containers on a GPU that counts itself busy beyond the work done, as the H200 did.

    python tests/bench/bench_launch_holds.py [--seeds 8] [--together 45] [--long 1800] [--mixed 150]
                                      [--gamer 240] [--crowd 600] [--unequal 40] [--odd 150]
                                      [--phase 150] [--flipper 150]

`imperfections.H200_TIME_SLICED`: NVML gives each 200 ms period whole to one process with the
GPU's busy time as its value (read after several periods, one sample per process for all of
them, worth its part of the use), and while processes take turns every launch keeps the GPU counted
busy 130 us beyond its work (fitted to the H200: two processes doing 20 % of the work each read
99 % busy with 20 us kernels, 66 % with 200 us ones). Strict containers of one kernel length (1024
blocks x 128 threads, the H200 check's), saturating: each alone first for 5 s, one after the
other (as bursty services are, now and then); only the first alone first (the others join it and
are never alone); or together from the start. Then together for `--together` s. Per case, over the seeds: each container's mean share over the last 10 s (the
SM time it really got), median (lowest-highest), against its limit, for
- ours: the controller as it is;
- no bound: the controller with the bound from figures measured alone switched off
  (`timesliced.ALONE_MARGIN` infinite), as before it;
- no turn (together from the start only): the controller without turns alone
  (`throttle_solo_turns: false`), as before them;
- peer: the peer model on the same plant and seeds.

With `--mixed S`, instead: strict 30/30 pairs together from the start for S seconds whose
kernels differ (10 us beside 20 us), or change right after the first turn (5 us, then 20 us
from 6 s, beside 20 us), and the 20/20 pair; per case, over the seeds, each container's mean
share from 70 s on (well after the second container's own turn), and the highest
10 s of either from 70 s on, for ours and for the rule before it (no turn once one container
spending has a figure: the others charged at its figure times the costs the periods show;
emulated on this controller, where a figure in doubt counts as none, so that a doubt may still
give a turn there: none did in the runs recorded, one turn each).

With `--gamer S`, instead: a strict 30/30 pair of 20 us kernels together from the start for S
seconds, the first a tenant gaming its turns alone: 5 us kernels (the same grid, so the same
tokens a launch) whenever no other process has held the GPU for 20 ms, which a real tenant can
tell from its own kernels finishing sooner; beside it the same pair both honest; each also with
turns a minute apart, as before `soloturn.SOLO_TURN_GAP_S` was 10 s. Per pair, over the seeds,
each container's mean share from 10 s to 70 s, from 70 s to 150 s and from 150 s on, the
gamer's highest 10 s from 10 s on, and the turns given.

With `--odd S`, instead: strict 30 % containers of 20 us kernels together from the start for S
seconds, two or three, the first running other kernels (the same grid) whenever it finds itself
alone, four times heavier (80 us) or lighter (5 us), or each time it is alone the next of
light and heavy (5, 80 us) or light and honest (5, 20 us); per case, each container's mean share from
30 s on and its lowest and highest 10 s, for ours and for the largest figure over its cost
setting the scale where figures disagree with the periods (every figure counted, as before
`timesliced._counted_in_scale`).

With `--phase S`, instead: strict 30 % containers of 20 us kernels together from the start for S
seconds, two or three, the first's kernels becoming lighter at PHASE_AT_S (10 or 5 us, the same
grid: its tokens buying a half or a quarter of the SM time they did); per case, each container's
mean share from 30 s after the change on and its lowest 10 s from 10 s after it, and the turns
alone given after the change, for ours and with no figure measured afresh for being long at
odds with the periods (`TimeSlicedSplit.stale` empty, as before it); for kernels twice lighter
also with figures measured again a minute old (`throttle_figure_max_age_seconds: 60`).

With `--flipper S`, instead: strict 30 % containers of 20 us kernels together from the start for S
seconds, three, the first a tenant changing phase over and over: from FLIP_FROM_S on its kernels
are 80 us and 5 us in turn (the same grid: its tokens buying four times the SM time they did, then
a quarter), FLIP_EVERY_S each; the third's kernels become 80 us at FLIP_CHANGE_AT_S, a real change
of phase of an honest neighbour. Per variant, each container's mean share and its lowest and
highest 10 s from FLIP_FROM_S on, median (lowest-highest) over seeds, and how long after the
third's change the split's watch first named it; ours and with the watch not asked while any cost
spending re-learns (before `timesliced._standing`).

With `--crowd S`, instead: ten strict 10 % containers together from the start for S seconds,
kernels of 10 and 20 us in turn or all of 20 us, ours and with turns a minute apart (as
before); per minute, the lowest and highest container's mean share (over the seeds), and when
the last container's first turn came.

With `--unequal S`, instead: the H200's pair of a strict 30 % container of 20 us kernels beside
a strict 50 % one of 200 us, together from the start for S seconds (a 200 us kernel costs the
tokens of a 20 us one); ours and with first turns 10 s apart (as before
`soloturn.SOLO_TURN_FIRST_GAP_S`); per seed, each container's mean share per 2 s, its highest
5 s, and when the turns came.

With `--long S`, instead: the 30/30 pair of 20 us kernels, the first alone first, together for
S seconds, ours only; per seed, each container's mean share over each fifth of the run and its
lowest over any 10 s (what a bound that lets go partway, as one dropped by age or by a false
alarm of the watch once did, shows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench import machine

ALONE_S = 5.0  # each container alone this long first, one after the other
CASES = (  # (limits, kernel seconds)
    ((30.0, 30.0), 20e-6),
    ((30.0, 50.0), 20e-6),
    ((20.0, 30.0, 40.0), 20e-6),
    ((30.0, 30.0), 200e-6),
    ((30.0, 30.0), 2e-3),
)


def check_kernels(kernel_s: float, busy: tuple[tuple[float, float], ...] = ((0.0, math.inf),)
                  ):  # type: ignore[no-untyped-def]
    """A saturating process of `kernel_s` kernels on the H200 check's grid (1024 blocks x 128
    threads: the same tokens a launch whatever the length), busy over `busy` (seconds)."""
    from vgpu_agent.simulation.gpu import Workload

    return Workload(kernel_s=kernel_s, blocks=1024, threads_per_block=128,
                    queue_s=max(0.002, 5 * kernel_s), busy=busy)


def scenario(limits: tuple[float, ...], kernel_s: float, alone: int,
             together_s: float):  # type: ignore[no-untyped-def]
    """The containers (the first `alone` of them alone first, one after the other), and the
    moment they all run from."""
    from vgpu_agent.simulation.runner import ContainerSpec, Scenario

    together = alone * ALONE_S
    specs = []
    for n, limit in enumerate(limits):
        busy = (((n * ALONE_S, (n + 1) * ALONE_S), (together, math.inf)) if n < alone
                else ((together, math.inf),))
        specs.append(ContainerSpec(f"c{n}", limit, check_kernels(kernel_s, busy),
                                   policy="strict"))
    return Scenario(f"strict {limits} of {kernel_s * 1e6:g} us kernels", tuple(specs),
                    lambda name, t: limits[int(name[1:])], together + together_s), together


def last_shares(series: dict[str, list[tuple[float, float]]], end_s: float) -> list[float]:
    """Each container's mean share over the 10 s before `end_s`."""
    return [statistics.fmean(share for t, share in series[f"c{n}"] if t > end_s - 10)
            for n in range(len(series))]


async def held(limits: tuple[float, ...], kernel_s: float, alone: int, seed: int = 0,
               together_s: float = 20.0, solo_turns: bool = True) -> list[float]:
    """Ours: each container's mean share over the last 10 s."""
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import PlantSpec, run_controlled

    sc, _ = scenario(limits, kernel_s, alone, together_s)
    run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed), paced=True,
                               solo_turns=solo_turns)
    assert not run.errors, run.errors
    return last_shares(run.series, sc.duration_s)


def peer_held(limits: tuple[float, ...], kernel_s: float, alone: int, seed: int,
              together_s: float) -> list[float]:
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import PlantSpec, run_peer

    sc, _ = scenario(limits, kernel_s, alone, together_s)
    run = run_peer(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed))
    return last_shares(run.series, sc.duration_s)


def _summary(runs: list[list[float]]) -> str:
    return " ".join(f"{statistics.median(v):4.1f} ({min(v):4.1f}-{max(v):4.1f})"
                    for v in zip(*runs, strict=True))


async def long_run(together_s: float, seed: int) -> None:
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import PlantSpec, run_controlled

    limits = (30.0, 30.0)
    sc, start = scenario(limits, 20e-6, 1, together_s)
    run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                               paced=True)
    assert not run.errors, run.errors
    fifth = together_s / 5
    for n in range(len(limits)):
        series = run.series[f"c{n}"]
        means = [statistics.fmean(v for t, v in series if start + k * fifth <= t
                                  < start + (k + 1) * fifth) for k in range(5)]
        tens = [statistics.fmean(v for t, v in series if a <= t < a + 10)
                for a in range(int(start) + 10, int(start + together_s) - 9, 10)]
        print(f"  seed {seed} c{n}: by fifths " + " ".join(f"{m:4.1f}" for m in means)
              + f" | lowest 10 s {min(tens):4.1f}")


MIXED = (  # (name, first container's kernel, its kernel from 6 s on)
    ("10 us beside 20 us", 10e-6, 10e-6),
    ("5 us, 20 us from 6 s, beside 20 us", 5e-6, 20e-6),
    ("20 us beside 20 us", 20e-6, 20e-6),
)


async def mixed_run(before_s: float, after_s: float, seconds: float, seed: int,
                    one_figure: bool) -> tuple[list[float], float, int]:
    """A strict 30/30 pair together from the start, the first's kernels `before_s` long, then
    `after_s` from 6 s on, the second's 20 us: (each one's mean share from 70 s on, the highest
    10 s of either from 70 s on, turns alone given). `one_figure`: no turn once a container
    spending has a figure (the rule before)."""
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled
    from vgpu_agent.throttle import soloturn

    specs = (ContainerSpec("c0", 30, check_kernels(before_s), policy="strict",
                           switch_to=check_kernels(after_s), switch_at_s=6.0),
             ContainerSpec("c1", 30, check_kernels(20e-6), policy="strict"))
    sc = Scenario("mixed", specs, lambda name, t: 30.0, seconds)
    due = soloturn.SoloTurns.due
    given = 0

    def counted(self, now_ns, spending, measured, *rest):  # type: ignore[no-untyped-def]
        nonlocal given
        if one_figure and any(a in measured for a in spending):
            return None
        chosen = due(self, now_ns, spending, measured, *rest)
        given += chosen is not None
        return chosen

    soloturn.SoloTurns.due = counted  # type: ignore[method-assign]
    try:
        run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                                   paced=True)
    finally:
        soloturn.SoloTurns.due = due  # type: ignore[method-assign]
    assert not run.errors, run.errors
    means = [statistics.fmean(v for t, v in run.series[c] if t >= 70) for c in ("c0", "c1")]
    highest = max(statistics.fmean(v for t, v in run.series[c] if a <= t < a + 10)
                  for c in ("c0", "c1") for a in range(70, int(seconds) - 9, 5))
    return means, highest, given


def mixed(seconds: float, seeds: int) -> None:
    print("strict 30/30 pairs, together from the start; from 70 s on: mean share per container "
          "and the highest 10 s of either, median (lowest-highest) over seeds; turns given")
    for name, before_s, after_s in MIXED:
        print(f"\n{name}")
        for label, one_figure in (("ours", False), ("one figure", True)):
            got = [asyncio.run(mixed_run(before_s, after_s, seconds, seed, one_figure))
                   for seed in range(seeds)]
            highest = [g[1] for g in got]
            print(f"  {label:10} {_summary([g[0] for g in got])} | highest 10 s "
                  f"{statistics.median(highest):4.1f} ({min(highest):4.1f}-{max(highest):4.1f})"
                  f" | turns {'/'.join(str(g[2]) for g in got)}")


async def unequal_run(seconds: float, seed: int, first_gap_s: float | None = None
                      ) -> tuple[dict[str, list[float]], list[float]]:
    """Strict 30 % of 20 us kernels (c0) beside strict 50 % of 200 us (c1), together from the
    start: (each one's share per 0.1 s, the 0.5 s before; when the turns started, s).
    `first_gap_s`: between turns, first ones too, if not the controller's."""
    from vgpu_agent.simulation.gpu import START_NS
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled

    limits = {"c0": 30.0, "c1": 50.0}
    specs = (ContainerSpec("c0", 30, check_kernels(20e-6), policy="strict"),
             ContainerSpec("c1", 50, check_kernels(200e-6), policy="strict"))
    sc = Scenario("20 us beside 200 us", specs, lambda name, t: limits[name], seconds)
    with turns_counted(first_gap_s) as given:
        run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                                   paced=True)
    assert not run.errors, run.errors
    shares = {name: [share for _, share in run.series[name]] for name in limits}
    return shares, [(at - START_NS) / 1e9 for at, _ in given]


def unequal(seconds: float, seeds: int) -> None:
    print("strict 30 % of 20 us kernels (c0) beside strict 50 % of 200 us (c1), together from "
          "the start; per seed, each one's mean share per 2 s, its highest 5 s; turns (s)")
    for label, first_gap_s in (("ours", None), ("first turns 10 s apart (before)", 10.0)):
        print(f"\n{label}")
        for seed in range(seeds):
            shares, turns = asyncio.run(unequal_run(seconds, seed, first_gap_s))
            for name, got in shares.items():
                per = [statistics.fmean(got[a:a + 20]) for a in range(0, len(got) - 19, 20)]
                highest = max(statistics.fmean(got[a:a + 50]) for a in range(len(got) - 49))
                print(f"  seed {seed} {name}: {' '.join(f'{v:3.0f}' for v in per)} | highest "
                      f"5 s {highest:4.1f}")
            print(f"  seed {seed} turns at {', '.join(f'{t:.1f}' for t in turns)}")


@contextlib.contextmanager
def turns_counted(gap_s: float | None = None) -> Iterator[list[tuple[int, str]]]:
    """While in it, every turn alone started is listed (start ns, container); `gap_s`: the gap
    between turns on a GPU counted busy beyond the work, first turns and re-measures too, if
    not the controller's (`soloturn.SOLO_TURN_GAP_S`, `SOLO_TURN_FIRST_GAP_S`,
    `SOLO_TURN_REMEASURE_GAP_S`)."""
    from vgpu_agent.throttle import soloturn

    start, init = soloturn.SoloTurns.start, soloturn.SoloTurns.__init__
    given: list[tuple[int, str]] = []

    def counted(self, alloc_id, now_ns, paused):  # type: ignore[no-untyped-def]
        given.append((now_ns, alloc_id))
        return start(self, alloc_id, now_ns, paused)

    def spaced(self, **kwargs):  # type: ignore[no-untyped-def]
        init(self, **{**kwargs, "gap_s": gap_s, "first_gap_s": gap_s, "remeasure_gap_s": gap_s})

    soloturn.SoloTurns.start = counted  # type: ignore[method-assign]
    if gap_s is not None:
        soloturn.SoloTurns.__init__ = spaced  # type: ignore[method-assign]
    try:
        yield given
    finally:
        soloturn.SoloTurns.start = start  # type: ignore[method-assign]
        soloturn.SoloTurns.__init__ = init  # type: ignore[method-assign]


async def crowd_run(seconds: float, seed: int, mixed: bool, gap_s: float | None
                    ) -> tuple[list[tuple[float, float]], float | None]:
    """Ten strict 10 % containers together from the start, kernels of 10 and 20 us in turn
    (`mixed`) or all 20 us: (per minute, the lowest and highest container's mean share; when
    the last container's first turn started, s, None if not all had one)."""
    from vgpu_agent.simulation.gpu import START_NS
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled

    specs = tuple(
        ContainerSpec(f"c{n}", 10, check_kernels(10e-6 if mixed and n % 2 else 20e-6),
                      policy="strict")
        for n in range(CROWD))
    sc = Scenario("crowd", specs, lambda name, t: 10.0, seconds)
    with turns_counted(gap_s) as given:
        run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                                   paced=True)
    assert not run.errors, run.errors
    minutes = []
    for a in range(0, int(seconds) - 59, 60):
        means = [statistics.fmean(v for t, v in run.series[f"c{n}"] if a <= t < a + 60)
                 for n in range(CROWD)]
        minutes.append((min(means), max(means)))
    first: dict[str, int] = {}
    for at_ns, alloc_id in given:
        first.setdefault(alloc_id, at_ns)
    done = (max(first.values()) - START_NS) / 1e9 if len(first) == CROWD else None
    return minutes, done


CROWD = 10


def crowd(seconds: float, seeds: int) -> None:
    print(f"{CROWD} strict 10 % containers together from the start; per minute, the lowest and "
          "highest container's mean share, over the seeds; when the last first turn started")
    for mixed in (True, False):
        for label, gap_s in (("ours", None), ("turns a minute apart (before)", 60.0)):
            got = [asyncio.run(crowd_run(seconds, seed, mixed, gap_s)) for seed in range(seeds)]
            print(f"\n{'10 and 20 us kernels' if mixed else 'all 20 us'}, {label}: last first "
                  f"turn at " + "/".join("never" if g[1] is None else f"{g[1]:.0f} s"
                                         for g in got))
            for m in range(len(got[0][0])):
                lows, highs = [g[0][m][0] for g in got], [g[0][m][1] for g in got]
                print(f"  minute {m + 1}: lowest {min(lows):4.1f}-{max(lows):4.1f}, highest "
                      f"{min(highs):4.1f}-{max(highs):4.1f}")


async def gamer_run(seconds: float, seed: int, gaming: bool, gap_s: float | None = None
                    ) -> tuple[list[list[float]], float, int]:
    """The strict 30/30 pair of 20 us kernels, the first gaming its turns where `gaming`:
    (per window of GAMER_WINDOWS, each one's mean share; the first's highest 10 s from 10 s
    on; turns alone given). `gap_s`: between turns on the GPU, if not the controller's."""
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled

    honest = check_kernels(20e-6)
    first = replace(honest, alone_kernel_s=5e-6) if gaming else honest
    specs = (ContainerSpec("c0", 30, first, policy="strict"),
             ContainerSpec("c1", 30, honest, policy="strict"))
    sc = Scenario("gamer", specs, lambda name, t: 30.0, seconds)
    with turns_counted(gap_s) as given:
        run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                                   paced=True)
    assert not run.errors, run.errors
    windows = [(a, min(b, seconds)) for a, b in GAMER_WINDOWS if a < seconds]
    means = [[statistics.fmean(v for t, v in run.series[c] if a <= t < b) for a, b in windows]
             for c in ("c0", "c1")]
    highest = max(statistics.fmean(v for t, v in run.series["c0"] if a <= t < a + 10)
                  for a in range(10, int(seconds) - 9, 5))
    return means, highest, len(given)


GAMER_WINDOWS = ((10.0, 70.0), (70.0, 150.0), (150.0, math.inf))


def gamer(seconds: float, seeds: int) -> None:
    print("strict 30/30 pair of 20 us kernels together from the start; mean share per container "
          "from 10, 70 and 150 s, median (lowest-highest) over seeds; the first's highest 10 s; "
          "turns given")
    for label, gaming, gap_s in (
            ("first gaming", True, None),
            ("first gaming, turns a minute apart (before)", True, 60.0),
            ("both honest", False, None),
            ("both honest, turns a minute apart (before)", False, 60.0)):
        got = [asyncio.run(gamer_run(seconds, seed, gaming, gap_s)) for seed in range(seeds)]
        print(f"\n{label}")
        for c in range(2):
            windows = " | ".join(_summary([[g[0][c][w]] for g in got])
                                 for w in range(len(got[0][0][c])))
            print(f"  c{c}: {windows}")
        highest = [g[1] for g in got]
        print(f"  c0's highest 10 s {statistics.median(highest):4.1f} ({min(highest):4.1f}-"
              f"{max(highest):4.1f}) | turns {'/'.join(str(g[2]) for g in got)}")


async def odd_run(seconds: float, seed: int, alone_kernel_s: float | tuple[float, ...],
                  count: int) -> tuple[list[float], list[float], list[float]]:
    """`count` strict 30 % containers of 20 us kernels together from the start, the first
    running `alone_kernel_s` kernels whenever it finds itself alone (several: one length each
    time, in turn): (each one's mean share from ODD_FROM_S on; its lowest 10 s from then; its
    highest)."""
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled

    honest = check_kernels(20e-6)
    odd = (replace(honest, alone_kernels_s=alone_kernel_s) if isinstance(alone_kernel_s, tuple)
           else replace(honest, alone_kernel_s=alone_kernel_s))
    specs = tuple(ContainerSpec(f"c{n}", 30, odd if n == 0 else honest, policy="strict")
                  for n in range(count))
    run = await run_controlled(Scenario("odd", specs, lambda name, t: 30.0, seconds),
                               plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed), paced=True)
    assert not run.errors, run.errors
    return spread_from(run.series, [spec.name for spec in specs], ODD_FROM_S, seconds)


def spread_from(series: dict[str, list[tuple[float, float]]], names: list[str], from_s: float,
                seconds: float) -> tuple[list[float], list[float], list[float]]:
    """Each container's mean share from `from_s` on, and its lowest and highest over 10 s
    (windows 5 s apart)."""
    means, lowest, highest = [], [], []
    for name in names:
        shares = series[name]
        means.append(statistics.fmean(v for t, v in shares if t >= from_s))
        tens = [statistics.fmean(v for t, v in shares if a <= t < a + 10)
                for a in range(int(from_s), int(seconds) - 9, 5)]
        lowest.append(min(tens))
        highest.append(max(tens))
    return means, lowest, highest


ODD_FROM_S = 30.0  # by then each container of three has had its first turn


def odd(seconds: float, seeds: int) -> None:
    from vgpu_agent.throttle import timesliced

    print(f"strict 30 % containers of 20 us kernels together from the start, the first running "
          f"other kernels while it finds itself alone; from {ODD_FROM_S:g} s on, each one's "
          "mean share, lowest and highest 10 s, median (lowest-highest) over seeds; ours and with the "
          "largest figure setting the scale (before)")
    counted = timesliced._counted_in_scale
    for alone_kernel_s, how in ((80e-6, "heavy (80 us)"), (5e-6, "light (5 us)"),
                                ((5e-6, 80e-6), "light and heavy in turn (5, 80 us)"),
                                ((5e-6, 20e-6), "light and honest in turn (5, 20 us)")):
        for count in (2, 3):
            for label, rule in (("ours", counted), ("largest (before)", set)):
                timesliced._counted_in_scale = rule  # type: ignore[assignment]
                try:
                    got = [asyncio.run(odd_run(seconds, seed, alone_kernel_s, count))
                           for seed in range(seeds)]
                finally:
                    timesliced._counted_in_scale = counted
                print(f"\n{count} containers, the first {how}, {label}")
                for n in range(count):
                    print(f"  c{n}: mean {_summary([[g[0][n]] for g in got])} | lowest 10 s "
                          f"{_summary([[g[1][n]] for g in got])} | highest "
                          f"{_summary([[g[2][n]] for g in got])}")


async def phase_run(seconds: float, seed: int, after_s: float, count: int,
                    max_age_s: float = 0.0) -> tuple[list[float], list[float], int]:
    """`count` strict 30 % containers of 20 us kernels together from the start, the first's
    kernels `after_s` long from PHASE_AT_S on: (each one's mean share from 30 s after the
    change on; its lowest 10 s from 10 s after it; turns alone given after the change).
    `max_age_s`: figures measured again this old (`throttle_figure_max_age_seconds`)."""
    from vgpu_agent.simulation.gpu import START_NS
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled

    specs = (ContainerSpec("c0", 30, check_kernels(20e-6), policy="strict",
                           switch_to=check_kernels(after_s), switch_at_s=PHASE_AT_S),
             *(ContainerSpec(f"c{n}", 30, check_kernels(20e-6), policy="strict")
               for n in range(1, count)))
    with turns_counted() as given:
        run = await run_controlled(Scenario("phase", specs, lambda name, t: 30.0, seconds),
                                   plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                                   paced=True, figure_max_age_s=max_age_s)
    assert not run.errors, run.errors
    means, lowest = [], []
    for spec in specs:
        series = run.series[spec.name]
        means.append(statistics.fmean(v for t, v in series if t >= PHASE_AT_S + 30))
        lowest.append(min(statistics.fmean(v for t, v in series if a <= t < a + 10)
                          for a in range(int(PHASE_AT_S) + 10, int(seconds) - 9, 5)))
    after = sum((ns - START_NS) / 1e9 >= PHASE_AT_S for ns, _ in given)
    return means, lowest, after


PHASE_AT_S = 40.0  # the first container's change of phase, well after every first turn
PHASE_MAX_AGE_S = 60.0  # `throttle_figure_max_age_seconds` of the third variant


def phase(seconds: float, seeds: int) -> None:
    from vgpu_agent.throttle.timesliced import TimeSlicedSplit

    print(f"strict 30 % containers of 20 us kernels together from the start, the first's "
          f"kernels lighter from {PHASE_AT_S:g} s on (the same grid); each one's mean share from "
          f"{PHASE_AT_S + 30:g} s on and lowest 10 s from {PHASE_AT_S + 10:g} s on, median "
          "(lowest-highest) over seeds; turns given after the change, per seed; ours and with "
          "no figure measured afresh for being long at odds with the periods (before)")
    stale = TimeSlicedSplit.stale
    for after_s in (10e-6, 5e-6):
        for count in (2, 3):
            variants = [("ours", stale, 0.0), ("not asked (before)", lambda self: set(), 0.0)]
            if after_s == 10e-6:  # what the periods do not show: measured again by age
                variants.append((f"ours, figures measured again after {PHASE_MAX_AGE_S:g} s",
                                 stale, PHASE_MAX_AGE_S))
            for label, asked, max_age_s in variants:
                TimeSlicedSplit.stale = asked  # type: ignore[method-assign]
                try:
                    got = [asyncio.run(phase_run(seconds, seed, after_s, count, max_age_s))
                           for seed in range(seeds)]
                finally:
                    TimeSlicedSplit.stale = stale  # type: ignore[method-assign]
                print(f"\n{count} containers, the first's kernels {after_s * 1e6:g} us from "
                      f"{PHASE_AT_S:g} s, {label}")
                for n in range(count):
                    print(f"  c{n}: mean {_summary([[g[0][n]] for g in got])} | lowest 10 s "
                          f"{_summary([[g[1][n]] for g in got])}")
                print(f"  turns after the change {'/'.join(str(g[2]) for g in got)}")


H200_PERIOD_S = 0.2  # `H200_TIME_SLICED`'s NVML sample period, as the runs here set it
FLIP_FROM_S = 30.0  # by then each container of three has had its first turn
# the flipper's kernels change this often: of flips every 5 s (80 and 20 us) the watch found
# one in 18 (the periods' odds moved too little for too short), of these one in about 40 s
# (one seed each)
FLIP_EVERY_S = 15.0
FLIP_CHANGE_AT_S = 82.5  # the honest third's change of phase, mid-way through a flip


def flipping_spec(name: str, seconds: float):  # type: ignore[no-untyped-def]
    """A strict 30 % container whose kernels go 80 us and 5 us in turn, FLIP_EVERY_S each,
    from FLIP_FROM_S to `seconds` (one process per stretch, as `ContainerSpec.phases` runs a
    change of phase)."""
    from vgpu_agent.simulation.runner import ContainerSpec

    @dataclass(frozen=True)
    class Flipping(ContainerSpec):
        def phases(self):  # type: ignore[no-untyped-def]
            stretches = [("", check_kernels(20e-6, ((0.0, FLIP_FROM_S),)))]
            start, n = FLIP_FROM_S, 0
            while start < seconds:
                end = min(seconds, start + FLIP_EVERY_S)
                kernel_s = 80e-6 if n % 2 == 0 else 5e-6
                stretches.append((f"-f{n}", check_kernels(kernel_s, ((start, end),))))
                start, n = end, n + 1
            return stretches

    return Flipping(name, 30, check_kernels(20e-6), policy="strict")


async def flipper_run(seconds: float, seed: int
                      ) -> tuple[list[float], list[float], list[float], float | None]:
    """Three strict 30 % containers, the first flipping (`flipping_spec`), the third's kernels
    80 us from FLIP_CHANGE_AT_S: (each one's mean share from FLIP_FROM_S on; its lowest and
    highest 10 s from then; how long after its change the split's watch first named the third,
    None: never). Time is told by the periods the split has seen (every one of the H200's is
    delivered), from the start."""
    from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
    from vgpu_agent.simulation.runner import ContainerSpec, PlantSpec, Scenario, run_controlled
    from vgpu_agent.throttle import timesliced

    specs = (flipping_spec("c0", seconds),
             ContainerSpec("c1", 30, check_kernels(20e-6), policy="strict"),
             ContainerSpec("c2", 30, check_kernels(20e-6), policy="strict",
                           switch_to=check_kernels(80e-6), switch_at_s=FLIP_CHANGE_AT_S))
    learn = timesliced.TimeSlicedSplit._learn_costs
    found: list[float] = []  # seconds after c2's change at which the watch named it
    change = FLIP_CHANGE_AT_S / H200_PERIOD_S  # the periods before it

    def watched(self, owners, tokens):  # type: ignore[no-untyped-def]
        before = set(self.relearning)
        learn(self, owners, tokens)
        if self.periods >= change and "c2" in self.relearning - before:
            found.append((self.periods - change) * H200_PERIOD_S)

    timesliced.TimeSlicedSplit._learn_costs = watched  # type: ignore[method-assign]
    try:
        run = await run_controlled(Scenario("flipper", specs, lambda name, t: 30.0, seconds),
                                   plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed), paced=True)
    finally:
        timesliced.TimeSlicedSplit._learn_costs = learn  # type: ignore[method-assign]
    assert not run.errors, run.errors
    means, lowest, highest = spread_from(run.series, [spec.name for spec in specs], FLIP_FROM_S,
                                         seconds)
    return means, lowest, highest, (found[0] if found else None)


def flipper(seconds: float, seeds: int) -> None:
    from vgpu_agent.throttle import timesliced

    print(f"three strict 30 % containers of 20 us kernels together from the start; c0's "
          f"kernels 80 and 5 us in turn, {FLIP_EVERY_S:g} s each, from {FLIP_FROM_S:g} s on; "
          f"c2's 80 us from {FLIP_CHANGE_AT_S:g} s on; each one's mean share, lowest and "
          f"highest 10 s from {FLIP_FROM_S:g} s on, median (lowest-highest) over seeds; when "
          "the watch named c2 after its change, per seed; ours and with the watch not asked "
          "while any cost re-learns (before)")
    standing = timesliced._standing

    def blind(chances, drawn, relearning):  # type: ignore[no-untyped-def]
        if any(a in chances for a in relearning):
            return {}, []
        return chances, drawn

    for label, rule in (("ours", standing), ("not asked while any re-learns (before)", blind)):
        timesliced._standing = rule
        try:
            got = [asyncio.run(flipper_run(seconds, seed)) for seed in range(seeds)]
        finally:
            timesliced._standing = standing
        print(f"\n{label}")
        for n in range(3):
            print(f"  c{n}: mean {_summary([[g[0][n]] for g in got])} | lowest 10 s "
                  f"{_summary([[g[1][n]] for g in got])} | highest "
                  f"{_summary([[g[2][n]] for g in got])}")
        print("  c2's change found after (s) "
              + "/".join("never" if g[3] is None else f"{g[3]:.1f}" for g in got))


def main() -> int:
    import structlog

    from vgpu_agent.throttle import timesliced

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--together", type=float, default=45.0,
                        help="seconds all containers run together (the last 10 are judged: "
                             "by 35 s three containers starting together have had their turns, "
                             "10 s apart)")
    parser.add_argument("--long", type=float, default=0.0,
                        help="seconds together for the long run of one pair (0: the cases)")
    parser.add_argument("--mixed", type=float, default=0.0,
                        help="seconds of the pairs whose kernels differ or change (0: the "
                             "cases)")
    parser.add_argument("--crowd", type=float, default=0.0,
                        help=f"seconds of {CROWD} containers together on one GPU (0: the cases)")
    parser.add_argument("--gamer", type=float, default=0.0,
                        help="seconds of the pair whose first container games its turns "
                             "(0: the cases)")
    parser.add_argument("--odd", type=float, default=0.0,
                        help="seconds of the pair and the trio whose first container runs "
                             "other kernels while alone (0: the cases)")
    parser.add_argument("--phase", type=float, default=0.0,
                        help="seconds of the pair and the trio whose first container's kernels "
                             "become lighter (0: the cases)")
    parser.add_argument("--flipper", type=float, default=0.0,
                        help="seconds of the trio whose first container changes phase over and "
                             "over, and whose third changes once (0: the cases)")
    parser.add_argument("--unequal", type=float, default=0.0,
                        help="seconds of the strict 30/50 pair of 20 us beside 200 us kernels "
                             "(0: the cases)")
    args = parser.parse_args()
    runs = (("crowd", 60.0, crowd), ("gamer", 90.0, gamer), ("mixed", 90.0, mixed),
            ("odd", 60.0, odd), ("phase", PHASE_AT_S + 40, phase),
            ("flipper", FLIP_CHANGE_AT_S + 30, flipper),
            ("unequal", 20.0, unequal))
    for name, least, run in runs:
        seconds = getattr(args, name)
        if not seconds:
            continue
        if seconds < least:
            parser.error(f"--{name} must be >= {least:g} s, got {seconds}")
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
        print(f"machine: {machine.describe()}; plant H200_TIME_SLICED, {args.seeds} seeds")
        run(seconds, args.seeds)
        return 0
    if args.long:
        if args.long < 60:
            parser.error(f"--long must be >= 60 s, got {args.long}")
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
        print(f"machine: {machine.describe()}; plant H200_TIME_SLICED, {args.seeds} seeds; "
              f"limits 30/30, 20 us kernels, the first alone first, {args.long:g} s together")
        for seed in range(args.seeds):
            asyncio.run(long_run(args.long, seed))
        return 0
    if args.together < 10:
        parser.error(f"--together must be >= 10 s (the last 10 are judged), got {args.together}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(f"machine: {machine.describe()}; plant H200_TIME_SLICED, {args.seeds} seeds")
    print("mean share over the last 10 s, median (lowest-highest) over seeds, per container")
    margin = timesliced.ALONE_MARGIN
    for limits, kernel_s in CASES:
        for alone in (len(limits), 1, 0):
            runs: dict[str, list[list[float]]] = {"ours": [], "no bound": [], "peer": []}
            if not alone:
                runs["no turn"] = []
            for seed in range(args.seeds):
                runs["ours"].append(asyncio.run(
                    held(limits, kernel_s, alone, seed, args.together)))
                if not alone:
                    runs["no turn"].append(asyncio.run(
                        held(limits, kernel_s, alone, seed, args.together, solo_turns=False)))
                timesliced.ALONE_MARGIN = math.inf
                try:
                    runs["no bound"].append(asyncio.run(
                        held(limits, kernel_s, alone, seed, args.together)))
                finally:
                    timesliced.ALONE_MARGIN = margin
                runs["peer"].append(
                    peer_held(limits, kernel_s, alone, seed, args.together))
            start = {0: "together from the start", 1: "the first alone first"}.get(
                alone, "each alone first")
            print(f"\nlimits {'/'.join(f'{v:g}' for v in limits)}, {kernel_s * 1e6:g} us kernels, "
                  f"{start}")
            for name, got in runs.items():
                print(f"  {name:9} {_summary(got)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

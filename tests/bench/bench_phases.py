"""How fast a container gets its share back once its tokens come to buy far less SM time.

    python tests/bench/bench_phases.py [--seeds 3] [--cases NAME,...] [--baseline DIR]

On the simulated GPU (its `REAL` imperfections), a strict 40 % container beside a strict 60 %
one; at 10 s its application moves to kernels whose tokens buy far less: kernels 100 or 1,000
times shorter for the same grid, grids 200 or 5,000 times larger for the same time, blocks of
50 times the threads. Two plants: NVML samples every 1/6 s (sigma 3) and every second
(sigma 8). Per case and plant, over the seeds: when the container is back within 3 points of
40 % for good (s after the change, `never` within 30 s), the most its neighbour and it used
over any 1 s window after the change (both are strict), and how many ticks the controller took
its claims for a lie or its use for one its rate does not hold (it is honest). With
`--baseline DIR` the same runs are made with the code in DIR (another checkout) and printed
below this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLANTS = ((1 / 6, 3.0), (1.0, 8.0))
CASES = {  # name: keyword arguments of the workload after the change
    "kernels /100": {"kernel_s": 0.002 / 100},
    "kernels /1000": {"kernel_s": 0.002 / 1000},
    "grids x200": {"kernel_s": 0.0002, "blocks": 1024 * 20},
    "grids x5000": {"kernel_s": 0.0002, "blocks": 1024 * 500},
    "threads x50": {"kernel_s": 0.0002, "threads_per_block": 256 * 50},
}


# when back (s after the change, None: never), the neighbour's and its own most over 1 s, catches
Row = tuple[float | None, float, float, int]


async def one(case: str, period_s: float, sigma: float, seed: int) -> Row:
    import structlog

    from vgpu_agent.simulation.gpu import Workload
    from vgpu_agent.simulation.imperfections import REAL
    from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    plant = PlantSpec(imperfections=replace(REAL, nvml_sigma=sigma), sample_period_s=period_s,
                      seed=seed)
    run = ControlledRun((
        ContainerSpec("a", 60.0, Workload(kernel_s=0.0002), policy="strict"),
        ContainerSpec("b", 40.0, Workload(kernel_s=0.002), policy="strict",
                      switch_to=Workload(**CASES[case]), switch_at_s=10.0),  # type: ignore[arg-type]
    ), plant=plant, paced=True)
    await run.advance(40.0)
    b = run.gpu.shares(run.procs["b"][1], 1.0)
    a = run.gpu.shares(run.procs["a"][0], 1.0)
    per_s = round(1.0 / (b[1][0] - b[0][0]))  # bins a second
    back = next((t - 10 for i, (t, _) in enumerate(b)
                 if t > 10 and all(abs(v - 40) < 3 for _, v in b[i::per_s])), None)
    return (back, max(v for t, v in a if t > 11), max(v for t, v in b if t > 11),
            sum(run.controller.error_counts.get(kind, 0)
                for kind in ("tokens_overclaimed", "use_over_target")))


def measure(cases: list[str], seeds: int) -> dict[str, list[Row]]:
    return {f"{case}|{period}|{sigma}": [asyncio.run(one(case, period, sigma, seed))
                                         for seed in range(seeds)]
            for case in cases for period, sigma in PLANTS}


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, list[Row]]:
    from tests.bench.children import run_child

    found: dict[str, list[Row]] = run_child(
        __file__, tree, ["--seeds", str(args.seeds), "--cases", args.cases], "the cases")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: allowed {list(CASES)}")
    if args.child:
        print(json.dumps(measure(cases, args.seeds)))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    trees = {"this tree": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    print(f"python {sys.version.split()[0]}, seeds 0-{args.seeds - 1}; the strict-40 container "
          "after its change at 10 s; a: its strict-60 neighbour")
    print(f"{'case':14} {'plant':10} {'tree':10} {'back (s after)':24} {'a max':>6} "
          f"{'b max':>6} {'caught':>12}")
    results = {name: run_tree(tree, args) for name, tree in trees.items()}
    for key in next(iter(results.values())):
        case, period, sigma = key.split("|")
        plant = f"{float(period):.2f}s s{float(sigma):.0f}"
        for name, found in results.items():
            rows = found[key]
            back = ", ".join("never" if r[0] is None else f"{r[0]:.1f}" for r in rows)
            print(f"{case:14} {plant:10} {name:10} {back:24} {max(r[1] for r in rows):6.1f} "
                  f"{max(r[2] for r in rows):6.1f} {[r[3] for r in rows]!s:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

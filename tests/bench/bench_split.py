"""What sharing a crowded time-sliced GPU's use out costs, per batch, and whether it changed.

    python tests/bench/bench_split.py [--containers 18] [--batches 3000] [--rounds 5]
                                      [--baseline DIR]

`throttle/timesliced.TimeSlicedSplit.share` as the controller calls it once per tick with new
samples on a time-sliced GPU, for a crowd like `bench_scrape.py`'s (18 strict containers a GPU):
first each container's turn alone (ten batches: its figure), then batches of one or two sample
periods each, every period given to one container with odds of its SM time (its tokens times a
cost of its own, 0.5-2), tokens drawn around 1,000 a batch, and now and then a container that
spends nothing. The same batches (seeded) for every run. Per run: the median and p99 of the time
one call takes (perf_counter, microseconds), and a digest of every share and learned cost it
returned. With `--baseline DIR` the same runs are made with the code in DIR (another checkout),
alternating, and the medians of the runs are printed side by side with their ratio; where the
digests differ, the two trees split the same batches differently (a change that was to keep every
decision did not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TURN_BATCHES = 10


def measure(containers: int, batches: int, seed: int = 1) -> dict[str, object]:
    from vgpu_agent.throttle import timesliced
    from vgpu_agent.throttle.timesliced import TimeSlicedSplit

    rng, split = random.Random(seed), TimeSlicedSplit()
    crowd = [f"c{n:02d}" for n in range(containers)]
    cost = {alloc_id: rng.uniform(0.5, 2.0) for alloc_id in crowd}
    digest = hashlib.sha256()
    took: list[float] = []
    for n in range(containers * TURN_BATCHES + batches):
        if n < containers * TURN_BATCHES:
            solo = crowd[n // TURN_BATCHES]  # its turn alone: the others paused
            spent = {alloc_id: 1000 if alloc_id == solo else 0 for alloc_id in crowd}
            owners, busy = [[solo]], 100.0 * cost[solo] / 4
        else:
            solo = ""
            spent = {alloc_id: 0 if rng.random() < 0.02 else max(0, round(rng.gauss(1000, 80)))
                     for alloc_id in crowd}
            work = [spent[alloc_id] * cost[alloc_id] for alloc_id in crowd]
            periods = 1 if rng.random() < 0.6 else 2
            owners = [rng.choices(crowd, weights=work) for _ in range(periods)]
            busy = 100.0
        started = time.perf_counter()
        shares = split.share(owners, busy, spent, 0.1, (), solo)
        took.append((time.perf_counter() - started) * 1e6)
        digest.update(json.dumps(sorted((a, round(s, 9)) for a, s in shares.items())).encode())
        digest.update(repr(sorted(split.costs.items())).encode())
    shared = sorted(took[containers * TURN_BATCHES :])
    return {"median_us": statistics.median(shared),
            "p99_us": shared[min(len(shared) - 1, int(0.99 * len(shared)))],
            "figures": len(split.measured()), "digest": digest.hexdigest()[:16],
            "code": str(Path(timesliced.__file__).resolve().parents[2])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=18)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.containers < 2 or args.batches < 100:
        parser.error(f"need --containers >= 2 and --batches >= 100, got {args.containers} "
                     f"and {args.batches}")
    if args.child:
        print(json.dumps(measure(args.containers, args.batches)))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    from tests.bench.children import run_child

    trees = {"this tree": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():  # alternating: one load for both
            runs[name].append(run_child(
                __file__, tree, ["--containers", str(args.containers), "--batches",
                                 str(args.batches)], f"the {name}'s batches"))
    from tests.bench import machine

    print(f"{machine.describe()}, {args.containers} "
          f"containers sharing one time-sliced GPU, {args.batches} batches after their turns, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print(f"\n{'us per batch':14}" + "".join(f"{name:>22}" for name in trees)
          + ("     ratio" if len(trees) > 1 else ""))
    for part in ("median_us", "p99_us"):
        medians = [statistics.median(r[part] for r in rs) for rs in runs.values()]
        line = f"{part[:-3]:14}" + "".join(
            f"{m:>14.1f} ({min(r[part] for r in rs):5.1f})"
            for m, rs in zip(medians, runs.values(), strict=True))
        if len(medians) > 1:
            line += f"     x{medians[0] / medians[1]:.2f}"
        print(line)
    digests = {name: {r["digest"] for r in rs} for name, rs in runs.items()}
    figures = {name: rs[0]["figures"] for name, rs in runs.items()}
    print("\ncode measured: " + ", ".join(f"{name} {rs[0]['code']}" for name, rs in runs.items()))
    print(f"figures trusted at the end: {figures}; digests of the shares and costs: "
          + ", ".join(f"{name} {' '.join(sorted(d))}" for name, d in digests.items()))
    if len({frozenset(d) for d in digests.values()}) > 1:
        print("the trees split the same batches differently")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

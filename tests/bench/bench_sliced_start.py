"""The whole agent's first minutes on a node without MPS, window by window.

    python tests/bench/bench_sliced_start.py [--windows 6] [--seconds 30] [--runs 2]
                                             [--baseline DIR]

`bench_scrape.py`'s node at 144 container-devices (8 GPUs, 18 strict containers each, honest
shims, drivers that time-slice as an H200 without MPS does: `bench_scrape.time_sliced`), the
whole agent in a child process from its start: its CPU in % of a core over each window of
`--seconds`, the turns alone it had given by the window's end (its own
`vgpu_gpu_throttle_solo_turns_total`, summed over the GPUs) and the containers then awaiting a
figure of their own (`vgpu_gpu_throttle_unmeasured_containers`, summed; "-" for a tree without
it). `bench_scrape.py --time-sliced`
measures one window after its settle; this shows what comes before and after it, while the
containers' first turns alone run. With `--baseline DIR` each run is made with the code in DIR
(another checkout) too, alternating, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def windows(count: int, seconds: float) -> list[tuple[float, float, float | None]]:
    """(CPU %, turns given by then, containers awaiting a figure then) per window, on this
    checkout's code."""
    from tests.bench import bench_scrape as node
    from vgpu_agent.shm.regions import REGIONS_DIR

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-sliced-") as tmp:
        root = Path(tmp)
        regions = root / "state" / REGIONS_DIR
        regions.mkdir(parents=True)
        rows = node.build_regions(root, 8, node.containers_for(144), regions, "strict")
        shim = node.ShimSide(regions, rows, accounting=node.Accounting(root / "nvml", rows))
        with shim.moving(), node.running_node(root, 8, sliced=True) as (child, port):
            for _ in range(count):
                before = node.cpu_seconds(child.pid)
                node.pause_with_shim(shim, seconds)
                cpu = (node.cpu_seconds(child.pid) - before) / seconds * 100
                # (a tree without the gauge of containers awaiting a figure gives no third)
                awaiting = (node.series_sum(port, "vgpu_gpu_throttle_unmeasured_containers")
                            if hasattr(node, "series_sum") else None)
                out.append((round(cpu, 2), node.solo_turns(port), awaiting))
    return out


def run_tree(tree: Path, args: argparse.Namespace) -> list[tuple[float, float, float | None]]:
    from tests.bench.children import run_child

    found = run_child(__file__, tree, ["--windows", str(args.windows), "--seconds",
                                       str(args.seconds)], "the agent's first minutes")
    return [(row[0], row[1], row[2] if len(row) > 2 else None) for row in found]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=30.0, help="each window, s")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(windows(args.windows, args.seconds)))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    from tests.bench import machine

    print(f"{machine.describe()}, 144 container-devices, "
          f"time-sliced drivers, windows of {args.seconds:g} s", flush=True)
    trees = [("this tree", REPO)] + ([("baseline", args.baseline)] if args.baseline else [])
    for run in range(args.runs):
        for name, tree in trees:
            started = time.monotonic()
            got = run_tree(tree, args)
            print(f"run {run + 1}, {name} ({time.monotonic() - started:.0f} s): CPU % "
                  + ", ".join(f"{cpu:.2f}" for cpu, _, _ in got)
                  + "; turns alone by each window's end: "
                  + ", ".join(f"{turns:.0f}" for _, turns, _ in got)
                  + "; containers awaiting a figure then: "
                  + ", ".join("-" if awaiting is None else f"{awaiting:.0f}"
                              for _, _, awaiting in got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

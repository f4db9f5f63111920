"""The whole agent's CPU, window by window, this tree beside another checkout.

    python tests/bench/bench_node.py [--devices 144] [--attribution per-process|time-sliced]
                                     [--changing | --phase-every S] [--scrape-every 0]
                                     [--windows 3]
                                     [--seconds 20] [--settle 30] [--rounds 3]
                                     [--baseline DIR] [--by-part] [--nvml-call-ms 0]
                                     [--nvml-poll-periods N]

`bench_scrape.py`'s node (8 simulated GPUs, strict containers, honest shims whose spending the
simulated drivers turn into NVML samples) with the whole agent in a child process: after
`--settle` seconds (3 with `--changing`, as `bench_scrape.py` waits), its CPU in % of a core over
each of `--windows` windows of `--seconds`. `--changing`: the work a token buys changes every
other 2 s for every container and the agent's tick is held at 100 ms (`bench_scrape.py`'s
"changing"). `--phase-every S`: each container's work a token buys doubles or halves every
S seconds, at a moment of its own within them, and the agent runs at its own pace, as it would
on a node whose applications change phase now and then (at 18 containers a GPU and S = 30, a
GPU sees a change every 1.7 s on average). `--scrape-every S`: a scrape every S seconds during
the windows (0: none).

Beside each window's CPU, how closely the agent held the containers to their shares over it:
the mean of |exact use - limit| over every container-device's sample periods, in points of a
GPU (`Accounting.tracking`: the use the simulated drivers derive from the tokens spent, before
NVML's rounding; every container wants more than its share, so its share is what it should
get).

The goals at 144 container-devices are absolute (`bench_scrape.py`), but this machine's pace
moves by half from one day to the next, and two runs minutes apart differ by more than most
changes do. With `--baseline DIR` every run is made with the code in DIR (another checkout)
too, alternating run by run, so that both see the same machine; the medians of all windows are
printed side by side with their ratio.

`--by-part`: each window's CPU is also split by part (`tests/bench/nodeparts.py`: the agent's
supervised tasks and NVML's calls, from its own metrics, and its threads, from /proc), the
medians printed per tree. The agent is scraped at both ends of each window for it (about 10 ms
of its CPU each time): the parts' `agent` includes the scrape that ends the window, the
window's own figure neither.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def windows(args: argparse.Namespace) -> dict[str, list[Any]]:
    """Per window, on this checkout's code: CPU % of a core (`cpu`), how far the containers
    were held off their shares (`track`, points; None where no sample period ended) and, with
    `--by-part`, the CPU by part (`parts`; else empty)."""
    from tests.bench import bench_scrape as node
    from vgpu_agent.shm.regions import REGIONS_DIR

    nodeparts = _nodeparts()

    sliced = args.attribution == "time-sliced"
    out = []
    parts: list[dict[str, float]] = []

    def read_parts(pid: int, port: int) -> dict[str, float]:
        return nodeparts.read(pid, node.scrape(port)[1].decode())
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        root = Path(tmp)
        regions = root / "state" / REGIONS_DIR
        regions.mkdir(parents=True)
        rows = node.build_regions(root, 8, node.containers_for(args.devices), regions, "strict")
        accounting = node.Accounting(root / "nvml", rows)
        shim = node.ShimSide(regions, rows, accounting=accounting)
        accounting.changing = args.changing or bool(args.phase_every)
        if args.phase_every:
            if not hasattr(accounting, "phase_every_us"):
                raise SystemExit("this tree's bench node has no --phase-every")
            accounting.phase_every_us = round(args.phase_every * 1e6)
        tracked = getattr(accounting, "tracking", lambda: (0.0, 0))
        track: list[float | None] = []
        with shim.moving(), node.running_node(root, 8, args.changing, sliced=sliced,
                                          nvml_call_ms=args.nvml_call_ms,
                                          nvml_poll_periods=args.nvml_poll_periods) as (
                child, port):
            node.pause_with_shim(shim, args.settle)
            for _ in range(args.windows):
                at_start = read_parts(child.pid, port) if args.by_part else {}
                error_before = tracked()
                before, started = node.cpu_seconds(child.pid), time.monotonic()
                while time.monotonic() - started < args.seconds:
                    if args.scrape_every:
                        node.scrape(port)
                    left = args.seconds - (time.monotonic() - started)
                    node.pause_with_shim(shim, min(left, args.scrape_every or left))
                took = time.monotonic() - started
                out.append(round((node.cpu_seconds(child.pid) - before) / took * 100, 3))
                error_after = tracked()
                periods = error_after[1] - error_before[1]
                track.append(round((error_after[0] - error_before[0]) / periods, 3)
                             if periods else None)
                if args.by_part:
                    parts.append(nodeparts.shares(at_start, read_parts(child.pid, port),
                                                  time.monotonic() - started))
    return {"cpu": out, "parts": parts, "track": track}


def _nodeparts() -> Any:
    """This script's own `nodeparts` (a baseline tree's child runs this script on that tree's
    code, which may be older than the module)."""
    spec = importlib.util.spec_from_file_location(
        "bench_nodeparts", Path(__file__).resolve().parent / "nodeparts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_args(args: argparse.Namespace) -> list[str]:
    return ["--devices", str(args.devices), "--attribution", args.attribution,
            *(["--changing"] if args.changing else []),
            *(["--phase-every", str(args.phase_every)] if args.phase_every else []),
            "--scrape-every",
            str(args.scrape_every), "--windows", str(args.windows), "--seconds",
            str(args.seconds), "--settle", str(args.settle),
            *(["--by-part"] if args.by_part else []),
            *(["--nvml-call-ms", str(args.nvml_call_ms)] if args.nvml_call_ms else []),
            *(["--nvml-poll-periods", str(args.nvml_poll_periods)]
              if args.nvml_poll_periods is not None else [])]


def part_table(by_part: dict[str, list[dict[str, float]]]) -> str:
    """Each part's median over the windows, % of a core, a column per tree; a part a tree's
    agent does not export is "-". Tasks run on the event loop's thread, within its figure."""
    names = list(by_part)
    parts = sorted({part for windows in by_part.values() for w in windows for part in w},
                   key=lambda p: (p != "agent", p))
    lines = ["CPU by part, median over the windows, % of a core (task: within the event "
             "loop's thread; per s: a count a second, not CPU)", f"{'':34}" + "".join(f"{name:>14}" for name in names)]
    for part in parts:
        cells = []
        for name in names:
            values = [w[part] for w in by_part[name] if part in w]
            cells.append(f"{statistics.median(values):>14.2f}" if values else f"{'-':>14}")
        lines.append(f"{part:34}" + "".join(cells))
    return "\n".join(lines) + "\n"


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"median {statistics.median(ordered):.2f} %, min {ordered[0]:.2f}, "
            f"max {ordered[-1]:.2f} ({len(ordered)} windows)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=144, help="container-devices, about")
    parser.add_argument("--attribution", choices=("per-process", "time-sliced"),
                        default="per-process",
                        help="how the simulated drivers attribute each sample period")
    changes = parser.add_mutually_exclusive_group()
    changes.add_argument("--changing", action="store_true",
                         help="what a token buys changes, the tick held at 100 ms")
    changes.add_argument("--phase-every", type=float, default=0.0,
                         help="each container changes phase every this many seconds, the "
                              "agent at its own pace; 0: never")
    parser.add_argument("--scrape-every", type=float, default=0.0,
                        help="a scrape every this many seconds in the windows; 0: none")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="each window, s")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds from the agent's start to the first window (default 30, "
                             "3 with --changing)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--nvml-call-ms", type=float, default=0.0,
                        help="CPU each NVML per-process call burns, as a real driver's do "
                             "(about 2.2 ms on an H200); 0: the simulated driver's own")
    parser.add_argument("--nvml-poll-periods", type=int,
                        help="the agent's throttle_nvml_poll_periods: NVML asked once every "
                             "this many sample periods (default: the agent's)")
    parser.add_argument("--by-part", action="store_true",
                        help="split each window's CPU by task, NVML's calls and thread")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.settle is None:
        args.settle = 3.0 if args.changing else 30.0
    for name in ("devices", "windows", "rounds", "nvml_poll_periods"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more, "
                         f"got {getattr(args, name)!r}")
    for name in ("seconds", "settle", "scrape_every", "phase_every"):
        value = getattr(args, name)
        if not 0 <= value < float("inf") or (name == "seconds" and value == 0):
            parser.error(f"--{name.replace('_', '-')} must be a number of seconds "
                         f"{'> 0' if name == 'seconds' else '>= 0'}, got {value!r}")
    if args.baseline is not None and not (args.baseline / "tests" / "bench").is_dir():
        parser.error(f"--baseline {str(args.baseline)!r} is not a checkout of this project "
                     "(no tests/bench in it)")
    if args.child:
        print(json.dumps(windows(args)))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    from tests.bench import machine
    from tests.bench.children import run_child

    print(f"{machine.describe()}, {args.devices} "
          f"container-devices, {args.attribution} drivers, "
          + ("shares changing, " if args.changing else
             f"each container changing phase every {args.phase_every:g} s, "
             if args.phase_every else "steady, ")
          + (f"a scrape every {args.scrape_every:g} s, " if args.scrape_every else "unscraped, ")
          + ("" if args.nvml_poll_periods is None else "NVML asked every period, "
             if args.nvml_poll_periods == 1 else
             f"NVML asked every {args.nvml_poll_periods} periods, ")
          + f"{args.windows} windows of {args.seconds:g} s after {args.settle:g} s, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    trees = [("this tree", REPO)] + ([("baseline", args.baseline)] if args.baseline else [])
    found: dict[str, list[float]] = {name: [] for name, _ in trees}
    tracks: dict[str, list[float]] = {name: [] for name, _ in trees}
    by_part: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for run in range(args.rounds):
        for name, tree in trees:  # alternating: both see the same machine
            got = run_child(__file__, tree, child_args(args), "the node's windows")
            by_part[name] += got["parts"]
            tracks[name] += [t for t in got["track"] if t is not None]
            found[name] += got["cpu"]
            print(f"round {run + 1}, {name}: " + ", ".join(f"{v:.2f}" for v in got["cpu"])
                  + " %; off their shares by " + ", ".join(
                      "-" if t is None else f"{t:.2f}" for t in got["track"]) + " points",
                  flush=True)
    print()
    if args.by_part:
        print(part_table(by_part))
    for name, values in found.items():
        print(f"{name}: {summary(values)}; off their shares by "
              + (f"{statistics.median(tracks[name]):.2f} points (median of the windows)"
                 if tracks[name] else "- (no sample period ended in a window)"))
    if args.baseline is not None:
        ours, theirs = (statistics.median(found[name]) for name, _ in trees)
        print(f"ratio of the medians, this tree / baseline: x{ours / theirs:.2f}"
              if theirs > 0 else "ratio: - (the baseline's median is 0)")
    print(f"load average {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one controller tick costs at 144 busy container-devices, by part, in one process.

    python tests/bench/bench_tick.py [--devices 144] [--ticks 150] [--rounds 4] [--baseline DIR]
                                     [--attribution per-process|time-sliced|both]

`bench_scrape.py`'s node (8 simulated GPUs, real region files, a shim-like writer moving every
region's counters) with NVML samples of its own every 1/6 s (steady or flipping between 5 and
10 % every 2 s, whatever the containers spend: not `bench_scrape`'s spend-driven accounting),
with the controller ticked directly every 100 ms of the monotonic clock (as on a node, where
its regions' headers are read in one batch) and its NVML calls kept on the loop, so that each
part can be timed: the law, the reads (`state` headers, `control`, NVML; `headers` alone: the
batched read of the regions' headers) and the steering glue (everything else of a GPU's
steering: observations, change test, rate writes). CPU time per tick for the whole tick, wall
time per part. A run ticks for real: (`--ticks` + 50) / 10 s. With `--baseline DIR` the same
runs are made with the code in DIR (another checkout), alternating, and the medians are printed
side by side with their ratio.

`--attribution time-sliced` has the simulated driver sample as an H200 without MPS does: each
sample period goes whole to one process (in turn, every container's process that spent since
the GPU's last sample as often: one paused for another's turn alone is given none), with the
whole GPU's use as its value (those containers' samples above, summed, at most 100), so the
controller reads its GPUs as time-sliced: it shares their use out by the tokens spent and the
periods (`throttle/timesliced.py`) and gives containers turns alone (`throttle/turnkeeper.py`),
as it would on such a node. `both` runs the two in alternation and prints the ratio of
time-sliced to per-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[2]
if TYPE_CHECKING:
    from vgpu_agent.gpu.model import ProcessSample
PARTS = ("tick_cpu", "law", "reads", "headers", "glue")


def measure(devices: int, ticks: int, changing: bool, sliced: bool = False
            ) -> dict[str, float]:
    import structlog

    from tests.bench import bench_scrape as node
    from tests.fakes.hostproc import FakeHostProc
    from vgpu_agent.gpu.model import ProcessSample
    from vgpu_agent.gpu.sim import SimBackend
    from vgpu_agent.shm.regions import Region
    from vgpu_agent.throttle.controller import ThrottleController

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory(prefix="bench-tick-") as tmp:
        root = Path(tmp)
        rows = node.build_regions(root, 8, node.containers_for(devices))
        regions = [Region.open(root / str(row["alloc_id"])) for row in rows]
        backend = SimBackend("8xA100-80GB")
        backend.start()
        pids: dict[str, list[int]] = {}
        on_gpu: dict[str, list[tuple[int, int]]] = {}  # per GPU: (container, device) by pid
        for n, (region, row) in enumerate(zip(regions, rows, strict=True)):
            for dev, uuid in enumerate(region.device_uuids):
                pids.setdefault(uuid, []).append(int(row["host_pid"]))
                on_gpu.setdefault(uuid, []).append((n, dev))
        # The monotonic clock, as on a node: the controller reads its regions' headers in one
        # batch only on that clock, whose stamps the batch read takes (on a clock of its own it
        # reads them one by one, which the node does not).
        shim = node.ShimSide(root, rows)

        spent_at: dict[str, list[int]] = {}  # per GPU: its containers' tokens at its last sample

        def samples(uuid: str, since_us: int) -> list[ProcessSample]:
            now_us = time.monotonic_ns() // 1000
            if since_us and now_us - since_us < 166_000:
                return []
            flip = now_us // 2_000_000
            on = pids.get(uuid, [])
            own = [ProcessSample(pid, now_us, 5 + 5 * ((flip + pid) % 2) if changing else 5)
                   for pid in on]
            if not sliced or not on:
                return own
            totals = [shim.totals[key][0] for key in on_gpu[uuid]]
            before = spent_at.get(uuid, totals)
            spent_at[uuid] = totals
            return sliced_period(own, totals, before, now_us)

        backend.set_sample_source(samples)
        host = FakeHostProc(root / "proc")
        for row in rows:
            host.container_process(int(row["host_pid"]), root / str(row["alloc_id"]))
        controller = ThrottleController(backend, lambda: regions, tick_s=0.1,
                                        proc_root=host.path)
        controller.inline_read_s = 10.0  # NVML on the loop: timed here, not in a thread
        spent = dict.fromkeys(PARTS, 0.0)
        counting = [False]

        def timed(name: str, call):  # type: ignore[no-untyped-def]
            def wrapper(*args):  # type: ignore[no-untyped-def]
                started = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    if counting[0]:
                        spent[name] += time.perf_counter() - started
            return wrapper

        law, steer = controller.law, controller._steer_gpu
        controller.law = timed("law", law)
        # the regions, then NVML (a baseline tree may read both in one `_read`)
        for reads in ("_read",) if hasattr(controller, "_read") else ("_gather", "_sample"):
            setattr(controller, reads, timed("reads", getattr(controller, reads)))
        controller._steer_gpu = timed("glue", steer)  # type: ignore[method-assign]
        # of the reads, the regions' headers read in one batch (a tree without it: 0)
        if hasattr(Region, "readings_together"):
            Region.readings_together = staticmethod(  # type: ignore[method-assign]
                timed("headers", Region.readings_together))

        async def run() -> None:
            next_at = time.monotonic()
            for n in range(ticks + 50):
                next_at += 0.1
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                shim.tick()
                counting[0] = n >= 50
                started = time.process_time()
                await controller.tick()
                if counting[0]:
                    spent["tick_cpu"] += time.process_time() - started

        asyncio.run(run())
        for region in regions:
            region.close()
    spent["glue"] -= spent["law"]  # the law runs inside a GPU's steering
    return {name: value / ticks * 1e3 for name, value in spent.items()}


def sliced_period(own: list[ProcessSample], tokens_now: list[int], tokens_then: list[int],
                  now_us: int) -> list[ProcessSample]:
    """A time-sliced driver's sample of one period (an H200 without MPS): the period goes
    whole to one process, in turn among those whose container spent tokens since the GPU's last
    sample (`tokens_then` -> `tokens_now`, one each per process of `own`), with the whole
    GPU's use (their own samples summed, at most 100). A container paused for another's turn
    alone launches nothing and is given no period; with none spending, every process reads 0."""
    from vgpu_agent.gpu.model import ProcessSample

    running = [s for s, now, then in zip(own, tokens_now, tokens_then, strict=True)
               if now > then]
    if not running:
        return [ProcessSample(s.pid, now_us, 0) for s in own]
    return [ProcessSample(running[now_us // 166_000 % len(running)].pid, now_us,
                          min(100, sum([s.sm_util for s in running])))]


def run_tree(tree: Path, args: argparse.Namespace, changing: bool, attribution: str
             ) -> dict[str, float]:
    from tests.bench.children import run_child

    found: dict[str, float] = run_child(
        __file__, tree,
        ["--devices", str(args.devices), "--ticks", str(args.ticks),
         *(["--changing"] if changing else []),
         *(["--attribution", attribution] if attribution != "per-process" else [])],
        f"the {attribution} ticks")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=144)
    parser.add_argument("--ticks", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--attribution", choices=("per-process", "time-sliced", "both"),
                        default="per-process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--changing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.devices, args.ticks, args.changing,
                                 args.attribution == "time-sliced")))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    if args.baseline and args.attribution == "both":
        parser.error("--baseline compares two trees under one attribution: not with 'both'")
    # each column: (tree, attribution); the ratio is the first column over the second
    columns = ({"per-process": (REPO, "per-process"), "time-sliced": (REPO, "time-sliced")}
               if args.attribution == "both" else
               {"this tree": (REPO, args.attribution),
                **({"baseline": (args.baseline, args.attribution)} if args.baseline else {})})
    names = list(columns)
    from tests.bench import machine

    print(f"{machine.describe()}, {args.devices} "
          f"container-devices, {args.ticks} ticks, {args.rounds} rounds, attribution "
          f"{args.attribution}, load average {os.getloadavg()[0]:.1f}")
    for changing in (False, True):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in columns}
        for _ in range(args.rounds):
            for name, (tree, attribution) in columns.items():  # alternating: one load for all
                runs[name].append(run_tree(tree, args, changing, attribution))
        print(f"\n{'shares changing' if changing else 'steady'}: ms per tick, median (min)")
        print(f"{'':12}" + "".join(f"{name:>22}" for name in columns)
              + ("     ratio" if len(columns) > 1 else ""))
        for part in PARTS:
            cells = {name: [r[part] for r in rs] for name, rs in runs.items()}
            line = f"{part:12}" + "".join(
                f"{statistics.median(v):>14.2f} ({min(v):5.2f})" for v in cells.values())
            if len(columns) > 1:
                first, second = (statistics.median(cells[n]) for n in names[:2])
                if args.attribution == "both":
                    first, second = second, first  # time-sliced over per-process
                line += f"     x{first / second:.2f}" if second > 0 else "     -"
            print(line)
    print(f"\nload average {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

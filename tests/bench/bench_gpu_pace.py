"""What the controller's own loop costs when one GPU of eight keeps changing, beside another tree.

    python tests/bench/bench_gpu_pace.py [--rounds 3] [--seconds 30] [--baseline DIR]

The bench node of `bench_scrape.py` (8 GPUs, 144 busy container-devices, the shims' counters
moving in a thread, the GPUs' per-process samples following what each container spent), with
`ThrottleController.run` on an event loop of its own in one process: no metrics, no gRPC, NVML
asked on the loop. After 40 s of settling, the CPU time of the loop's thread over `--seconds`,
and how many times each GPU was steered. Three configurations:

- steady: nothing changes, every GPU calms down to its 2 s tick;
- one GPU changing: every tick that steers the first GPU counts as a change there (as if its
  containers changed all the time: the controller's reaction to a change, not the law's
  judgement of one, is what is measured), the other seven steady;
- all changing: the same on every GPU (the node `bench_scrape.py --changing` holds at 0.1 s).

With `--baseline DIR` (another checkout, built) each configuration runs `--rounds` times in
each tree, alternating, and the medians are printed side by side with their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CONFIGS = ("steady", "one GPU changing", "all changing")
SETTLE_S = 40.0


def child(tree: Path, config: str, seconds: float) -> dict[str, object]:
    spec = importlib.util.spec_from_file_location("bench_node", HERE / "bench_scrape.py")
    assert spec is not None and spec.loader is not None
    node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node)
    sys.path.insert(0, str(tree))  # the controller of the tree measured
    import structlog

    from tests.fakes.hostproc import FakeHostProc
    from vgpu_agent.gpu.sim import SimBackend
    from vgpu_agent.shm.regions import Region
    from vgpu_agent.throttle.controller import ThrottleController

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory(prefix="bench-pace-") as tmp:
        root = Path(tmp)
        rows = node.build_regions(root, 8, node.containers_for(144))
        regions = [Region.open(root / str(row["alloc_id"])) for row in rows]
        accounting = node.Accounting(root / "nvml", rows)
        shim = node.ShimSide(root, rows, accounting=accounting)
        backend = SimBackend("8xA100-80GB")
        backend.set_sample_source(node.samples_from(root / "nvml", rows))
        host = FakeHostProc(root / "proc")
        for row in rows:
            host.container_process(int(row["host_pid"]), root / str(row["alloc_id"]))
        controller = ThrottleController(backend, lambda: regions, tick_s=0.1, max_tick_s=0.4,
                                        proc_root=host.path)
        controller.inline_read_s = 10.0  # NVML on the loop: its thread is all the cost
        gpus = sorted(accounting.on_gpu)
        changing = {"steady": set(), "one GPU changing": {gpus[0]},
                    "all changing": set(gpus)}[config]
        steered: Counter[str] = Counter()
        steer = controller._steer_gpu

        def counted(uuid: str, *args: object) -> None:
            steered[uuid] += 1
            steer(uuid, *args)  # type: ignore[arg-type]
            if uuid in changing:
                controller._changed = True

        controller._steer_gpu = counted  # type: ignore[method-assign,assignment]

        async def run() -> dict[str, object]:
            task = asyncio.create_task(controller.run())
            await asyncio.sleep(SETTLE_S)
            steered.clear()
            cpu, wall = time.thread_time(), time.monotonic()
            await asyncio.sleep(seconds)
            cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
            task.cancel()
            return {"cpu_percent": cpu / wall * 100,
                    "steered_per_s": [steered[uuid] / wall for uuid in gpus]}

        with shim.moving():
            result = asyncio.run(run())
        for region in regions:
            region.close()
    return result


def measure(tree: Path, config: str, seconds: float) -> dict[str, object]:
    from tests.bench.children import run_child

    # (run from this checkout, which puts `tree`'s code on the path itself: `--tree`)
    result: dict[str, object] = run_child(
        __file__, REPO, ["--tree", str(tree), "--config", config, "--seconds", str(seconds)],
        f"the {config} run of {tree}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.tree, args.config, args.seconds)))
        return 0
    sys.path.insert(0, str(REPO))  # the parent's (`tests.bench`); a child's code is its tree's
    trees = {"this tree": REPO}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    from tests.bench import machine

    print(f"{machine.describe()}, 144 container-devices on "
          f"8 GPUs, {args.rounds} rounds of {args.seconds:g} s after {SETTLE_S:g} s, load "
          f"average {os.getloadavg()[0]:.1f}")
    print(f"{'loop thread CPU, % of a core (median)':40}"
          + "".join(f"{name:>14}" for name in trees) + ("         ratio" if len(trees) > 1 else "")
          + "   GPUs steered a second (this tree)")
    for config in CONFIGS:
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        steered: list[list[float]] = []
        for _ in range(args.rounds):
            for name, tree in trees.items():
                result = measure(tree, config, args.seconds)
                cpu[name].append(float(result["cpu_percent"]))  # type: ignore[arg-type]
                if name == "this tree":
                    steered.append(result["steered_per_s"])  # type: ignore[arg-type]
        medians = {name: statistics.median(values) for name, values in cpu.items()}
        rates = [round(statistics.median(per_gpu), 1) for per_gpu in zip(*steered, strict=True)]
        print(f"{config:40}" + "".join(f"{medians[name]:14.2f}" for name in trees)
              + (f"{medians['this tree'] / medians['baseline']:14.2f}" if len(trees) > 1
                 else "") + f"   {rates}")
        for name in trees:
            print(f"{'  ' + name + ', each round':40}"
                  + "  ".join(f"{value:.2f}" for value in cpu[name]))
    print(f"load average {os.getloadavg()[0]:.1f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

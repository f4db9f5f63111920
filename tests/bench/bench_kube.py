"""Does Kubernetes API trouble slow the agent's event loop? Node integration under load.

    python tests/bench/bench_kube.py [--rounds 6] [--window 1.0]

The agent's event loop runs the device plugin; the node integration shares it. This measures,
side by side in one run (conditions interleaved round by round, so they share machine noise):

- event-loop lag: how late a 1 ms timer fires (what any gRPC handler on the loop would wait);
- caller cost: how long `on_health_change` and `publish_labels` take to return;

while a driver reports a GPU health change every 5 ms and publishes labels every 50 ms, under:

  idle      no node integration at all (the baseline)
  healthy   a fake API server (another process) answering every call
  refused   nothing listens on the API port: connection refused, retried with backoff
  hung      the API server accepts requests and never answers (client timeout 10 s)

It prints p50/p99 of each, and each condition's lag p50/p99 as a ratio to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

from tests.bench import machine  # noqa: E402
from tests.fakes.kubeapi import NODE, Change, FakeKubeAPI, gpu  # noqa: E402
from vgpu_agent.kube.node import NodeIntegration  # noqa: E402

CONDITIONS = ("idle", "healthy", "refused", "hung")


def _serve(mode: str, conn: Connection) -> None:
    async def main() -> None:
        api = FakeKubeAPI()
        await api.start()
        api.add_node(NODE)
        if mode == "hung":
            api.stall(3600, times=10**9)
        conn.send(api.port)
        await asyncio.Event().wait()

    asyncio.run(main())


@dataclass
class Samples:
    lag_us: list[float] = field(default_factory=list)
    call_us: list[float] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _kubeconfig(directory: Path, port: int) -> str:
    api = FakeKubeAPI(port=port)
    return str(api.write_kubeconfig(directory / f"kubeconfig-{port}"))


async def _window(node: NodeIntegration | None, seconds: float, out: Samples) -> None:
    task = asyncio.create_task(node.run()) if node else None
    stop = time.perf_counter() + seconds

    async def drive() -> None:
        n = 0
        while time.perf_counter() < stop:
            if node is not None:
                started = time.perf_counter()
                node.on_health_change(Change(f"GPU-{n % 8}", n % 2 == 0, "bench", 79))
                if n % 10 == 0:
                    await node.publish_labels([gpu(0), gpu(1)], 4 + n % 3, "bench")
                out.call_us.append((time.perf_counter() - started) * 1e6)
            n += 1
            await asyncio.sleep(0.005)

    async def probe() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            out.lag_us.append((time.perf_counter() - started - 0.001) * 1e6)

    await asyncio.gather(drive(), probe())
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(rounds: int, window: float, ports: dict[str, int], tmp: Path) -> dict[str, Samples]:
    samples = {c: Samples() for c in CONDITIONS}
    for _ in range(rounds):
        order = list(CONDITIONS)
        random.shuffle(order)
        for condition in order:
            node = None
            if condition != "idle":
                node = NodeIntegration(
                    NODE,
                    _kubeconfig(tmp, ports[condition]),
                    namespace="bench",
                    request_timeout=10.0,
                    max_queued_events=256,
                )
            await _window(node, window, samples[condition])
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=1.0, help="seconds per condition per round")
    args = parser.parse_args()
    # Logging every retry to a terminal would measure the terminal; drop log output.
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())

    ctx = mp.get_context("spawn")
    servers = []
    ports = {"refused": _free_port()}
    for mode in ("healthy", "hung"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(mode, child), daemon=True)
        proc.start()
        servers.append(proc)
        ports[mode] = parent.recv()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            samples = asyncio.run(run(args.rounds, args.window, ports, Path(tmp)))
    finally:
        for proc in servers:
            proc.kill()

    print(f"machine: {machine.describe()}")
    print(f"{args.rounds} rounds x {args.window}s per condition, interleaved")
    base = samples["idle"]
    header = f"{'condition':10} {'lag p50':>9} {'lag p99':>9} {'x idle p50':>10} {'x idle p99':>10}"
    print(header + f" {'call p50':>9} {'call p99':>9}  (microseconds)")
    for condition in CONDITIONS:
        s = samples[condition]
        p50, p99 = _pct(s.lag_us, 0.5), _pct(s.lag_us, 0.99)
        calls = (
            f"{_pct(s.call_us, 0.5):9.1f} {_pct(s.call_us, 0.99):9.1f}" if s.call_us else " " * 19
        )
        print(
            f"{condition:10} {p50:9.1f} {p99:9.1f} {p50 / _pct(base.lag_us, 0.5):10.2f} "
            f"{p99 / _pct(base.lag_us, 0.99):10.2f} {calls}"
        )
    print(f"lag samples per condition: {statistics.median(len(s.lag_us) for s in samples.values())}")


if __name__ == "__main__":
    main()

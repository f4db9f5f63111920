"""The idle agent: process start to `Register`, then what it costs while it has nothing to do.

    python tests/bench/bench_startup.py [--runs 5] [--idle 20]

Each run starts `vgpu-agent run` as its own process (8 simulated GPUs x K=16, NODE_NAME set and
a kubeconfig whose API server does not answer, so the node integration loads its client and
retries as on a node whose API server is away) against the kubelet stand-in, and times process
start to the stand-in receiving `Register`, and the agent's CPU time until then. The last run
(of each tree, with `--baseline`) then stays registered with no containers for `--idle`
seconds: its CPU (percent of one core, from /proc) and RSS are read at the end. A bare
`python -c pass` start is timed alongside, so the figure can be read against what the
interpreter alone costs on the same machine at the same moment.

Goals: start to Register median <= 0.7 s, idle RSS <= 70 MB, idle CPU <= 0.3 % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from tests.bench.nodeparts import cpu_seconds  # noqa: E402
from vgpu_agent.kubelet.standin import KubeletStandIn  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def kubeconfig_away(root: Path) -> str:
    """A kubeconfig naming an API server that does not answer (a closed local port): the node
    integration loads it, builds its clients and retries with backoff, as on a node whose API
    server is away."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again when the agent dials it
    path = root / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: away\n"
        f"clusters:\n- name: away\n  cluster:\n    server: http://127.0.0.1:{port}\n"
        "users:\n- name: away\n  user:\n    token: not-a-real-token\n"
        "contexts:\n- name: away\n  context:\n    cluster: away\n    user: away\n"
    )
    return str(path)


async def one_run(root: Path, idle_s: float, tree: Path = ROOT
                  ) -> tuple[float, float, float | None, float | None]:
    plugin_dir = root / "dp"
    plugin_dir.mkdir()
    kubelet = KubeletStandIn(str(plugin_dir), str(root / "pr.sock"))
    await kubelet.start()
    env = {**os.environ, "PYTHONPATH": str(tree), "NODE_NAME": "bench-node",
           "KUBERNETES_SERVICE_HOST": "", "VGPU_AGENT_KUBECONFIG": kubeconfig_away(root)}
    started = time.perf_counter()
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", "run", "--backend", "sim",
        "--sim-gpus", "8xA100-80GB", "--split-count", "16",
        "--device-plugin-dir", str(plugin_dir), "--state-dir", str(root / "state"),
        "--pod-resources-socket", str(root / "pr.sock"), "--metrics-address", "127.0.0.1:0",
        "--log-level", "error", env=env,
        # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: start
        # in the tree itself, so that the baseline runs its own code and not this checkout's.
        cwd=tree,
    )
    try:
        await kubelet.wait_for(lambda: bool(kubelet.registrations), limit_s=60)
        took = time.perf_counter() - started
        cpu_to_register = cpu_seconds(agent.pid)  # less at the mercy of the machine's load
        cpu = rss = None
        if idle_s:
            await asyncio.sleep(5)  # start-up work (spare regions, first polls) done
            before, t0 = cpu_seconds(agent.pid), time.monotonic()
            await asyncio.sleep(idle_s)
            cpu = (cpu_seconds(agent.pid) - before) / (time.monotonic() - t0) * 100
            rss = rss_mb(agent.pid)
        return took, cpu_to_register, cpu, rss
    finally:
        agent.terminate()
        await agent.wait()
        await kubelet.stop()


async def bare_start() -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()
    return time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle", type=float, default=20.0, help="idle seconds, last run")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout of the agent, started alternately for comparison")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    starts, bares, base_starts, cpus, base_cpus = [], [], [], [], []
    cpu = rss = None
    base_idle: tuple[float | None, float | None] = (None, None)
    for n in range(args.runs):
        bares.append(await bare_start())
        with tempfile.TemporaryDirectory(prefix="bench-start-", dir="/tmp") as tmp:
            idle = args.idle if n == args.runs - 1 else 0
            took, cpu_start, cpu_now, rss_now = await one_run(Path(tmp), idle)
        starts.append(took)
        cpus.append(cpu_start)
        if cpu_now is not None:
            cpu, rss = cpu_now, rss_now
        if args.baseline:
            with tempfile.TemporaryDirectory(prefix="bench-start-", dir="/tmp") as tmp:
                idle = args.idle if n == args.runs - 1 else 0
                base = await one_run(Path(tmp), idle, args.baseline)
                base_starts.append(base[0])
                base_cpus.append(base[1])
                if base[2] is not None:
                    base_idle = base[2], base[3]
    print(f"machine: {machine.describe()}, "
          f"load average {load:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"start -> Register: median {statistics.median(starts):.2f} s "
          f"(runs: {', '.join(f'{s:.2f}' for s in starts)}); goal <= 0.70 s")
    if base_starts:
        print(f"baseline {args.baseline}: median {statistics.median(base_starts):.2f} s "
              f"(runs: {', '.join(f'{s:.2f}' for s in base_starts)}); this tree / baseline "
              f"x{statistics.median(starts) / statistics.median(base_starts):.2f}")
    print(f"agent CPU time to Register: median {statistics.median(cpus):.2f} s "
          f"(runs: {', '.join(f'{s:.2f}' for s in cpus)})"
          + (f"; baseline {statistics.median(base_cpus):.2f} s "
             f"(runs: {', '.join(f'{s:.2f}' for s in base_cpus)})" if base_cpus else ""))
    print(f"bare interpreter start, same moments: median {statistics.median(bares):.3f} s")
    if cpu is not None and rss is not None:
        print(f"idle, registered, no containers ({args.idle:g} s): CPU {cpu:.2f} % of a core "
              f"(goal <= 0.3), RSS {rss:.1f} MB (goal <= 70)")
    if base_idle[0] is not None and base_idle[1] is not None:
        print(f"baseline idle, same conditions: CPU {base_idle[0]:.2f} % of a core, "
              f"RSS {base_idle[1]:.1f} MB")


if __name__ == "__main__":
    asyncio.run(main())

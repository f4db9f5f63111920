"""Allocate and /healthz latency while the metrics port is attacked, as ratios to idle.

    python tests/bench/bench_hostile_inputs.py [--rounds 3] [--calls 20]

The agent runs as its own process (`vgpu-agent run`, 2 simulated GPUs x K=64) with soft and hard
RLIMIT_NOFILE at 1024, registered with a kubelet stand-in in this process; one container is held
(listed by PodResources) so the regions the benchmark makes are collected. Rounds alternate the
conditions, so all of them see the same machine noise:

- idle: nothing else talks to the agent;
- half-open: 1,000 connections each send half a request head and then nothing (the attack that
  used to take every descriptor); the ones the agent closed are opened again once per head
  timeout, so the agent is at its connection cap throughout;
- half-open-churn: the same, topped up every 100 ms: thousands of new connections a second;
- junk: a client sends malformed requests back to back (TLS hellos, oversized headers);
- cpu-only: the control: a process that keeps one core busy and never talks to the agent, as
  the attackers (Python clients) do; what it costs is the machine's, not the agent's weakness.

Every attacker runs in its own process on the same machine, so its CPU competes with the agent's
as a pod's on the same node would, and connects from 127.0.0.2 (another pod's address; the
kubelet stand-in and the probes use 127.0.0.1).

Each round makes `--calls` Allocate calls (gRPC, one slice, the full path with region creation)
and `--calls` GETs of /healthz, and prints p50/p99 per condition and the ratio to idle.

Last, GetPreferredAllocation's choice on thousands of distinct GPUs, against the plain rule.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from tests.integration.hostile_clients import (  # noqa: E402
    close_all,
    get,
    open_half_requests,
)
from tests.integration.plugin_harness import RESOURCE, short_dir  # noqa: E402
from tests.integration.test_agent_connection_flood import AgentProcess  # noqa: E402
from vgpu_agent.kubelet.standin import KubeletStandIn  # noqa: E402
from vgpu_agent.metrics.http import HEADER_TIMEOUT_S  # noqa: E402

ATTACKER = "127.0.0.2"  # another address, as another pod is; the benchmark's own is 127.0.0.1
JUNK = [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
    b"GET /metrics HTTP/9.9\r\n\r\n",
]


class Attack:
    """The attacking client, in its own process (its CPU is the machine's, not this GIL's)."""

    def __init__(self, kind: str, port: int):
        self.kind, self.port = kind, port
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Attack:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--attack", self.kind, "--port", str(self.port)]
        )
        time.sleep(1.5 if self.kind.startswith("half-open") else 0.3)  # let it build up
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait()


def attack(kind: str, port: int) -> None:
    """Run one attack until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    if kind.startswith("half-open"):
        # held: top up to 1,000 once per head timeout; churn: every 100 ms
        every_s = 0.1 if kind == "half-open-churn" else HEADER_TIMEOUT_S
        held = open_half_requests("127.0.0.1", port, 1000, ATTACKER)
        while not stop.wait(every_s):
            alive = [s for s in held if _still_open(s)]
            close_all([s for s in held if s not in alive])
            held = alive + open_half_requests("127.0.0.1", port, 1000 - len(alive), ATTACKER)
        close_all(held)
        return
    if kind == "cpu-only":
        while not stop.is_set():  # one core busy, the agent untouched
            sum(range(10_000))
        return
    n = 0
    while not stop.is_set():
        try:
            with socket.create_connection(
                ("127.0.0.1", port), timeout=2, source_address=(ATTACKER, 0)
            ) as sock:
                sock.sendall(JUNK[n % len(JUNK)])
                sock.recv(4096)
        except OSError:
            pass
        n += 1


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(kubelet: KubeletStandIn, port: int, calls: int, ids: list[str],
                  allocs: list[float], probes: list[float],
                  fds: Callable[[], None] = lambda: None) -> None:
    for n in range(calls):
        fds()
        started = time.perf_counter()
        await kubelet.allocate(RESOURCE, [ids[n % len(ids)]])
        allocs.append(time.perf_counter() - started)
        status, took = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz")
        if status != 200:
            raise SystemExit(f"/healthz answered {status}")
        probes.append(took)


async def main(rounds: int, calls: int) -> None:
    # The attacker needs more descriptors than the agent it attacks.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    with short_dir() as root:
        os.makedirs(root / "dp")
        kubelet = KubeletStandIn(str(root / "dp"), str(root / "pr.sock"))
        await kubelet.start()
        agent = AgentProcess(root)
        await agent.start({"VGPU_AGENT_REGION_GC_GRACE_SECONDS": "0",
                           "VGPU_AGENT_POD_RESOURCES_REFRESH_SECONDS": "0.5"})
        try:
            port = await agent.port()
            await kubelet.wait_for(lambda: len(kubelet.free_devices(RESOURCE)) == 128, 30)
            await kubelet.admit("bench", "keeper", "main", RESOURCE, 1)
            ids = kubelet.free_devices(RESOURCE)
            await measure(kubelet, port, 5, ids, [], [])  # warm-up
            results: dict[str, tuple[list[float], list[float]]] = {
                k: ([], [])
                for k in ("idle", "cpu-only", "half-open", "half-open-churn", "junk")
            }
            fds: dict[str, int] = {}
            cpu: dict[str, list[float]] = {k: [0.0, 0.0] for k in results}  # agent CPU s, wall s
            for _ in range(rounds):
                for kind, (allocs, probes) in results.items():

                    def sample(kind: str = kind) -> None:
                        fds[kind] = max(fds.get(kind, 0), agent.open_descriptors())

                    with contextlib.ExitStack() as stack:
                        if kind != "idle":
                            stack.enter_context(Attack(kind, port))
                        cpu_before, wall_before = agent.cpu_seconds(), time.perf_counter()
                        await measure(kubelet, port, calls, ids, allocs, probes, sample)
                        cpu[kind][0] += agent.cpu_seconds() - cpu_before
                        cpu[kind][1] += time.perf_counter() - wall_before
        finally:
            await agent.stop()
            await kubelet.stop()

    print(f"machine: {machine.describe()}")
    print(f"agent RLIMIT_NOFILE 1024/1024; {rounds} rounds x {calls} calls per condition")
    idle_alloc, idle_probe = results["idle"]
    print(f"{'condition':<15} {'Allocate p50':>13} {'p99':>9} {'ratio':>6}   "
          f"{'/healthz p50':>13} {'p99':>9} {'ratio':>6}   {'max fds':>9} {'agent CPU':>9}")
    for kind, (allocs, probes) in results.items():
        a50, p50 = statistics.median(allocs), statistics.median(probes)
        print(
            f"{kind:<15} {a50 * 1e3:>10.2f} ms {pct(allocs, 0.99) * 1e3:>6.2f} ms "
            f"{a50 / statistics.median(idle_alloc):>5.2f}x   "
            f"{p50 * 1e3:>10.2f} ms {pct(probes, 0.99) * 1e3:>6.2f} ms "
            f"{p50 / statistics.median(idle_probe):>5.2f}x   {fds.get(kind, 0):>9} "
            f"{100 * cpu[kind][0] / cpu[kind][1]:>8.0f}%"
        )


def preferred_allocation_scaling() -> None:
    """GetPreferredAllocation's choice on n IDs of n distinct GPUs: the heap against the plain
    rule (one scan of every GPU per pick, the form it replaced), same inputs, same answers."""
    from tests.unit.test_allocation_bounded import plain_rule
    from vgpu_agent.deviceplugin.allocation import preferred_allocation

    print("GetPreferredAllocation, n IDs on n distinct GPUs, all chosen (spread):")
    for n in (500, 1000, 2000):
        available = [f"GPU-{i:08x}::0" for i in range(n)]
        timings = {}
        for name, choose in (("heap", preferred_allocation), ("plain", plain_rule)):
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                chosen = choose(available, [], n, "spread", {})
                runs.append(time.perf_counter() - started)
            assert len(chosen) == n
            timings[name] = statistics.median(runs)
        print(f"  n={n:>5}: heap {timings['heap'] * 1e3:8.2f} ms   plain "
              f"{timings['plain'] * 1e3:9.2f} ms   plain/heap {timings['plain'] / timings['heap']:7.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--attack", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        attack(args.attack, args.port)
    else:
        asyncio.run(main(args.rounds, args.calls))
        preferred_allocation_scaling()

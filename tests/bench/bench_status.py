"""Cost of `/status` against a scrape of `/metrics` on a busy node: 8 GPUs x 128 containers.

    python tests/bench/bench_status.py [--gpus 8] [--containers 128] [--requests 200]

The agent is `bench_scrape.py`'s: the whole agent in its own process (simulated GPUs, real
region files it adopted, a kubelet stand-in in a third process); this process plays the
containers' shims and alternates the two requests one by one, so both see the same machine
load. It prints p50/p99 latency of each, agent CPU per request, body sizes, and the ratios.
`/status` is built from the same caches as a scrape, so it should cost about what a scrape does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench import machine  # noqa: E402
from tests.bench.bench_scrape import (  # noqa: E402 - after the path set-up
    PROMETHEUS_ACCEPT,
    ShimSide,
    build_regions,
    cpu_seconds,
    pause_with_shim,
    pct,
    running_node,
)
from vgpu_agent.shm.regions import REGIONS_DIR  # noqa: E402


def get(port: int, path: str, accept: str = "") -> tuple[float, int]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if accept:
        request.add_header("Accept", accept)
        request.add_header("Accept-Encoding", "gzip")
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return (time.perf_counter() - started) * 1000, len(body)


def p99(values: list[float]) -> float:
    return pct(sorted(values), 0.99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--containers", type=int, default=128)
    parser.add_argument("--requests", type=int, default=200, help="of each kind")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    # short: the agent's and the kubelet's unix sockets live under it
    with tempfile.TemporaryDirectory(prefix="bst-", dir="/tmp") as tmp:
        root = Path(tmp)
        regions = root / "state" / REGIONS_DIR
        regions.mkdir(parents=True)
        rows = build_regions(root, args.gpus, args.containers, regions)
        shim = ShimSide(regions, rows)
        with running_node(root, args.gpus) as (child, port):
            pause_with_shim(shim, 3.0)
            get(port, "/status")
            kinds = {"/metrics": PROMETHEUS_ACCEPT, "/status": ""}
            latency: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, float] = dict.fromkeys(kinds, 0.0)
            size: dict[str, int] = {}
            for n in range(args.requests):
                order = list(kinds) if n % 2 == 0 else list(reversed(kinds))
                for path in order:
                    shim.tick()
                    before = cpu_seconds(child.pid)
                    took, size[path] = get(port, path, kinds[path])
                    cpu[path] += cpu_seconds(child.pid) - before
                    latency[path].append(took)

    print(f"\n{args.gpus} GPUs x {args.containers} containers "
          f"({sum(int(r['devices']) for r in rows)} container-devices), controller ticking; "
          f"{args.requests} of each request, alternating; {machine.describe()}, "
          f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    print(f"{'':28}{'/metrics (OM+gzip)':>20}{'/status (JSON)':>20}{'ratio':>10}")
    m, s = latency["/metrics"], latency["/status"]
    for label, a, b in (
        ("p50 (ms)", statistics.median(m), statistics.median(s)),
        ("p99 (ms)", p99(m), p99(s)),
        ("agent CPU per request (ms)", cpu["/metrics"] / args.requests * 1000,
         cpu["/status"] / args.requests * 1000),
        ("body (bytes)", float(size["/metrics"]), float(size["/status"])),
    ):
        print(f"{label:28}{a:>20.1f}{b:>20.1f}{b / max(a, 1e-9):>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

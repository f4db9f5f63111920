"""Memory accounting of libvgpu.so against the fake driver's own count, and start-up cost per
process, in one run.

    python tests/bench/bench_shim_memory.py [--seeds N] [--ops N] [--procs N]

1. Accounting error: cuda_client runs a mixed workload (plain, pitch and managed allocations,
   cudaMallocAsync on the default pool and on a created one, VMM handles mapped and released while
   mapped, two contexts of 300 MiB each, modules and libraries, arrays, synchronisations that
   make pools give memory back) under a 1 GiB and a 4 GiB limit, then compares the shim's count in
   the region's `state` with the bytes the fake driver holds on the device. Reported: median and
   largest |shim - driver| over the seeds, as a share of the limit (goal <= 1 %).
2. Cost per allocation and free, plain (cuMemAlloc/cuMemFree) and stream-ordered
   (cuMemAllocAsync/cuMemFreeAsync, where the shim reads the pool's reserve around each call),
   without and with the shim, interleaved rounds, median per pair.
3. Start-up: PROCS processes started at once, each creating a context (its memory measured by the
   shim through NVML) and making one allocation, without and with the shim, interleaved; the
   median and p99 of each process's wall time and the wall time of the whole wave.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from vgpu_agent.shm import layout  # noqa: E402

SHIM = ROOT / "shim"
BUILD = SHIM / "build"
CLIENT = BUILD / "cuda_client"
MIB = 1 << 20


def fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def make_region(path: Path, memory_limit: int) -> Path:
    path.mkdir()
    uuid = fake_gpu_uuid(0)
    device = layout.ControlDevice(uuid, memory_limit=memory_limit)
    control = layout.Control(devices=(device,), device_ids=(f"{uuid}::0",), seq=1)
    (path / "control").write_bytes(layout.encode_control(control))
    (path / "state").write_bytes(layout.encode_state(1))
    return path


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "VGPU_REGION_DIR", "VGPU_DISABLE", "VGPU_FAIL_CLOSED")}


def accounting(tmp: Path, limit: int, seeds: int, ops: int) -> list[float]:
    """|shim - driver| / limit after a mixed workload, one value per seed."""
    errors = []
    for seed in range(1, seeds + 1):
        region = make_region(tmp / f"acct-{limit}-{seed}", limit)
        env = {**clean_env(), "LD_PRELOAD": str(BUILD / "libvgpu.so"),
               "VGPU_REGION_DIR": str(region), "FAKE_CUDA_CONTEXT_MEMORY": str(300 * MIB)}
        out = subprocess.run(
            [str(CLIENT), "procaddr", "ctx", "0", "ctxnew", "0", "ok", "mixed", str(ops),
             str(seed), "compare", "0", str(limit)],
            env=env, check=True, capture_output=True, text=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("compare"))
        fields = dict(item.split("=") for item in line.split()[1:])
        errors.append(abs(int(fields["shim"]) - int(fields["driver"])) / limit)
    return errors


def wave(procs: int, env: dict[str, str]) -> tuple[list[float], float]:
    """Start `procs` clients at once; each one's wall time (s) and the whole wave's."""
    args = [str(CLIENT), "direct", "ctx", "0", "alloc", "plain", "1M", "ok"]
    t0 = time.perf_counter()
    started = []
    for _ in range(procs):
        started.append((time.perf_counter(), subprocess.Popen(
            args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    times = []
    for start, proc in started:
        if proc.wait(timeout=120) != 0:
            raise RuntimeError("a client failed")
        times.append(time.perf_counter() - start)
    return times, time.perf_counter() - t0


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=20000)
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(SHIM), "all", "build/cuda_client"], check=True)
    print(f"machine: {machine.describe()}, {platform.platform()}")

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        print(f"\naccounting error, mixed workload of {args.ops} operations, {args.seeds} seeds:")
        print(f"{'limit':>8} {'median |err|':>14} {'max |err|':>12}   (share of the limit)")
        for limit in (1 << 30, 4 << 30):
            errors = accounting(tmp, limit, args.seeds, args.ops)
            print(f"{limit >> 20:>6}Mi {100 * statistics.median(errors):>13.4f}% "
                  f"{100 * max(errors):>11.4f}%")

        region = make_region(tmp / "pairs", 64 << 30)
        shimmed = {**clean_env(), "LD_PRELOAD": str(BUILD / "libvgpu.so"),
                   "VGPU_REGION_DIR": str(region)}
        print(f"\nallocation + free pairs, {args.pairs} per run, {args.rounds} rounds (ns/pair):")
        print(f"{'api':<8} {'no shim':>9} {'shim':>9} {'added':>9}")
        for api in ("plain", "async"):
            costs: dict[str, list[float]] = {"no shim": [], "shim": []}
            for _ in range(args.rounds):
                for label, env in (("no shim", clean_env()), ("shim", shimmed)):
                    out = subprocess.run(
                        [str(CLIENT), "direct", "ctx", "0", "timedalloc", api, str(args.pairs),
                         "1M"], env=env, check=True, capture_output=True, text=True).stdout
                    ns = int(out.split("ns=")[1].split()[0])
                    costs[label].append(ns / args.pairs)
            base, shim = statistics.median(costs["no shim"]), statistics.median(costs["shim"])
            print(f"{api:<8} {base:>9.0f} {shim:>9.0f} {shim - base:>9.0f}")

        region = make_region(tmp / "startup", 64 << 30)
        variants = {
            "no shim": clean_env(),
            "shim, region": {**clean_env(), "LD_PRELOAD": str(BUILD / "libvgpu.so"),
                             "VGPU_REGION_DIR": str(region),
                             "FAKE_CUDA_CONTEXT_MEMORY": str(300 * MIB)},
        }
        per: dict[str, list[float]] = {k: [] for k in variants}
        walls: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for label, env in variants.items():
                times, wall = wave(args.procs, env)
                per[label] += times
                walls[label].append(wall)
        print(f"\nstart-up, {args.procs} processes at once, {args.rounds} rounds (wall, ms):")
        print(f"{'variant':<14} {'median/proc':>12} {'p99/proc':>10} {'wave':>9}")
        for label in variants:
            print(f"{label:<14} {1e3 * statistics.median(per[label]):>12.2f} "
                  f"{1e3 * p99(per[label]):>10.2f} {1e3 * statistics.median(walls[label]):>9.1f}")
        base = statistics.median(walls["no shim"])
        shim = statistics.median(walls["shim, region"])
        print(f"added per process (wave difference / processes): "
              f"{1e3 * (shim - base) / args.procs:.3f} ms; ratio of waves {shim / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

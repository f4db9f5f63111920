"""What spilling costs per allocation in libvgpu.so's bookkeeping, against the fake driver.

    python tests/bench/bench_shim_spill.py [--rounds N] [--pairs N]

cuda_client times pairs of cuMemAlloc + cuMemFree of 2 MiB in three variants, interleaved round
after round so that machine noise hits them alike:

  no shim          the fake driver alone, device memory (the baseline)
  shim, device     a region with the spill flag, the card has room: the normal path
  shim, spilled    the same region, the card (1 MiB) too small for any allocation: every
                   allocation is refused by the driver, then served as managed memory (advice,
                   tracking record, spilled counters) and freed through the same path

Reported: per variant the median over rounds of each run's median and p99 ns per pair, the
added ns against the baseline and the ratio. The fake driver's own work is a table scan; on a
real GPU cuMemAllocManaged and the first touch of its pages cost far more than this bookkeeping.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vgpu_agent.shm import layout  # noqa: E402

SHIM = ROOT / "shim"
BUILD = SHIM / "build"
CLIENT = BUILD / "cuda_client"


def fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def make_region(path: Path) -> Path:
    path.mkdir()
    uuid = fake_gpu_uuid(0)
    device = layout.ControlDevice(uuid, memory_limit=64 << 30, flags=layout.CONTROL_FLAG_SPILL)
    control = layout.Control(devices=(device,), device_ids=(f"{uuid}::0",), seq=1)
    (path / "control").write_bytes(layout.encode_control(control))
    (path / "state").write_bytes(layout.encode_state(1))
    return path


def run(pairs: int, env: dict[str, str]) -> tuple[float, float, int]:
    out = subprocess.run(
        [str(CLIENT), "direct", "ctx", "0", "allocloop", str(pairs), "2M"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    fields = dict(part.split("=") for part in out.split() if "=" in part)
    return float(fields["median_ns"]), float(fields["p99_ns"]), int(fields["managed"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=20000)
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(SHIM), "all", "build/cuda_client"], check=True)
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "VGPU_REGION_DIR", "VGPU_DISABLE", "VGPU_FAIL_CLOSED")}
    with tempfile.TemporaryDirectory() as tmp:
        region = make_region(Path(tmp) / "spill")
        shim = {**base, "LD_PRELOAD": str(BUILD / "libvgpu.so"), "VGPU_REGION_DIR": str(region)}
        variants = {
            "no shim": base,
            "shim, device": {**shim, "FAKE_CUDA_MEMORY": str(64 << 30)},
            "shim, spilled": {**shim, "FAKE_CUDA_MEMORY": str(1 << 20)},
        }
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, env in variants.items():
                results[name].append(run(args.pairs, env))
    managed = {name: r[0][2] for name, r in results.items()}
    if managed["shim, spilled"] != args.pairs or managed["shim, device"] != 0:
        print(f"unexpected managed allocations: {managed}", file=sys.stderr)
        return 1
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {args.rounds} rounds of {args.pairs} pairs")
    print(f"{'variant':16} {'median ns':>10} {'p99 ns':>10} {'added':>8} {'ratio':>6}")
    base_median = statistics.median(r[0] for r in results["no shim"])
    for name, runs in results.items():
        median = statistics.median(r[0] for r in runs)
        p99 = statistics.median(r[1] for r in runs)
        print(f"{name:16} {median:10.0f} {p99:10.0f} {median - base_median:8.0f} "
              f"{median / base_median:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

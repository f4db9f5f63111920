"""Added cost per kernel launch of libvgpu.so, against the fake driver, in one run.

    python tests/bench/bench_shim.py [--rounds N] [--blocks N]

Builds the shim and shim/tests/bench_launch.c, then runs the same launch loop in four variants,
interleaved round after round so that machine noise hits them alike:

  no shim           the fake driver alone (the baseline)
  pass-through      libvgpu.so preloaded, no region, VGPU_FAIL_CLOSED=0 (one warning, then
                    straight calls)
  policy off        region present, launches counted but not paced
  strict, ample     region with the strict policy and tokens always available (the normal path
                    of a paced container that is within its share)

Each run reports the median and p99 of per-launch cost over blocks of 1000 launches (thread CPU
time, so preemption is not counted); the table gives the median over rounds of each, the
added ns against the baseline and the ratio. Goal: <= 50 ns added per launch.
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


def fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def make_region(path: Path, policy: int) -> Path:
    path.mkdir()
    device = layout.ControlDevice(fake_gpu_uuid(0), core_limit=500_000, rate=1 << 61,
                                  burst=1 << 61, policy=policy)
    (path / "control").write_bytes(layout.encode_control(layout.Control(devices=(device,))))
    (path / "state").write_bytes(layout.encode_state(1))
    return path


def run(blocks: int, env: dict[str, str]) -> tuple[float, float]:
    out = subprocess.run([str(BUILD / "bench_launch"), str(blocks)], env=env, check=True,
                         capture_output=True, text=True).stdout
    fields = dict(item.split("=") for item in out.split())
    return float(fields["median_ns"]), float(fields["p99_ns"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks of 1000 launches")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(SHIM), "all", "build/bench_launch"], check=True)

    with tempfile.TemporaryDirectory() as tmp:
        base_env = {k: v for k, v in os.environ.items()
                    if k not in ("LD_PRELOAD", "VGPU_REGION_DIR", "VGPU_DISABLE",
                                 "VGPU_FAIL_CLOSED")}
        preload = {"LD_PRELOAD": str(BUILD / "libvgpu.so")}
        variants = {
            "no shim": base_env,
            "pass-through (no region)": {**base_env, **preload, "VGPU_FAIL_CLOSED": "0",
                                         "VGPU_REGION_DIR": str(Path(tmp) / "none")},
            "policy off (counted)": {**base_env, **preload, "VGPU_REGION_DIR": str(
                make_region(Path(tmp) / "off", layout.POLICY_OFF))},
            "strict, tokens ample": {**base_env, **preload, "VGPU_REGION_DIR": str(
                make_region(Path(tmp) / "strict", layout.POLICY_STRICT))},
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, env in variants.items():
                results[name].append(run(args.blocks, env))

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    print(f"machine: {os.cpu_count()} CPUs, {cpu}, {platform.platform()}")
    print(f"{args.rounds} rounds x {args.blocks} blocks x 1000 launches per variant, "
          "fake driver, thread CPU time")
    print(f"{'variant':28} {'median ns':>10} {'p99 ns':>10} {'added ns':>10} {'ratio':>7}")
    base = statistics.median(m for m, _ in results["no shim"])
    for name, runs in results.items():
        median = statistics.median(m for m, _ in runs)
        p99 = statistics.median(p for _, p in runs)
        print(f"{name:28} {median:10.1f} {p99:10.1f} {median - base:10.1f} {median / base:7.2f}")
    added = statistics.median(m for m, _ in results["strict, tokens ample"]) - base
    print(f"goal <= 50 ns added per launch (strict, tokens ample): "
          f"{'met' if added <= 50 else 'NOT met'} ({added:.1f} ns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

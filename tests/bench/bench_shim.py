"""Added cost per kernel launch of libvgpu.so, against the fake driver, in one run.

    python tests/bench/bench_shim.py [--rounds N] [--blocks N] [--graph-kernels N]

Builds the shim and shim/tests/bench_launch.c, then runs launch loops in these variants,
interleaved round after round so that machine noise hits them alike:

  no shim           the fake driver alone (the baseline)
  pass-through      libvgpu.so preloaded, no region, VGPU_FAIL_CLOSED=0 (one warning, then
                    straight calls)
  policy off        region present, launches counted but not paced
  strict, ample     region with the strict policy and tokens always available (the normal path
                    of a paced container that is within its share), on an ABI 1.1 region (the
                    fast path reads the launch-turn words) and on a 1.0 region (it has none)
  graph             cuGraphLaunch of one graph of N kernels, per kernel (no shim / strict, ample)
  capture           cuLaunchKernel into a capturing stream (no shim / strict, ample / strict with
                    an empty bucket of 1 token per second: capture must not wait)

Each run reports the median and p99 of per-kernel cost over blocks of 1000 kernels (thread CPU
time, so preemption is not counted); the table gives the median over rounds of each, the
added ns against the baseline of its kind and the ratio. Goal: <= 50 ns added per launch.
With --other-shim, another build (say the previous release) is timed on the 1.0 region too, so
that a change's own cost shows against the same machine noise. Tokens: the strict regions' state
files say what was spent; a kernel in a graph must cost what
it costs launched alone (ratio 1.000, goal within 1 %), a captured kernel nothing.
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

from tests.bench import machine  # noqa: E402
from vgpu_agent.shm import layout  # noqa: E402

SHIM = ROOT / "shim"
BUILD = SHIM / "build"


def fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def make_region(path: Path, policy: int, abi_minor: int = layout.ABI_MINOR,
                rate: int = 1 << 61) -> Path:
    path.mkdir()
    device = layout.ControlDevice(fake_gpu_uuid(0), core_limit=500_000, rate=rate,
                                  burst=rate, policy=policy)
    (path / "control").write_bytes(layout.encode_control(layout.Control(devices=(device,))))
    (path / "state").write_bytes(layout.encode_state(1, abi_minor))
    return path


def run(blocks: int, env: dict[str, str], mode: list[str]) -> tuple[float, float, int]:
    out = subprocess.run([str(BUILD / "bench_launch"), str(blocks), "1000", *mode], env=env,
                         check=True, capture_output=True, text=True).stdout
    fields = dict(item.split("=") for item in out.split())
    return float(fields["median_ns"]), float(fields["p99_ns"]), int(fields["kernels"])


def tokens_spent(region: Path) -> int:
    return layout.decode_state((region / "state").read_bytes()).tokens_spent[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks of 1000 launches")
    parser.add_argument("--graph-kernels", type=int, default=100, help="kernels per graph")
    parser.add_argument("--other-shim", type=Path, default=None,
                        help="another libvgpu.so (e.g. an earlier build) to time on the 1.0 region")
    args = parser.parse_args()
    subprocess.run(["make", "-s", "-C", str(SHIM), "all", "build/bench_launch"], check=True)

    graph = ["graph", str(args.graph_kernels)]
    with tempfile.TemporaryDirectory() as tmp:
        base_env = {k: v for k, v in os.environ.items()
                    if k not in ("LD_PRELOAD", "VGPU_REGION_DIR", "VGPU_DISABLE",
                                 "VGPU_FAIL_CLOSED")}
        preload = {"LD_PRELOAD": str(BUILD / "libvgpu.so")}
        strict = {name: make_region(Path(tmp) / name, layout.POLICY_STRICT)
                  for name in ("strict", "graph", "capture")}
        old = make_region(Path(tmp) / "strict-1.0", layout.POLICY_STRICT, abi_minor=0)
        empty = make_region(Path(tmp) / "empty", layout.POLICY_STRICT, rate=1)  # 1 token/s

        def shimmed(region: Path) -> dict[str, str]:
            return {**base_env, **preload, "VGPU_REGION_DIR": str(region)}

        # name -> (environment, bench_launch mode, baseline variant, region whose tokens count)
        variants: dict[str, tuple[dict[str, str], list[str], str, Path | None]] = {
            "no shim": (base_env, [], "no shim", None),
            "pass-through (no region)": ({**base_env, **preload, "VGPU_FAIL_CLOSED": "0",
                                          "VGPU_REGION_DIR": str(Path(tmp) / "none")}, [],
                                         "no shim", None),
            "policy off (counted)": (shimmed(make_region(Path(tmp) / "off", layout.POLICY_OFF)),
                                     [], "no shim", None),
            "strict, tokens ample": (shimmed(strict["strict"]), [], "no shim", strict["strict"]),
            "strict, ample, 1.0 region": (shimmed(old), [], "no shim", None),
            "graph: no shim": (base_env, graph, "graph: no shim", None),
            "graph: strict, ample": (shimmed(strict["graph"]), graph, "graph: no shim",
                                     strict["graph"]),
            "capture: no shim": (base_env, ["capture"], "capture: no shim", None),
            "capture: strict, ample": (shimmed(strict["capture"]), ["capture"],
                                       "capture: no shim", strict["capture"]),
            "capture: strict, empty": (shimmed(empty), ["capture"], "capture: no shim", empty),
        }
        if args.other_shim is not None:
            variants["other shim, ample, 1.0 region"] = (
                {**base_env, "LD_PRELOAD": str(args.other_shim.resolve()),
                 "VGPU_REGION_DIR": str(old)}, [], "no shim", None)
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (env, mode, _base, _region) in variants.items():
                results[name].append(run(args.blocks, env, mode))
        spent = {name: (tokens_spent(region), sum(k for _, _, k in results[name]))
                 for name, (_env, _mode, _base, region) in variants.items() if region is not None}

    print(f"machine: {machine.describe()}, {platform.platform()}")
    print(f"{args.rounds} rounds x {args.blocks} blocks x 1000 kernels per variant, "
          f"graphs of {args.graph_kernels} kernels, fake driver, thread CPU time")
    print(f"{'variant':28} {'median ns':>10} {'p99 ns':>10} {'added ns':>10} {'ratio':>7}")
    medians = {name: statistics.median(m for m, _, _ in runs) for name, runs in results.items()}
    for name, runs in results.items():
        base = medians[variants[name][2]]
        p99 = statistics.median(p for _, p, _ in runs)
        print(f"{name:28} {medians[name]:10.1f} {p99:10.1f} {medians[name] - base:10.1f} "
              f"{medians[name] / base:7.2f}")
    added = medians["strict, tokens ample"] - medians["no shim"]
    added_graph = medians["graph: strict, ample"] - medians["graph: no shim"]
    print(f"goal <= 50 ns added per launch (strict, tokens ample): "
          f"{'met' if added <= 50 else 'NOT met'} ({added:.1f} ns; per kernel of a graph "
          f"{added_graph:.2f} ns)")
    per_kernel = {name: tokens / kernels for name, (tokens, kernels) in spent.items()}
    ratio = per_kernel["graph: strict, ample"] / per_kernel["strict, tokens ample"]
    print(f"tokens per kernel: launched alone {per_kernel['strict, tokens ample']:.1f}, in a graph "
          f"{per_kernel['graph: strict, ample']:.1f} (ratio {ratio:.4f}, goal within 1 %: "
          f"{'met' if abs(ratio - 1) <= 0.01 else 'NOT met'})")
    captured = sum(spent[name][0] for name in ("capture: strict, ample", "capture: strict, empty"))
    kernels = sum(spent[name][1] for name in ("capture: strict, ample", "capture: strict, empty"))
    print(f"captured kernels: {captured} tokens for {kernels} kernels (goal 0: "
          f"{'met' if captured == 0 else 'NOT met'}); with an empty bucket a captured launch costs "
          f"{medians['capture: strict, empty'] / medians['capture: no shim']:.2f}x the fake "
          "driver's own")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The control law's cost per container-device and tick: the reference law against the fast ones.

    python tests/bench/bench_law.py [--containers 18] [--seconds 10] [--rounds 5]

Records every tick the controller hands the law on one simulated GPU (the default imperfect
plant, NVML sigma 3 every 1/6 s; `--containers` busy containers with mixed limits, policies and
priorities), then replays the recording through the reference, the fast law in Python and the same law in C
(where built), alternately, `--rounds` times, and prints the median microseconds per
container-device per tick of each and their ratios. Every replayed tick is also checked to give
identical decisions (the C step must not hand any back to Python).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun
from vgpu_agent.throttle.control import control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import NATIVE, native_step


def record(containers: int, seconds: float) -> list[tuple]:  # type: ignore[type-arg]
    specs = tuple(
        ContainerSpec(f"c{i}", 100 / containers * (0.5 + (i % 3) * 0.5),
                      Workload(kernel_s=0.0005 * (1 + i % 4), blocks=64 << (i % 5),
                               busy=((0.0, 1e9),) if i % 4 else ((0.0, 3.0), (5.0, 1e9))),
                      policy=("strict", "work-conserving", "off", "work-conserving")[i % 4]
                      if i % 7 else "strict",
                      priority=i % 3)
        for i in range(containers)
    )
    run = ControlledRun(specs)
    ticks: list[tuple] = []  # type: ignore[type-arg]

    def recording(observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        ticks.append((list(observations), dict(states), dt_s, params))
        return control_step(observations, states, dt_s, params)

    run.controller.law = recording
    asyncio.run(run.advance(seconds))
    return ticks


def replay(law, ticks) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for observations, states, dt_s, params in ticks:
        law(observations, states, dt_s, params)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=18)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ticks = record(args.containers, args.seconds)
    for observations, states, dt_s, params in ticks:
        reference = control_step(observations, states, dt_s, params)
        if control_step_gpu(observations, states, dt_s, params) != reference:
            print("the laws disagree: fast law is wrong")
            return 1
        if NATIVE and native_step(observations, states, dt_s, params) != reference:
            print("the laws disagree (or the C step declined): the law in C is wrong")
            return 1
    devices = sum(len(t[0]) for t in ticks)
    laws = {"reference": control_step, "fast": control_step_gpu}
    if NATIVE:
        laws["C"] = native_step
    spent: dict[str, list[float]] = {name: [] for name in laws}
    for _ in range(args.rounds):
        for name, law in laws.items():
            spent[name].append(replay(law, ticks) / devices * 1e6)
    us = {name: statistics.median(values) for name, values in spent.items()}
    print(f"{len(ticks)} ticks x {args.containers} containers on one GPU, {args.rounds} rounds, "
          f"decisions identical")
    print(f"reference law {us['reference']:.1f} us per container-device per tick, fast law "
          f"{us['fast']:.1f} us: x{us['reference'] / us['fast']:.2f}")
    if NATIVE:
        print(f"law in C {us['C']:.2f} us: x{us['reference'] / us['C']:.1f} the reference, "
              f"x{us['fast'] / us['C']:.1f} the fast law")
    else:
        print("law in C: not built")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

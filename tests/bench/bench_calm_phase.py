"""A change of phase during a calm GPU's slow tick, with and without the look at launch costs.

    python tests/bench/bench_calm_phase.py [--seeds 16] [--change-s 40] [--plant NAME]

`bench_throttle.py`'s scenario 6 (a 40 % and a 60 % container, both busy; at the change the
first one's tokens come to buy four times the SM time, the other's a quarter) with the change
late enough that the GPU's tick has grown to 2 s (nothing is lent), at the controller's own
pace. Per plant, over the seeds, for the 60 % container (the one its neighbour takes from):
the point-seconds of its share it lost in the 5 s after the change (median and p90), and for
how long it was 10 points or more short (median and most). Each seed runs twice in one
process, side by side: as the controller is, and with the look between slow ticks blind to
launch costs (`LAUNCH_COST_MOVE` infinite: only the next tick sees the change), which is how
it was before the look.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WINDOW_S = 0.1
AFTER_S = 5.0
SHORT_POINTS = 10.0


async def one(plant: object, seed: int, change_s: float, look: bool) -> tuple[float, float]:
    """(point-seconds lost, seconds 10 points short) of the 60 % container after the change."""
    import bench_throttle as bt
    import structlog

    from vgpu_agent.simulation.runner import run_controlled
    from vgpu_agent.throttle import controller

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    base = next(s for s in bt.scenarios(30) if s.name.startswith("6 "))
    containers = tuple(replace(c, switch_at_s=change_s) for c in base.containers)
    scenario = bt.attainable(replace(base, containers=containers, duration_s=change_s + 8,
                                     changes=(change_s,)), plant.spec)  # type: ignore[attr-defined]
    moved = controller.LAUNCH_COST_MOVE
    controller.LAUNCH_COST_MOVE = moved if look else math.inf
    try:
        spec = replace(plant.spec, seed=seed)  # type: ignore[attr-defined]
        result = await run_controlled(scenario, plant=spec, paced=True, window_s=WINDOW_S)
    finally:
        controller.LAUNCH_COST_MOVE = moved
    want = scenario.expected("cheaper", change_s + 1)
    shares = [s for t, s in result.series["cheaper"] if change_s < t <= change_s + AFTER_S]
    lost = sum(max(0.0, want - s) * WINDOW_S for s in shares)
    short = sum(WINDOW_S for s in shares if s < want - SHORT_POINTS)
    return lost, short


def main() -> None:
    import bench_throttle as bt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--change-s", type=float, default=40.0)
    parser.add_argument("--plant", default="", help="run only the plants whose name has this")
    args = parser.parse_args()
    print(f"scenario 6, change at {args.change_s} s, paced; the 60 % container in the "
          f"{AFTER_S:.0f} s after the change ({args.seeds} seeds a noisy plant)")
    print(f"{'plant':7} {'':9} | lost pt-s p50    p90 | {SHORT_POINTS:.0f} pts short s p50    max")
    for plant in bt.PLANTS:
        if args.plant not in plant.name:
            continue
        seeds = 1 if plant.name == "ideal" else args.seeds
        rows = {}
        for look in (True, False):
            runs = [asyncio.run(one(plant, seed, args.change_s, look)) for seed in range(seeds)]
            lost = sorted(r[0] for r in runs)
            short = sorted(r[1] for r in runs)
            rows[look] = (statistics.median(lost), lost[int(0.9 * (len(lost) - 1))],
                          statistics.median(short), short[-1])
        for look in (True, False):
            p50, p90, s50, smax = rows[look]
            name = "look" if look else "no look"
            print(f"{plant.name:7} {name:9} |       {p50:7.1f} {p90:6.1f} |             "
                  f"{s50:5.2f} {smax:6.2f}")
        ratio = rows[False][0] / rows[True][0] if rows[True][0] > 0 else math.inf
        print(f"{plant.name:7} {'ratio':9} |  no look / look, lost p50: x{ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Replays the splits of a traced GPU run through today's `TimeSlicedSplit`, without a GPU.

    python3 shim/tests/gpu/replay_split.py DIR/trace_CASE.jsonl [--every S] [--from S] [--to S]

`nvml_loop.py --trace` writes every split of a time-sliced GPU's use the controller made: its
inputs (the periods' owners, the GPU's use, the tokens each container spent, the tick's
length, the containers distrusted, the one on a turn alone) and the shares it gave. This feeds
the same inputs, in order, to a fresh split of the code checked out now and prints, every
`--every` seconds, each container's share then and now, its figure (the reading it stands for,
and its spending) and whether the use was bounded by the figures. Open loop: the controller
of the run steered on the shares it computed then, so past the first split that differs the
inputs are what that steering made them, not what today's would have. What it answers is
"charged what, for the same evidence?", for a change to the split judged against a real GPU's
readings.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vgpu_agent.throttle.timesliced import TimeSlicedSplit


def replayed(rows: Sequence[dict]) -> Iterator[tuple[float, dict, dict, TimeSlicedSplit]]:
    """Per traced split, in order: (seconds since the trace's first row, the shares traced,
    the shares now, the split after it)."""
    split = TimeSlicedSplit()
    start = rows[0]["t"] if rows else 0.0
    for row in rows:
        if "owners" not in row:
            continue  # an NVML read: the split's owners and use already stand for it
        # (traces written before launches were traced have no "per_launch")
        now = split.share(row["owners"], row["busy"], row["spent"], row["dt_s"],
                          row["untrusted"], row["solo"], row.get("per_launch"))
        yield row["t"] - start, row["shares"], now, split


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between lines")
    parser.add_argument("--from", dest="start", type=float, default=0.0)
    parser.add_argument("--to", type=float, default=float("inf"))
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    shown = -float("inf")
    for t, then, now, split in replayed(rows):
        if not args.start <= t <= args.to or t - shown < args.every:
            continue
        shown = t
        ids = sorted(now)
        figures = []
        for alloc_id in ids:
            figure = split.alone.get(alloc_id)
            figures.append("-" if figure is None
                           else f"{figure[0] * figure[1]:.1f}@{figure[1]:.3g}")
        bounded = "bounded" if split.beyond_work else "whole"
        print(f"{t:7.2f} s  then {' '.join(f'{then.get(a, 0.0):5.1f}' for a in ids)}"
              f"  now {' '.join(f'{now[a]:5.1f}' for a in ids)}"
              f"  figures {' '.join(figures)}  {bounded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

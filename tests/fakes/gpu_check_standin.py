"""A stand-in for `shim/tests/gpu/gpu_check throughput` with the shim preloaded, for checking
`shim/tests/gpu/nvml_loop.py` without a GPU.

    python gpu_check_standin.py throughput SECONDS GRID BLOCK SPIN_US

It plays the shim and the GPU of one process: every 20 ms it spends tokens at the rate its
region's `control` grants (the GPU's full rate, FULL_TOKENS_PER_S, where the shim would not
limit it, and never more than that; nothing at a rate of 0 with a burst, as a paused
container), and writes what it spent into `state` as the shim does (the device totals and its
own process slot). It prints gpu_check's line at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.fakes.shimstate import ShimWriter, put_totals
from vgpu_agent.shm import layout

FULL_TOKENS_PER_S = 40_000_000  # what this pretend GPU does unthrottled
STEP_S = 0.02


def main() -> int:
    mode, seconds, grid, block = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if mode != "throughput":
        print(f"only 'throughput' is played, not {mode!r}", file=sys.stderr)
        return 2
    region = Path(os.environ["VGPU_REGION_DIR"])
    cost = grid * block
    spent = launches = 0
    owed = 0.0  # tokens granted but not yet whole: a rate under 50 a second must still spend
    writer = ShimWriter(region)
    start = last = time.monotonic()
    # its first spending is a step's worth, as a first launch is a whole launch: a sliver (the
    # microseconds to the loop's first pass) read by the controller's first tick would make a
    # cold-start bound no real shim could give
    time.sleep(STEP_S)
    try:
        while (now := time.monotonic()) - start < seconds:
            device = layout.decode_control((region / "control").read_bytes()).devices[0]
            # unlimited as the shim's vgpu_unlimited; a rate of 0 with a burst is paused
            unlimited = device.policy == layout.POLICY_OFF \
                or device.core_limit >= layout.CORE_LIMIT_FULL \
                or (device.rate == 0 and device.burst == 0)
            rate = FULL_TOKENS_PER_S if unlimited else min(device.rate, FULL_TOKENS_PER_S)
            owed += rate * (now - last)
            spent += int(owed)
            owed -= int(owed)
            launches = spent // cost
            last = now
            # as the shim keeps them: its own process slot, then the device totals (the slot's
            # gain goes into the totals too; set after it, they read what it spent, also where
            # a process before it in the region left a slot fuller than this one's)
            writer.process(0, os.getpid(), os.getpid(), 0, launches=launches, tokens=spent,
                           last_launch_ns=time.monotonic_ns())
            put_totals(region, 0, spent, launches, 0)
            time.sleep(STEP_S)
    finally:
        writer.close()
    print(f"launches_per_s={launches / (time.monotonic() - start):.1f} cost={cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Timer slack: far timers moved onto a shared grid, so that periodic tasks share wake-ups.

An idle agent runs a handful of periodic tasks (health check, NVML poll, plugin socket watch,
loop heartbeat, backstop, metrics caches), each sleeping its own period from its own phase. On
an idle node every expiry is a wake-up of the process of its own, and a wake-up costs far more
than the little work each task then does (about 0.2 ms of CPU alone against 0.05 ms when a few
share one, on the 2-vCPU machine in BENCHMARKS.md). The rule, like the kernel's timer slack:

- a timer due less than `MIN_DELAY_S` ahead is kept as it is: the controller's ticks (0.1 to
  0.4 s), retries, timeouts that bound a latency;
- a farther one is moved to the next multiple of `GRID_S` of the loop's clock: at most
  `GRID_S` late, and at most `EARLY_S` early, so that a task re-arming its period just after a
  grid point (it woke there and did a little work) lands on the grid point one period on
  rather than one step later each period.

Pure: no I/O, no asyncio (the event loop that applies it is built in `vgpu_agent.agent`).
"""

from __future__ import annotations

import math

GRID_S = 0.5
MIN_DELAY_S = 0.45
EARLY_S = 0.02


def slack_deadline(now: float, when: float) -> float:
    """When a timer asked for at `when` (loop clock, `now` being the present) should fire."""
    if not when - now >= MIN_DELAY_S or math.isinf(when):  # near, NaN or never: as asked
        return when
    return math.ceil((when - EARLY_S) / GRID_S) * GRID_S

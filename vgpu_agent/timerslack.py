"""Timer slack: far timers moved onto a shared grid, so that periodic tasks share wake-ups.

An idle agent runs a handful of periodic tasks (health check, NVML poll, loop heartbeat,
backstop, the controller's idle check), each sleeping its own period from its own phase. On
an idle node every expiry is a wake-up of the process of its own, and a wake-up costs far more
than the little work each task then does (about 0.2 ms of CPU alone against 0.05 ms when a few
share one, on the 2-vCPU machine in BENCHMARKS.md). The rule, like the kernel's timer slack:

- a timer due less than `MIN_DELAY_S` ahead is kept as it is: the controller's ticks (0.1 to
  0.4 s), retries, timeouts that bound a latency;
- a farther one is moved to the next point of a grid on the loop's clock: every `GRID_S` for a
  timer due less than `WIDE_FROM_S` ahead, every `WIDE_GRID_S` for one due later. So the tasks
  of a one-second period (health check, NVML poll, heartbeat) all wake on the same whole
  second, whatever their phase, the backstop's 2 s round and half-second tasks join them
  there. A timer fires at
  most one grid step late, and at most `EARLY_SHARE` of its delay (and never more than
  `MAX_EARLY_S`) early, so that a task re-arming its period just after a grid point (it woke
  there and did a little work, a thread hop of NVML calls included) lands on the grid point one
  period on rather than one step later each period. The cap keeps a long wait long: a minute's
  sleep or timeout ends at most a tenth of a second before its time, not three seconds.

Pure: no I/O, no asyncio (the event loop that applies it is built in `vgpu_agent.agent`).
"""

from __future__ import annotations

import math

GRID_S = 0.5
WIDE_GRID_S = 1.0
WIDE_FROM_S = 0.95
MIN_DELAY_S = 0.45
EARLY_SHARE = 0.05
MAX_EARLY_S = 0.1


def grid_for(delay: float) -> float:
    """The grid a timer due `delay` seconds ahead (>= MIN_DELAY_S) is moved onto."""
    return WIDE_GRID_S if delay >= WIDE_FROM_S else GRID_S


def slack_deadline(now: float, when: float) -> float:
    """When a timer asked for at `when` (loop clock, `now` being the present) should fire."""
    delay = when - now
    if not delay >= MIN_DELAY_S or math.isinf(when):  # near, NaN or never: as asked
        return when
    grid = grid_for(delay)
    return math.ceil((when - min(EARLY_SHARE * delay, MAX_EARLY_S)) / grid) * grid

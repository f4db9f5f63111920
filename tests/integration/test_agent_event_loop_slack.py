"""The agent process's event loop applies the timer slack: far timers on the grid, near ones and
`call_soon` as asked, and a far sleep still ends (at most one grid step late)."""

from __future__ import annotations

import asyncio
import math
import time

from vgpu_agent.agent import SlackEventLoop
from vgpu_agent.timerslack import GRID_S, MIN_DELAY_S


def test_far_timers_are_moved_onto_the_grid_and_near_ones_are_not():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        far = loop.call_later(MIN_DELAY_S + 0.2, lambda: None)
        near = loop.call_later(0.1, lambda: None)
        asked = loop.time() + 0.1
        try:
            steps = far.when() / GRID_S
            assert math.isclose(steps, round(steps), abs_tol=1e-6)
            assert abs(near.when() - asked) < 0.01
        finally:
            far.cancel()
            near.cancel()
        started = time.monotonic()
        await asyncio.sleep(MIN_DELAY_S + 0.1)
        slept = time.monotonic() - started
        assert MIN_DELAY_S + 0.05 < slept < MIN_DELAY_S + 0.1 + GRID_S + 0.5

    with asyncio.Runner(loop_factory=SlackEventLoop) as runner:
        runner.run(scenario())

"""A task's CPU on the loop's thread: its own steps, not others' or its worker threads'."""

from __future__ import annotations

import asyncio
import time

import pytest

from vgpu_agent.cpumeter import CpuMeter


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_the_steps_are_counted_and_the_waits_are_not() -> None:
    meter = CpuMeter()

    async def work() -> str:
        for _ in range(3):
            _spin(0.02)
            await asyncio.sleep(0.05)  # waiting: no CPU of its own
        return "done"

    assert await meter.run(work()) == "done"
    assert 0.06 <= meter.seconds < 0.06 + 0.03


async def test_other_tasks_work_while_it_waits_and_its_worker_threads_are_not_its() -> None:
    meter = CpuMeter()

    async def waits_on_others() -> None:
        await asyncio.to_thread(_spin, 0.05)  # a worker thread's CPU
        await asyncio.sleep(0.08)

    async def neighbour() -> None:
        await asyncio.sleep(0.01)
        _spin(0.05)  # on the loop's thread, while the metered task waits

    await asyncio.gather(meter.run(waits_on_others()), neighbour())
    assert meter.seconds < 0.02


async def test_exceptions_and_cancellation_pass_through_with_the_steps_counted() -> None:
    meter = CpuMeter()

    async def fails() -> None:
        _spin(0.02)
        await asyncio.sleep(0)
        raise ValueError("from the task")

    with pytest.raises(ValueError, match="from the task"):
        await meter.run(fails())
    assert meter.seconds >= 0.02

    cleaned = []

    async def long_wait() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            _spin(0.01)  # its clean-up on cancellation is its own step, counted
            cleaned.append(True)

    before = meter.seconds
    task = asyncio.create_task(meter.run(long_wait()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True] and meter.seconds - before >= 0.01
    # one meter sums the runs it is given, as a supervised task's restarts
    assert meter.seconds >= 0.03


async def test_a_future_awaited_directly_yields_its_result() -> None:
    meter = CpuMeter()
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, future.set_result, 7)
    assert await meter.run(future) == 7

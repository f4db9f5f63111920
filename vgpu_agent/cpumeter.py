"""The CPU one asyncio task spends on the event loop's thread, step by step.

`process_cpu_seconds_total` says what the whole agent costs; it does not say which part. A task's
own steps (what runs between two of its awaits) are all of its work on the loop, so timing each
step with the thread's CPU clock counts that task alone: what other tasks and callbacks do while
it waits is theirs, and what it hands to a worker thread (`asyncio.to_thread`) is not counted.
Two reads of the thread's clock a step, about a microsecond each: some 25 us a tick for the
throttle controller, whose tick yields a dozen times.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Generator
from typing import Any, TypeVar

T = TypeVar("T")


class CpuMeter:
    """Thread CPU seconds of the awaitables it runs, summed (`seconds`)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    async def run(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, its steps counted: its result, its exception, its cancellation
        all pass through as they are."""
        return await _Metered(awaitable.__await__(), self)  # type: ignore[no-any-return]


class _Metered:
    """An awaitable's iterator with each step (`send`, `throw`) timed on the thread's CPU clock;
    asyncio drives it as it would the awaitable itself."""

    __slots__ = ("_meter", "_steps")

    def __init__(self, steps: Generator[Any, Any, Any], meter: CpuMeter) -> None:
        self._steps, self._meter = steps, meter

    def __await__(self) -> _Metered:
        return self

    def __iter__(self) -> _Metered:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        started = time.thread_time()
        try:
            return self._steps.send(value)
        finally:
            self._meter.seconds += time.thread_time() - started

    def throw(self, *args: Any) -> Any:
        started = time.thread_time()
        try:
            return self._steps.throw(*args)
        finally:
            self._meter.seconds += time.thread_time() - started

    def close(self) -> None:
        self._steps.close()

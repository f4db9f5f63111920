"""A queue of API writes sent in order, at a paced rate, each retried until the API answers.

The node's health Events, its pod notices (and evictions) and the pods' refusal Events all go out
this way: one item at a time from the head of the queue, after a token from a bucket (`burst` at
once, then `rate` a second), so that a storm of changes never floods the API server; an item
that failed in a way a retry can fix is tried again after the backoff with the queue held behind
it (their order is what they say: unhealthy, then healthy again); one the API refused for good is
dropped by its caller's `settled`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from vgpu_agent.kube.backoff import Backoff, TokenBucket

T = TypeVar("T")


async def send_in_turn(
    items: deque[T],
    wake: asyncio.Event,
    rate: tuple[float, int],
    backoff: Backoff,
    send: Callable[[T], Awaitable[None]],
    settled: Callable[[T, Exception], bool],
    retry_later: Callable[[Exception, Backoff], Awaitable[None]],
    gone: Callable[[T], bool] = lambda _: False,
) -> None:
    """Sends `items` from the head as `wake` says there are some, forever. `rate`: (per second,
    burst). `send` raises on a failure; `settled(item, exc)` says whether that failure is the
    item's end (it logs why), else `retry_later` waits out the backoff before the same item is
    tried again. An item `gone` (asked once its token is taken) is dropped unsent. An item is
    taken off the queue only while it is still its head (the queue's owner may have cleared it
    meanwhile)."""
    loop = asyncio.get_running_loop()
    bucket = TokenBucket(*rate, now=loop.time())
    while True:
        await wake.wait()
        wake.clear()
        while items:
            wait = bucket.delay(loop.time())
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            item = items[0]
            if gone(item):
                items.popleft()
                continue
            try:
                await send(item)
            except Exception as exc:
                if not settled(item, exc):
                    await retry_later(exc, backoff)
                    continue
            else:
                backoff.reset()
            if items and items[0] is item:
                items.popleft()

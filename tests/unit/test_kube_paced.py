"""`send_in_turn`: a queue of API writes sent in order, paced, each retried until the API
answers; what the API refuses for good, and what is gone meanwhile, is dropped."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from vgpu_agent.kube.backoff import Backoff
from vgpu_agent.kube.paced import send_in_turn


class Refused(Exception):
    pass


class Unreachable(Exception):
    pass


async def _drain(items: deque[str], sender, timeout_s: float = 5.0) -> None:
    task = asyncio.create_task(sender)
    try:
        async with asyncio.timeout(timeout_s):
            while items:
                await asyncio.sleep(0.001)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_items_go_in_order_a_failed_one_holding_the_queue_until_it_is_sent():
    items: deque[str] = deque(["down", "refused", "gone", "up"])
    wake = asyncio.Event()
    wake.set()
    sent: list[str] = []
    tries: dict[str, int] = {}
    retries: list[tuple[str, int]] = []
    backoff = Backoff(0.001, 0.01)

    async def send(item: str) -> None:
        tries[item] = tries.get(item, 0) + 1
        if item == "down" and tries[item] <= 2:
            raise Unreachable(item)  # the API server away: tried again, nothing behind it sent
        if item == "refused":
            raise Refused(item)
        sent.append(item)

    def settled(item: str, exc: Exception) -> bool:
        return isinstance(exc, Refused)

    async def retry_later(exc: Exception, given: Backoff) -> None:
        assert given is backoff
        given.next_delay()
        retries.append((str(exc), given.failures))
        await asyncio.sleep(0)

    await _drain(items, send_in_turn(items, wake, (1000.0, 10), backoff, send, settled,
                                     retry_later, gone=lambda item: item == "gone"))
    assert sent == ["down", "up"]
    assert retries == [("down", 1), ("down", 2)]  # the backoff grows, then resets on success
    assert backoff.failures == 0
    assert tries == {"down": 3, "refused": 1, "up": 1}  # the gone one is never sent


async def test_a_burst_goes_at_once_and_the_rest_at_the_rate():
    items: deque[int] = deque(range(6))
    wake = asyncio.Event()
    wake.set()
    at: list[float] = []
    loop = asyncio.get_running_loop()

    async def send(item: int) -> None:
        at.append(loop.time())

    async def never(exc: Exception, backoff: Backoff) -> None:
        raise AssertionError("nothing fails here")

    await _drain(items, send_in_turn(items, wake, (20.0, 2), Backoff(0.1, 1.0), send,
                                     lambda item, exc: True, never))
    assert len(at) == 6
    assert at[1] - at[0] < 0.03  # the burst of two
    assert at[-1] - at[0] >= 4 / 20 * 0.9  # then 20 a second: four more take 0.2 s


async def test_an_item_its_owner_took_off_the_queue_meanwhile_is_not_popped_again():
    items: deque[str] = deque(["first", "second"])
    wake = asyncio.Event()
    wake.set()
    sent: list[str] = []

    async def send(item: str) -> None:
        if item == "first":
            items.clear()  # the owner drops the queue while the first is on the wire
            items.append("newer")
        sent.append(item)

    async def never(exc: Exception, backoff: Backoff) -> None:
        raise AssertionError("nothing fails here")

    await _drain(items, send_in_turn(items, wake, (1000.0, 10), Backoff(0.1, 1.0), send,
                                     lambda item, exc: True, never))
    assert sent == ["first", "newer"]

"""The metrics port against hostile clients: floods of half-sent requests, junk, huge headers.

In-process: the real `MetricsService` (aiohttp behind the connection guard) on a loopback port,
driven by raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from tests.integration.hostile_clients import (
    close_all,
    closed_by_server,
    get,
    open_half_requests,
)
from vgpu_agent.metrics import http as metrics_http
from vgpu_agent.metrics.connections import ConnectionGuard
from vgpu_agent.metrics.http import MetricsService
from vgpu_agent.metrics.sources import MetricsSources


@contextlib.asynccontextmanager
async def service(max_connections: int = 8, header_timeout_s: float = 5.0,
                  max_per_peer: int | None = None, served_grace_s: float = 2.0,
                  ) -> AsyncIterator[MetricsService]:
    svc = MetricsService(
        MetricsSources(node="node-1", gpus=lambda: [], slices_per_gpu=4),
        host="127.0.0.1",
        port=0,
    )
    svc.connections = ConnectionGuard(
        max_connections=max_connections,
        max_per_peer=max_per_peer or max_connections,
        header_timeout_s=header_timeout_s,
        served_grace_s=served_grace_s,
    )
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


async def test_a_flood_of_half_sent_requests_holds_at_most_the_cap_and_probes_answer() -> None:
    async with service(max_connections=8) as svc:
        held = await asyncio.to_thread(open_half_requests, "127.0.0.1", svc.port, 60)
        try:
            await asyncio.sleep(0.2)
            assert svc.connections.open_connections <= 8
            assert svc.connections.counts.displaced >= 50
            status, took = await asyncio.to_thread(
                get, f"http://127.0.0.1:{svc.port}/healthz"
            )
            assert status == 200 and took < 2.0
            # the connections displaced were closed by the server, freeing their descriptors
            assert await asyncio.to_thread(closed_by_server, held) >= 50
        finally:
            close_all(held)


async def test_one_peer_holds_at_most_its_share() -> None:
    async with service(max_connections=40, max_per_peer=4) as svc:
        held = await asyncio.to_thread(open_half_requests, "127.0.0.1", svc.port, 30)
        try:
            await asyncio.sleep(0.1)
            assert svc.connections.open_connections == 4
            # another address on this host is another peer, with its own share
            other = await asyncio.to_thread(
                open_half_requests, "127.0.0.1", svc.port, 3, "127.0.0.2"
            )
            await asyncio.sleep(0.1)
            assert svc.connections.open_connections == 7
            close_all(other)
        finally:
            close_all(held)


def keep_alive(port: int) -> socket.socket:
    """A connection that made one request, got its answer and stays open."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    return sock


async def test_idle_keep_alives_make_room_only_after_their_grace() -> None:
    async with service(max_connections=2, served_grace_s=0.5) as svc:
        idle = [await asyncio.to_thread(keep_alive, svc.port) for _ in range(2)]
        try:
            # both just served: nothing may be displaced yet, the newcomer is told to come back
            answer = await asyncio.to_thread(raw_exchange, svc.port, b"")
            assert answer.startswith(b"HTTP/1.1 503 ")
            assert svc.connections.counts.refused == 1
            await asyncio.sleep(0.6)
            status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{svc.port}/healthz")
            assert status == 200
            assert svc.connections.counts.displaced == 1
        finally:
            close_all(idle)


async def test_a_head_not_finished_in_time_is_closed() -> None:
    async with service(header_timeout_s=0.3) as svc:
        held = await asyncio.to_thread(open_half_requests, "127.0.0.1", svc.port, 3)
        try:
            await asyncio.sleep(0.05)  # the loop accepts them
            assert svc.connections.open_connections == 3
            await asyncio.sleep(0.8)
            assert svc.connections.open_connections == 0
            assert svc.connections.counts.head_timeouts == 3
            assert await asyncio.to_thread(closed_by_server, held) == 3
        finally:
            close_all(held)
        # a client that sends its request at once is not affected by the timer
        status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{svc.port}/readyz")
        assert status in (200, 503)


async def test_an_idle_keep_alive_connection_is_closed(monkeypatch) -> None:
    monkeypatch.setattr(metrics_http, "KEEPALIVE_TIMEOUT_S", 0.3)
    async with service() as svc:
        sock = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(1.5)  # aiohttp's keep-alive timer runs on a 1 s ceiling
            assert svc.connections.open_connections == 0
        finally:
            sock.close()


@pytest.mark.parametrize(
    "junk",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",  # TLS hello
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100)) + b"\r\n",
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999999999999\r\n\r\n",
    ],
)
async def test_malformed_requests_get_400_and_one_json_line(junk: bytes, caplog) -> None:
    caplog.set_level("DEBUG")
    async with service() as svc:
        with capture_logs() as logs:
            for _ in range(20):
                answer = await asyncio.to_thread(raw_exchange, svc.port, junk)
                assert answer.split(b" ", 2)[1] in (b"400", b"405", b"413", b"431")
        failed = [e for e in logs if e["event"] == "http_request_failed"]
        assert len(failed) <= 1  # the first at most, the rest counted
        assert all(isinstance(v, str | int | None) for e in failed for v in e.values())
        assert not [e for e in logs if "exc_info" in e or "exception" in e]
        # nothing reaches the standard library's handlers, where it would print a traceback
        assert not [r for r in caplog.records if r.exc_info or r.name.startswith("aiohttp")]
        status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{svc.port}/healthz")
        assert status == 200


async def test_a_first_head_beyond_16_kib_is_answered_431_without_reaching_aiohttp() -> None:
    async with service() as svc:
        answer = await asyncio.to_thread(
            raw_exchange, svc.port, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 20_000
        )
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert svc.connections.counts.oversized == 1
        assert svc.bad_requests.count == 0  # refused before aiohttp parsed anything


async def test_bad_requests_are_counted_and_logged_once_a_minute() -> None:
    async with service() as svc:
        with capture_logs() as logs:
            for _ in range(30):
                await asyncio.to_thread(raw_exchange, svc.port, b"\x00\x01junk\r\n\r\n")
        failed = [e for e in logs if e["event"] == "http_request_failed"]
        assert len(failed) == 1
        assert svc.bad_requests.count == 30

"""Limits on the metrics port's connections: how many, and how long a request head may take.

Any pod can reach the port, and aiohttp waits for a request head as long as the client likes:
a thousand connections that each send half a head would hold a thousand descriptors, and the
agent's other work (regions, gRPC, NVML) would fail with "Too many open files". So each
connection is wrapped before aiohttp sees it:

- at most `max_connections` are open, at most `max_per_peer` from one address; a new one beyond
  either displaces the connection (of that peer, when the peer is at its share) that has waited
  longest for its request head (a scraper or a probe sends its head at once, an attacker never
  does), or else one idle in keep-alive for more than `served_grace_s`, and is refused with 503
  only when every such connection has a request in hand;
- a request head must be complete within `header_timeout_s` of its first byte (of the
  connection, for the first one), or the connection is closed.

The wrapper only watches the bytes for the blank line that ends a head (and holds a first head
of at most 16 KiB); parsing, the other size limits and the 400 answer to a malformed head are
aiohttp's. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

HEAD_END = b"\r\n\r\n"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
)
TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
    b"Content-Length: 0\r\n\r\n"
)
MAX_FIRST_HEAD = 16 * 1024  # bytes held for a connection's first request head
REPORT_EVERY_S = 60.0


@dataclass
class ConnectionCounts:
    """What the limits did, cumulative."""

    accepted: int = 0
    displaced: int = 0  # closed to make room for a new connection
    refused: int = 0  # answered 503: every open connection was busy
    head_timeouts: int = 0  # closed for a request head not complete in time
    oversized: int = 0  # first request head larger than MAX_FIRST_HEAD: answered 431


class ConnectionGuard:
    """Wraps a protocol factory (aiohttp's `runner.server`) with the limits above."""

    def __init__(
        self,
        *,
        max_connections: int = 128,
        max_per_peer: int = 32,
        header_timeout_s: float = 5.0,
        served_grace_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_connections < 1 or not 1 <= max_per_peer <= max_connections:
            raise ValueError(
                f"max_connections={max_connections!r}, max_per_peer={max_per_peer!r}: "
                "at least 1, and per peer at most the total"
            )
        if not 0 < header_timeout_s <= 300:
            raise ValueError(f"header_timeout_s={header_timeout_s!r}: more than 0, at most 300")
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.header_timeout_s = header_timeout_s
        self.served_grace_s = served_grace_s
        self.clock = clock
        self.counts = ConnectionCounts()
        self._open: set[_Guarded] = set()
        self._peers: dict[str, set[_Guarded]] = {}
        # Both oldest first (a dict keeps insertion order): connections awaiting a request head,
        # and connections whose last head is complete, with when it completed.
        self._waiting: dict[_Guarded, None] = {}
        self._served: dict[_Guarded, float] = {}
        self._reported_at: float | None = None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _Guarded(self, factory)

        return make

    # --- called by the connections --------------------------------------------------------------

    def _admit(self, new: _Guarded) -> bool:
        """Make room for `new` if it must be made, or refuse it.

        Room is made by closing the connection that has waited longest for a request head, or
        else one whose last request was served more than `served_grace_s` ago (an idle
        keep-alive); first among the new connection's own peer's when that peer is at its
        share, so one pod cannot fill the port.
        """
        mine = self._peers.setdefault(new.peer, set())
        for pool, limit in ((mine, self.max_per_peer), (None, self.max_connections)):
            if len(mine if pool is not None else self._open) < limit:
                continue
            victim = self._victim(pool)
            if victim is None:
                self.counts.refused += 1
                self._report()
                if not mine:
                    del self._peers[new.peer]
                return False
            self._forget(victim)
            victim.close()
            self.counts.displaced += 1
            self._report()
        self._open.add(new)
        mine.add(new)
        self.counts.accepted += 1
        return True

    def _victim(self, pool: set[_Guarded] | None) -> _Guarded | None:
        now = self.clock()
        if pool is None:
            if self._waiting:
                return next(iter(self._waiting))
            for conn, served_at in self._served.items():  # the oldest only
                return conn if now - served_at >= self.served_grace_s else None
            return None
        waiting = [c for c in pool if c in self._waiting]
        if waiting:
            return min(waiting, key=lambda c: c.head_since or 0.0)
        idle = [c for c in pool if now - self._served.get(c, now) >= self.served_grace_s]
        return min(idle, key=lambda c: self._served[c]) if idle else None

    def _forget(self, conn: _Guarded) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self._served.pop(conn, None)
        mine = self._peers.get(conn.peer)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self._peers[conn.peer]

    def _head_waited(self, conn: _Guarded, waiting: bool) -> None:
        """`conn` now awaits a request head (`waiting`) or has one complete."""
        if conn not in self._open:
            return
        self._waiting.pop(conn, None)
        self._served.pop(conn, None)
        if waiting:
            self._waiting[conn] = None  # now the newest
        else:
            self._served[conn] = self.clock()

    def _timed_out(self, conn: _Guarded) -> None:
        self._forget(conn)
        self.counts.head_timeouts += 1
        self._report()

    def _report(self) -> None:
        """One line when the limits first act, then at most one a minute: never a flood."""
        now = self.clock()
        if self._reported_at is not None and now - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = now
        log.warning(
            "metrics_connections_limited",
            open=len(self._open),
            max_connections=self.max_connections,
            max_per_peer=self.max_per_peer,
            header_timeout_s=self.header_timeout_s,
            displaced=self.counts.displaced,
            refused=self.counts.refused,
            head_timeouts=self.counts.head_timeouts,
            oversized=self.counts.oversized,
            repeats=f"at most once per {REPORT_EVERY_S:.0f} s",
        )

class _Guarded(asyncio.Protocol):
    """One connection: the head timer and the accounting, then aiohttp's protocol inside.

    aiohttp's protocol (and the task it starts) is made only once the first request head is
    complete: until then the connection costs a small buffer and a timer, so a flood of
    connections that never finish a head never reaches aiohttp at all.
    """

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]):
        self._guard = guard
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._first: bytearray | None = bytearray()  # the first head, until it is complete
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self.head_since: float | None = None  # when the head now awaited began
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        if not self._guard._admit(self):
            self._first = None
            transport.write(REFUSAL)
            transport.close()
            return
        self._head_started()

    def data_received(self, data: bytes) -> None:
        first = self._first
        if first is not None:
            self._first_head(first, data)
            return
        if self._inner is None:
            return
        if self.head_since is None and data:
            self._head_started()
        seen = self._tail + data
        end = seen.rfind(HEAD_END)
        if end >= 0:
            self._head_done()
            if end + len(HEAD_END) < len(seen):  # the next request began in the same bytes
                self._head_started()
        self._tail = seen[-(len(HEAD_END) - 1) :]
        self._inner.data_received(data)

    def _first_head(self, first: bytearray, data: bytes) -> None:
        searched_from = max(0, len(first) - len(HEAD_END) + 1)
        first += data
        end = first.find(HEAD_END, searched_from)
        if end < 0:
            if len(first) > MAX_FIRST_HEAD:
                self._first = None
                self._guard.counts.oversized += 1
                self._head_done()
                if self._transport is not None:
                    self._transport.write(TOO_LARGE)
                    self._transport.close()
            return
        self._first = None
        self._head_done()
        if end + len(HEAD_END) < len(first):  # pipelined: the next head has begun
            self._head_started()
        self._tail = bytes(first[-(len(HEAD_END) - 1) :])
        assert self._transport is not None
        self._inner = self._factory()
        self._inner.connection_made(self._transport)
        self._inner.data_received(bytes(first))

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._first = None
        self._head_done()
        self._guard._forget(self)
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.connection_lost(exc)

    def close(self) -> None:
        """Close now (abort: a client that sends nothing must not hold the descriptor)."""
        self._head_done()
        if self._transport is not None:
            self._transport.abort()

    def _head_started(self) -> None:
        self.head_since = self._guard.clock()
        self._guard._head_waited(self, True)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._guard.header_timeout_s, self._expire)

    def _head_done(self) -> None:
        if self.head_since is not None:
            self._guard._head_waited(self, False)
        self.head_since = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _expire(self) -> None:
        self._timer = None
        if self.head_since is None:
            return
        self._guard._timed_out(self)
        self.close()

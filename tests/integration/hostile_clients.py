"""Clients that attack an HTTP port the way a hostile pod can: half-sent requests, held open.

Shared by the tests and `tests/bench/bench_hostile_inputs.py`. Blocking sockets, meant to run in
a worker thread so the caller's event loop (which may host a kubelet stand-in) keeps running.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.error
import urllib.request

HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: vgpu-agent\r\nX-Slow: "


def open_half_requests(
    host: str, port: int, count: int, source: str | None = None
) -> list[socket.socket]:
    """`count` connections that each send part of a request head and then nothing; from the
    address `source` when given (any 127.x address on loopback: another peer)."""
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            if source is not None:
                sock.bind((source, 0))
            sock.connect((host, port))
            sock.sendall(HALF_REQUEST)
        except OSError:
            sock.close()  # refused or reset: the server is defending itself
            continue
        held.append(sock)
    return held


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()


def closed_by_server(socks: list[socket.socket]) -> int:
    """How many of `socks` the server has closed (EOF or reset)."""
    closed = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            if sock.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return closed


def get(url: str, timeout_s: float = 5.0) -> tuple[int, float]:
    """(status, seconds) of one GET; status 0 when it failed to connect or timed out."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        status = err.code
    except OSError:
        status = 0
    return status, time.perf_counter() - started

"""The metrics HTTP server (aiohttp): /metrics, /status, /healthz, /readyz.

`MetricsService.run()` serves and keeps the two caches fresh until cancelled: NVML readings
every `poll_s`, region files once per scrape, read just before it is due (see `RegionCache`).
A scrape takes what it needs from the caches on the loop, then works out the containers,
builds, encodes and (for Prometheus) gzips the exposition in a worker thread; at most two
scrapes encode at once, later ones wait their turn.
A scrape never calls NVML or the kubelet. `/status` (the JSON document `vgpu-agent top` shows,
see `metrics/status.py`) is built from the same caches, the same way.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from vgpu_agent.gpu.model import GpuBackend
from vgpu_agent.metrics.collectors import (
    AgentInstruments,
    PendingSnapshot,
    gather_snapshot,
    render_exposition,
    take_snapshot,
)
from vgpu_agent.metrics.connections import ConnectionGuard
from vgpu_agent.metrics.exposition import LabelSets
from vgpu_agent.metrics.poller import GpuPoller, RegionCache, step_aside
from vgpu_agent.metrics.probes import liveness, readiness
from vgpu_agent.metrics.sources import MetricsSources
from vgpu_agent.metrics.status import build_status
from vgpu_agent.shm.usageread import NOT_NATIVE_USAGE_REASON

log = structlog.get_logger(__name__)

TEXT_PLAIN = "text/plain; charset=utf-8"
APPLICATION_JSON = "application/json"
MAX_CONCURRENT_RENDERS = 2
# What a client of the port may hold: see `connections.py` for why each is bounded.
MAX_CONNECTIONS = 128
MAX_CONNECTIONS_PER_PEER = 32  # the kubelet's probes and Prometheus each come from their own
HEADER_TIMEOUT_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0  # an idle connection after a response (aiohttp's default is an hour)
MAX_REQUEST_LINE = 4096  # bytes in the request line and in each header
MAX_HEADERS = 32
MAX_BODY = 4096  # no endpoint reads a body
BAD_REQUEST_REPORT_EVERY_S = 60.0


class _BadRequestLog(logging.Handler):
    """aiohttp's server log (a malformed request, a failing handler) as one structlog line.

    aiohttp answers a malformed request 400 itself and logs it with a traceback through the
    standard library; here it becomes one JSON event, the first at once and the rest counted in
    the next line at most once a minute, so a flood of junk cannot flood the log.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        self._reported_at: float | None = None
        self._unreported = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        now = time.monotonic()
        if self._reported_at is not None and now - self._reported_at < BAD_REQUEST_REPORT_EVERY_S:
            self._unreported += 1
            return
        self._reported_at = now
        error = record.exc_info[1] if record.exc_info else None
        log.warning(
            "http_request_failed",
            detail=record.getMessage()[:200],
            error=repr(error)[:300] if error is not None else None,
            not_logged_since_last=self._unreported,
            repeats=f"at most once per {BAD_REQUEST_REPORT_EVERY_S:.0f} s",
        )
        self._unreported = 0


def _server_logger(handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger(f"{__name__}.server.{id(handler)}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger


class MetricsService:
    """The endpoint and its caches; `instruments.on_result` is the device plugin's Allocate hook.
    """

    def __init__(
        self,
        sources: MetricsSources,
        *,
        host: str = "0.0.0.0",
        port: int = 9394,
        backend: GpuBackend | None = None,
        poll_s: float = 1.0,
        region_max_age_s: float = 5.0,
        hami: bool = False,
        instruments: AgentInstruments | None = None,
    ):
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port!r} is not allowed: 0..65535 (0 picks a free one)")
        self.sources = sources
        self.host = host
        self.port = port
        self.hami = hami
        self.instruments = instruments or AgentInstruments(sources.node)
        self.poller = GpuPoller(backend, sources.gpus, poll_s) if backend is not None else None
        self.regions = RegionCache(sources.regions, region_max_age_s)
        self.scrapes = 0
        self.scrape_errors = 0
        self._renders = asyncio.Semaphore(MAX_CONCURRENT_RENDERS)
        self.label_sets = LabelSets()  # escaped label text, kept from scrape to scrape
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self.connections = ConnectionGuard(
            max_connections=MAX_CONNECTIONS,
            max_per_peer=MAX_CONNECTIONS_PER_PEER,
            header_timeout_s=HEADER_TIMEOUT_S,
        )
        self.bad_requests = _BadRequestLog()

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        shown = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, host)
        return f"http://{shown}:{self.port}/metrics"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    async def start(self) -> None:
        """Bind and serve; `port` is the bound port afterwards (useful with port 0)."""
        runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=KEEPALIVE_TIMEOUT_S,
            max_line_size=MAX_REQUEST_LINE,
            max_field_size=MAX_REQUEST_LINE,
            max_headers=MAX_HEADERS,
            logger=_server_logger(self.bad_requests),
        )
        await runner.setup()
        assert runner.server is not None
        try:
            # Not aiohttp's TCPSite: every connection goes through the guard first.
            server = await asyncio.get_running_loop().create_server(
                self.connections.wrap(runner.server),
                self.host or None,
                self.port,
                reuse_address=True,
            )
        except OSError as err:
            await runner.cleanup()
            raise OSError(
                err.errno, f"cannot serve metrics on {self.host}:{self.port}: {err.strerror}"
            ) from err
        self._runner, self._server = runner, server
        for sock in server.sockets:
            self.port = int(sock.getsockname()[1])
            break
        log.info(
            "metrics_serving",
            url=self.url,
            hami_metrics=self.hami,
            max_connections=self.connections.max_connections,
            max_per_peer=self.connections.max_per_peer,
            header_timeout_s=self.connections.header_timeout_s,
        )
        if NOT_NATIVE_USAGE_REASON is not None:  # each round then costs about 1.4x the CPU
            log.warning("metrics_usage_read_not_native", reason=NOT_NATIVE_USAGE_REASON,
                        read="python")

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def run(self) -> None:
        """Serve and refresh the caches until cancelled."""
        await self.start()
        try:
            async with asyncio.TaskGroup() as group:
                if self.poller is not None:
                    group.create_task(_forever(self.poller.run, "gpu-poller"), name="metrics-gpu")
                group.create_task(_forever(self.regions.run, "regions"), name="metrics-regions")
        finally:
            await self.stop()

    async def refresh(self) -> None:
        """One round of both caches now (tests, and a first scrape right after start)."""
        if self.poller is not None:
            await self.poller.poll_once()
        await self.regions.refresh()

    # ---- handlers ----------------------------------------------------------------------------

    async def render(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]:
        """The exposition a scrape with this `Accept` header gets, and its content type;
        gzip-compressed when `gzipped` (Prometheus always accepts gzip: 25x fewer bytes)."""
        regions = await self.regions.fresh()
        pending = gather_snapshot(
            self.sources,
            self.poller.samples if self.poller is not None else {},
            regions,
            self.regions.read_errors,
        )
        encoder, content_type = choose_encoder(accept)
        openmetrics = content_type.startswith("application/openmetrics-text")
        async with self._renders:
            body = await asyncio.to_thread(
                _render_body, pending, self.instruments, self.hami, encoder, openmetrics, gzipped,
                self.label_sets,
            )
        return body, content_type

    async def _metrics(self, request: web.Request) -> web.Response:
        gzipped = "gzip" in request.headers.get("Accept-Encoding", "")
        try:
            body, content_type = await self.render(request.headers.get("Accept", ""), gzipped)
        except Exception as err:
            self.scrape_errors += 1
            log.exception("metrics_scrape_failed")
            return web.Response(
                status=500, text=f"metrics collection failed: {err!r}\n", content_type="text/plain"
            )
        self.scrapes += 1
        headers = {"Content-Type": content_type}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    async def status(self) -> bytes:
        """The `/status` document, JSON-encoded (the encoding runs in a worker thread)."""
        regions = await self.regions.fresh()
        samples = self.poller.samples if self.poller is not None else {}
        snap = take_snapshot(self.sources, samples, regions, self.regions.read_errors)
        throttle = dict(self.sources.throttle_status()) if self.sources.throttle_status else {}
        document = build_status(
            snap, regions, self.sources.identity, throttle,
            policy_source=self.sources.policy_source,
        )
        async with self._renders:
            return await asyncio.to_thread(_json_bytes, document)

    async def _status(self, request: web.Request) -> web.Response:
        try:
            body = await self.status()
        except Exception as err:
            log.exception("status_failed")
            return web.Response(
                status=500, text=f"status collection failed: {err!r}\n", content_type="text/plain"
            )
        return web.Response(body=body, headers={"Content-Type": APPLICATION_JSON})

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, lines = liveness(self.sources)
        return _probe_response(ok, lines)

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, lines = readiness(self.sources)
        return _probe_response(ok, lines)


def _render_body(
    pending: PendingSnapshot,
    instruments: AgentInstruments,
    hami: bool,
    encoder: Callable[[Collector], bytes],
    openmetrics: bool,
    gzipped: bool,
    labels: LabelSets | None = None,
) -> bytes:
    snap = pending.complete()
    step_aside()
    body = render_exposition(snap, instruments, hami, encoder, openmetrics, labels, step_aside)
    step_aside()
    # level 1: about a sixth of the CPU of level 6, and the text still shrinks some 15x
    return gzip.compress(body, compresslevel=1) if gzipped else body


def _json_bytes(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def _probe_response(ok: bool, lines: list[str]) -> web.Response:
    head = "ok" if ok else "not ok"
    return web.Response(
        status=200 if ok else 503,
        text="\n".join([head, *lines]) + "\n",
        headers={"Content-Type": TEXT_PLAIN},
    )


async def _forever(loop_fn: Callable[[], Awaitable[None]], name: str) -> None:
    """Keep a cache loop going: a failure is logged and the loop restarts after a pause."""
    delay = 0.5
    while True:
        try:
            await loop_fn()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("metrics_cache_failed", cache=name, restart_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)

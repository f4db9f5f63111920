"""structlog set-up: key-value events as JSON lines or readable console lines.

Libraries that log through the standard library (grpc, asyncio, aiohttp) are routed into the same
stream as one event per record (`library_log`), never as a raw multi-line traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO


def _import_structlog_without_rich() -> None:
    """Import structlog without letting it import rich (about 0.1 s and 10 MB at start-up).

    structlog's console renderer imports rich, when installed, for pretty tracebacks; the agent
    never uses them, since `format_exc_info` turns every exception into text before any
    renderer sees it. rich is hidden only while structlog is imported: `vgpu-agent top`, which
    draws with rich, imports it as usual afterwards.
    """
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


_import_structlog_without_rich()

import structlog  # noqa: E402

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(log_format: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """Log to `stream` (stderr by default)."""
    stream = stream if stream is not None else sys.stderr
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor
    if log_format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    route_library_logs()


class _ToStructlog(logging.Handler):
    """A standard-library record as one structlog event: the message and the error, no trace."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            error = record.exc_info[1] if record.exc_info else None
            structlog.get_logger(record.name).log(
                record.levelno,
                "library_log",
                logger=record.name,
                message=record.getMessage()[:500],
                error=repr(error)[:300] if error is not None else None,
            )
        except Exception:
            self.handleError(record)


def route_library_logs() -> None:
    """Send WARNING and above from standard-library loggers through structlog (once)."""
    root = logging.getLogger()
    if not any(isinstance(h, _ToStructlog) for h in root.handlers):
        root.addHandler(_ToStructlog(logging.WARNING))

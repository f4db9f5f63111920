"""`vgpu-agent top`: a node's GPUs, slices and containers at a glance, from the agent's `/status`.

One block per GPU with a row per allocation on it: memory used against its limit, measured SM
share against its limit (and the controller's target), time spent waiting for tokens, policy,
priority and the age of the last launch. An unhealthy GPU and a container above its limit
stand out; a container paused for a neighbour's turn alone is marked. `--once` prints one
frame, `--json` the raw document; without a terminal the view is
plain text. A client only: it reads the HTTP endpoint and never touches the node's files.
"""

from __future__ import annotations

import io
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

DEFAULT_URL = "http://127.0.0.1:9394/status"
SCHEMA_VERSION = 1
BAR_WIDTH = 10
PLAIN_WIDTH = 140
MAX_NAME_WIDTH = 40
GIB = 1024**3
# a measured share this far above the limit (0..1 of the GPU) marks the container: NVML samples
# are coarse, so a point or two above is noise, not a breach
SHARE_TOLERANCE = 0.02


class TopError(Exception):
    """The status could not be fetched or understood; the message is one line for the user."""


def status_url(url: str) -> str:
    """The `/status` URL for what the user typed: a base URL gets `/status` appended."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise TopError(f"--url {url!r} is not allowed: an http(s) URL such as {DEFAULT_URL}")
    path = parsed.path if parsed.path not in ("", "/") else "/status"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, parsed.query, ""))


def fetch_status(url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """GET the status document; any failure is a `TopError` naming the URL."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(16 * 1024 * 1024)
    except urllib.error.HTTPError as err:
        raise TopError(f"cannot read {url}: HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, OSError) and reason.strerror:
            reason = reason.strerror
        raise TopError(f"cannot reach {url}: {reason}") from None
    try:
        document = json.loads(body)
    except ValueError:
        raise TopError(f"{url} did not answer with a JSON status document") from None
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION:
        version = document.get("schema_version") if isinstance(document, dict) else None
        raise TopError(
            f"{url} answered schema_version {version!r}: this client reads {SCHEMA_VERSION}"
        )
    return document


# ---------------------------------------------------------------------------------- rendering


def _bar(fraction: float | None, over: bool = False) -> Text:
    if fraction is None:
        return Text("·" * BAR_WIDTH, style="dim")
    filled = round(max(0.0, min(1.0, fraction)) * BAR_WIDTH)
    style = "bold red" if over else "green"
    return Text("█" * filled, style=style) + Text("░" * (BAR_WIDTH - filled), style="dim")


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f}"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _who(allocation: Mapping[str, Any]) -> str:
    if allocation.get("pod") is None:
        return f"({allocation['alloc_id']})"
    return f"{allocation['namespace']}/{allocation['pod']}/{allocation['container']}"


def _over(device: Mapping[str, Any]) -> tuple[bool, bool]:
    """(memory above its limit, measured share above its limit and above its target)."""
    limit = device.get("memory_limit_bytes") or 0
    used = device.get("memory_used_bytes")
    memory = bool(limit) and used is not None and used > limit
    share, cap = device.get("core_measured_ratio"), device.get("core_limit_ratio")
    # a work-conserving container may run above its limit on compute lent to it: what it must
    # not pass is what the controller allows it now (its target), when that is higher
    allowed = max(cap or 0.0, device.get("core_target_ratio") or 0.0)
    cores = share is not None and cap is not None and share > allowed + SHARE_TOLERANCE
    return memory, cores


def _row(allocation: Mapping[str, Any], device: Mapping[str, Any]) -> list[RenderableType]:
    memory_over, share_over = _over(device)
    name = Text(_who(allocation))
    if allocation["state"] != "active":
        name.append(f" [{allocation['state']}]", style="dim")
    if device.get("paused"):  # for a neighbour's turn alone: its launches wait (under 2 s)
        name.append(" [paused: turn alone]", style="yellow")
    if memory_over or share_over:
        name = Text("! ", style="bold red") + name
        name.stylize("bold red")
    limit = device.get("memory_limit_bytes") or 0
    used = device.get("memory_used_bytes")
    memory = _bar(used / limit if limit and used is not None else None, memory_over)
    memory.append(f" {_gib(used)}/{_gib(limit) if limit else 'inf'} GiB")
    spilled = device.get("memory_spilled_bytes")
    if spilled:  # served from host memory: slower, and charged to the container's memory
        memory.append(f" ({_gib(spilled)} spilled)", style="yellow")
    share, cap = device.get("core_measured_ratio"), device.get("core_limit_ratio")
    bar = _bar(share / cap if share is not None and cap else None, share_over)
    bar.append(f" {_percent(share)}")
    return [
        name,
        memory,
        bar,
        _percent(cap),
        _percent(device.get("core_target_ratio")),
        _seconds(device.get("token_wait_seconds")),
        str(device.get("policy") or "-"),
        str(allocation.get("priority", 0)),
        _seconds(device.get("last_launch_age_seconds")),
    ]


_COLUMNS = (
    ("CONTAINER", "left"),
    ("MEMORY used/limit", "left"),
    ("SHARE measured", "left"),
    ("LIMIT", "right"),
    ("TARGET", "right"),
    ("WAITED", "right"),
    ("POLICY", "left"),
    ("PRIO", "right"),
    ("LAST", "right"),
)


def _table(name_width: int) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header, justify in _COLUMNS:
        # the name column has a fixed width (it wraps, never vanishes); in a narrow terminal
        # the figures are cut with an ellipsis instead, so every row still says whose it is
        named = header == "CONTAINER"
        table.add_column(
            header,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=not named,
            overflow="fold" if named else "ellipsis",
            width=name_width if named else None,
        )
    return table


def _gpu_title(gpu: Mapping[str, Any]) -> Text:
    title = Text(f"GPU {gpu['index']} {gpu['model']} {gpu['uuid']}  ", style="bold")
    healthy = gpu.get("healthy")
    if healthy is False:
        title.append("UNHEALTHY", style="bold white on red")
    else:
        title.append("healthy" if healthy else "health unknown", style="green" if healthy else "")
    util = gpu.get("utilization_ratio")
    title.append(f"  util {_percent(util)}" if util is not None else "  util -")
    if gpu.get("readings_stale"):
        title.append(" (stale)", style="yellow")
    if gpu.get("nvml_time_sliced"):
        title.append("  NVML time-sliced (use estimated)", style="cyan")
    if gpu.get("nvml_use_only_strangers"):
        title.append("  use only by processes of no container (unmeasured)", style="bold yellow")
    uncharged = gpu.get("uncharged_use_ratio")
    if uncharged:
        title.append(f"  busy beyond the work {_percent(uncharged)}", style="yellow")
    title.append(
        f"  memory {_gib(gpu.get('memory_used_bytes'))}/{_gib(gpu['memory_total_bytes'])} GiB"
        f"  slices {gpu['slices_allocated']}/{gpu['slices_total']}"
    )
    return title


def render(status: Mapping[str, Any], error: str = "") -> RenderableType:
    """One frame of the view for a status document (and the last fetch error, if any)."""
    gpus: Sequence[Mapping[str, Any]] = status.get("gpus", [])
    allocations: Sequence[Mapping[str, Any]] = status.get("allocations", [])
    rows: dict[str | None, list[list[RenderableType]]] = {}
    names = [len(_who(a)) + 2 for a in allocations]  # +2: the "! " mark
    name_width = max(16, min(MAX_NAME_WIDTH, max(names, default=0)))
    for allocation in allocations:
        for device in allocation.get("devices", []):
            known = any(g["uuid"] == device["gpu_uuid"] for g in gpus)
            rows.setdefault(device["gpu_uuid"] if known else None, []).append(
                _row(allocation, device)
            )
    registered = status.get("registered")
    head = Text(f"vgpu-agent {status.get('agent_version', '?')} on {status.get('node', '?')}: ")
    head.append(f"{len(gpus)} GPUs, {len(allocations)} allocations")
    if registered is not None:
        head.append(", registered" if registered else ", NOT registered",
                    style="" if registered else "bold red")
    parts: list[RenderableType] = [head]
    if error:
        parts.append(Text(error, style="bold red"))
    for gpu in gpus:
        table = _table(name_width)
        for row in rows.get(gpu["uuid"], []):
            table.add_row(*row)
        if not rows.get(gpu["uuid"]):
            table.add_row(Text("(no allocations)", style="dim"), *[""] * (len(_COLUMNS) - 1))
        parts += [Text(""), _gpu_title(gpu), table]
    if rows.get(None):
        table = _table(name_width)
        for row in rows[None]:
            table.add_row(*row)
        parts += [Text(""), Text("GPUs not on this node", style="bold yellow"), table]
    return Group(*parts)


def frame_text(status: Mapping[str, Any], width: int = PLAIN_WIDTH) -> str:
    """One frame as plain text, without colours (for `--once` into a file, and tests)."""
    console = Console(width=width, color_system=None, force_terminal=False, file=io.StringIO())
    console.print(render(status))
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


# ---------------------------------------------------------------------------------- command


def run_top(
    url: str,
    interval_s: float = 1.0,
    once: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
    fetch: Callable[[str], dict[str, Any]] = fetch_status,
    sleep: Callable[[float], None] = time.sleep,
    frames: int | None = None,
) -> int:
    """The `top` command: exit 0, or 1 (one line on stderr) when the agent cannot be read at the
    first try. Later failures are shown in the view, which keeps trying. `frames` bounds the loop
    (tests); otherwise it runs until Ctrl-C."""
    console = Console(file=out) if out is not None else Console()
    if not console.is_terminal:
        # a file or a pipe has no width of its own: wide enough that no column is cut
        console.width = PLAIN_WIDTH
    try:
        target = status_url(url)
        status = fetch(target)
    except TopError as err:
        print(f"vgpu-agent top: {err}", file=sys.stderr)
        return 1
    if as_json:
        console.print_json(data=status) if console.is_terminal else console.out(
            json.dumps(status, indent=2), highlight=False
        )
        return 0
    if once:
        console.print(render(status))
        return 0
    shown = 0
    try:
        if console.is_terminal:
            with Live(render(status), console=console, auto_refresh=False) as live:
                while frames is None or shown < frames:
                    shown += 1
                    sleep(interval_s)
                    status, error = _refetch(fetch, target, status)
                    live.update(render(status, error), refresh=True)
        else:
            while True:
                console.print(render(status))
                shown += 1
                if frames is not None and shown >= frames:
                    break
                sleep(interval_s)
                status, error = _refetch(fetch, target, status)
                if error:
                    console.print(error, markup=False, highlight=False)
                console.print()
    except KeyboardInterrupt:
        pass
    return 0


def _refetch(
    fetch: Callable[[str], dict[str, Any]], url: str, last: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    try:
        return fetch(url), ""
    except TopError as err:
        return last, f"{err} (showing the last status)"

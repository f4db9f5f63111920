"""The Grafana dashboard queries only what the agent emits: every metric name, every label it
filters or groups by, every label its legends show."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest

from tests.fakes.promtext import samples
from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region
from vgpu_agent.gpu.model import GpuReadings
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics.collectors import AgentInstruments, render_exposition, take_snapshot
from vgpu_agent.metrics.poller import GpuSample, RegionCache
from vgpu_agent.metrics.sources import MetricsSources

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "dashboards"
GPUS = build_inventory("2xA100-80GB")
SERIES_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
METRIC = re.compile(r"\b(vgpu_[a-z0-9_]+)")
SELECTOR = re.compile(r"\b(vgpu_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


@dataclass
class Status:
    measured_util: float | None = 40.0
    rate: int = 1000
    open_loop: bool = False
    paused: bool = False


@dataclass
class Registration:
    registered: bool = True
    registrations: int = 1
    kubelet_restarts: int = 1
    last_error: str = ""


@dataclass
class Tasks:
    running: set[str]
    restarts: dict[str, int]
    loop_heartbeat: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=lambda: {"throttle": 1.5})


async def _everything_emitted(tmp_path: Path) -> dict[str, set[str]]:
    """Sample name -> label names, from a node where every source has something to say."""
    uuid = GPUS[0].uuid
    directory = make_region(tmp_path, "a", [DeviceSpec(uuid, 1 << 30, 50)], [f"{uuid}::0"])
    shim = ShimWriter(directory)
    shim.process(0, 1, 101, 0, memory=1 << 20, launches=3, wait_ns=10, last_launch_ns=1)
    shim.close()
    cache = RegionCache(lambda: [FileRegion(directory)])
    await cache.refresh()
    sources = MetricsSources(
        node="n",
        gpus=lambda: GPUS,
        slices_per_gpu=2,
        regions=lambda: [],
        identity=lambda alloc_id: ("ns", "pod", "ctr"),
        healthy=lambda: {g.uuid: True for g in GPUS},
        xid_counts=lambda: {uuid: 1},
        throttle_status=lambda: {("a", 0): Status()},
        time_sliced_gpus=lambda: {uuid},
        use_only_strangers_gpus=lambda: {uuid},
        phase_changes=lambda: {uuid: 1},
        use_charged_to_nobody=lambda: {uuid: 12.5},
        solo_turns=lambda: {uuid: 1},
        nvml_utilization_calls=lambda: {uuid: (3, 0.0066)},
        throttle_ticks=lambda: 10,
        registration=lambda: Registration(),
        nvml_errors=lambda: {"nvmlDeviceGetPowerUsage": 1},
        region_events=lambda: {"created": 1},
        pod_resources_failures=lambda: 1,
        tasks=lambda: Tasks({"health"}, {"health": 1}),
        policy_source=lambda alloc_id: "pod",
    )
    readings = {g.uuid: GpuSample(GpuReadings(1, 0.5, 40.0, 100.0), False) for g in GPUS}
    instruments = AgentInstruments("n")
    instruments.on_result("ok", 0.01)
    snap = take_snapshot(sources, readings, cache.samples)
    text = render_exposition(snap, instruments, True, generate_latest, False).decode()
    emitted: dict[str, set[str]] = {}
    for name, labels in samples(text):
        emitted.setdefault(name, set()).update(key for key, _ in labels)
    return emitted


def _expressions(dashboard: dict) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    """(PromQL, legend format) of every panel target and template variable."""
    found: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            found.append((variable["definition"], ""))
            found.append((variable["query"]["query"], ""))
    return found


def _dashboards() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def test_there_is_a_dashboard() -> None:
    assert _dashboards(), f"no dashboard JSON under {DASHBOARDS}"


@pytest.mark.parametrize("path", _dashboards(), ids=lambda p: p.name)
async def test_dashboard_uses_only_emitted_metrics_and_labels(path: Path, tmp_path: Path) -> None:
    emitted = await _everything_emitted(tmp_path)
    dashboard = json.loads(path.read_text())
    expressions = _expressions(dashboard)
    assert expressions, "the dashboard has no queries"
    problems: list[str] = []
    for expr, legend in expressions:
        names = METRIC.findall(expr)
        if not names:
            problems.append(f"{expr!r} queries no vgpu_ metric")
        labels: set[str] = set(SERIES_LABELS)
        for name in names:
            if name not in emitted:
                problems.append(f"{expr!r} uses {name}, which the agent does not emit")
            else:
                labels |= emitted[name]
        for name, matchers in SELECTOR.findall(expr):
            for label in MATCHER.findall(matchers):
                if label not in emitted.get(name, set()) | SERIES_LABELS:
                    problems.append(f"{expr!r} filters {name} on label {label!r} it lacks")
        grouped: set[str] = set()
        dropped: set[str] = set()
        for keyword, group in GROUPING.findall(expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                (grouped if keyword == "by" else dropped).add(label)
                if label != "le" and label not in labels:
                    problems.append(f"{expr!r} groups by {label!r}, which no series has")
        # `by` keeps only its labels; `without` keeps every label but its own
        shown = grouped if grouped else labels - dropped
        for label in LEGEND.findall(legend):
            if label not in shown:
                problems.append(f"legend {legend!r} of {expr!r} shows missing label {label!r}")
    assert not problems, "\n".join(problems)


def test_checker_notices_a_metric_the_agent_does_not_emit() -> None:
    # the patterns above must see names inside functions, selectors and groupings
    expr = 'sum by (pod) (rate(vgpu_nonexistent_total{pod=~"$pod"}[5m]))'
    assert METRIC.findall(expr) == ["vgpu_nonexistent_total"]
    assert SELECTOR.findall(expr) == [("vgpu_nonexistent_total", 'pod=~"$pod"')]
    assert GROUPING.findall(expr) == [("by", "pod")]
    assert GROUPING.findall("sum without (kind) (vgpu_x)") == [("without", "kind")]

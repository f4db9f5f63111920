"""`/status` and `vgpu-agent top` against `vgpu-agent simulate` started as a user starts it: the
document agrees with `/metrics`, `top --once` shows every demo container, and simulate run in a
terminal (tmux) shows the live view with each container's limit and a measured share near it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fakes.promtext import series, value
from tests.integration.test_prometheus_scrape import free_port
from tests.integration.test_prometheus_simulate import simulated_agent  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

# the demo's containers and the share each is given (see vgpu_agent/simulate.py)
DEMO_LIMITS = {
    "demo/spread-pod/main": 25.0,
    "demo/binpack-pod/main": 50.0,
    "demo/inference/server": 25.0,
    "demo/batch/train": 25.0,
}


def _share_fits(name: str, measured: float, limit: float) -> bool:
    """The sample pods are always busy and held at their limits; the inference service is idle
    and busy in turns (never above its limit, strict), and the work-conserving batch job beside
    it borrows what the service leaves (never below its limit)."""
    if name == "demo/batch/train":
        return measured >= limit - 5.0
    if name == "demo/inference/server":
        return measured <= limit + 5.0
    return abs(measured - limit) <= 5.0


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _agent_argv() -> list[str]:
    command = shutil.which("vgpu-agent")
    return [command] if command else [sys.executable, "-m", "vgpu_agent.cli"]


def test_status_of_a_running_agent_agrees_with_its_metrics(simulated_agent: int) -> None:  # noqa: F811
    base = f"http://127.0.0.1:{simulated_agent}"
    deadline = time.monotonic() + 30
    while True:  # the demo allocates once the agent is ready, PodResources names the pods later
        status = json.loads(_get(base + "/status"))
        named = [a for a in status["allocations"] if a["pod"] is not None]
        # then the pair's annotations are applied, and the region cache reads them again
        # (each pod's at its own moment: wait for both the inference pod's and batch's)
        chosen = [a for a in named if a["policy_source"] == "pod" and a["pod"] != "batch"]
        batch = [a["devices"][0]["policy"] for a in named if a["pod"] == "batch"]
        if (len(named), [a["priority"] for a in chosen], batch) == (
            4, [50], ["work-conserving"]
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    metrics = _get(base + "/metrics").decode()

    assert status["schema_version"] == 1 and status["node"] == "sim-node"
    assert status["registered"] is True
    assert len(status["gpus"]) == 3
    for gpu in status["gpus"]:
        labels = {"gpu_uuid": gpu["uuid"]}
        assert gpu["memory_total_bytes"] == value(metrics, "vgpu_gpu_memory_total_bytes", **labels)
        assert gpu["slices_total"] == value(metrics, "vgpu_gpu_slices", **labels)
        assert gpu["slices_allocated"] == value(metrics, "vgpu_gpu_slices_allocated", **labels)
        assert gpu["healthy"] is True
    pods = sorted(a["pod"] for a in status["allocations"])
    assert pods == ["batch", "binpack-pod", "inference", "spread-pod"]
    by_pod = {a["pod"]: a for a in status["allocations"]}
    # the pair's policy and priority are their pods' choice (annotations), the others the node's
    assert (by_pod["inference"]["priority"], by_pod["inference"]["policy_source"]) == (50, "pod")
    assert by_pod["batch"]["devices"][0]["policy"] == "work-conserving"
    assert by_pod["spread-pod"]["policy_source"] == "default"
    for allocation in status["allocations"]:
        assert allocation["state"] == "active"
        for device in allocation["devices"]:
            labels = {"pod": allocation["pod"], "gpu_uuid": device["gpu_uuid"]}
            for key, name in (
                ("memory_limit_bytes", "vgpu_container_memory_limit_bytes"),
                ("core_limit_ratio", "vgpu_container_core_limit_ratio"),
            ):
                assert device[key] == value(metrics, name, **labels), key
            # live figures move between the two requests: close, not equal
            # the metric splits the total by kind; /status gives the total
            kinds = [v for lab, v in series(metrics, "vgpu_container_memory_used_bytes")
                     if labels.items() <= lab.items()]
            used = sum(kinds)
            assert len(kinds) == 4 and abs(device["memory_used_bytes"] - used) <= 0.05 * used
            assert device["policy"] in ("strict", "work-conserving", "off")


def test_top_once_shows_every_demo_container(simulated_agent: int) -> None:  # noqa: F811
    deadline = time.monotonic() + 30
    while True:
        result = subprocess.run(
            [*_agent_argv(), "top", "--once", "--url", f"127.0.0.1:{simulated_agent}"],
            capture_output=True, text=True, timeout=30,
        )
        if all(name in result.stdout for name in DEMO_LIMITS) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout  # not a terminal: plain text
    assert result.stdout.count("GPU ") >= 3
    for name in DEMO_LIMITS:
        assert name in result.stdout


@pytest.fixture
def tmux() -> str:
    path = shutil.which("tmux")
    if path is None:
        pytest.fail("tmux is not installed: scripts/install-tools installs it")
    return path


def _rows(screen: str) -> dict[str, list[tuple[float, float]]]:
    """(measured, limit) per container row of the view."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for line in screen.splitlines():
        match = re.match(r"[\s!]*(demo/\S+)\s.*?(\d+\.\d)%\s+(\d+\.\d)%\s+(\d+\.\d)%", line)
        if match:
            measured, limit = float(match.group(2)), float(match.group(3))
            rows.setdefault(match.group(1), []).append((measured, limit))
    return rows


def test_simulate_in_a_terminal_shows_the_live_view(tmux: str, tmp_path: Path) -> None:
    session = f"vgpu-top-{free_port()}"
    port = free_port()
    command = " ".join(
        [*_agent_argv(), "simulate", "--duration", "40", "--metrics-address", f"127.0.0.1:{port}"]
    )
    # a server of its own (-L), without anyone's configuration: the size is the one asked for
    tmux_cmd = [tmux, "-L", session, "-f", "/dev/null"]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    subprocess.run(
        [*tmux_cmd, "new-session", "-d", "-s", session, "-x", "160", "-y", "50",
         f"cd {tmp_path} && {command}; sleep 60"],
        check=True, env=env,
    )
    try:
        deadline = time.monotonic() + 45
        screen, rows = "", {}
        while time.monotonic() < deadline:
            time.sleep(1.0)
            screen = subprocess.run(
                [*tmux_cmd, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            rows = _rows(screen)
            settled = set(rows) == set(DEMO_LIMITS) and all(
                _share_fits(name, measured, limit) for name, entries in rows.items()
                for measured, limit in entries
            )
            if settled:
                break
        assert set(rows) == set(DEMO_LIMITS), screen
        for name, entries in rows.items():
            for measured, limit in entries:
                assert limit == DEMO_LIMITS[name], screen
                assert _share_fits(name, measured, limit), screen
        # the spread pod's two slices are on two GPUs: one row on each
        assert len(rows["demo/spread-pod/main"]) == 2, screen
        assert "demo_share" not in screen  # the share log lines went to the log file
        log_line = next(line for line in screen.splitlines() if line.startswith("log: "))
        assert Path(log_line.removeprefix("log: ").strip()).exists()
    finally:
        subprocess.run([*tmux_cmd, "kill-server"], capture_output=True)

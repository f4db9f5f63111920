"""`vgpu-agent simulate`, started as a user starts it, scraped by a real Prometheus every second:
per-container series with the right labels and plausible values, and an exposition that
`promtool check metrics` accepts."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.test_prometheus_scrape import (  # noqa: F401 - fixtures
    Prometheus,
    free_port,
    prometheus_factory,
    prometheus_tools,
)

pytestmark = pytest.mark.slow


def _wait_http(url: str, process: subprocess.Popen[bytes], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"vgpu-agent simulate exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {limit_s} s")


@pytest.fixture
def simulated_agent(tmp_path: Path) -> Iterator[int]:
    """`vgpu-agent simulate` in a subprocess with its metrics on a free loopback port."""
    port = free_port()
    command = shutil.which("vgpu-agent")
    argv = [command] if command else [sys.executable, "-m", "vgpu_agent.cli"]
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [*argv, "simulate", "--duration", "60", "--metrics-address", f"127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    try:
        # ready = registered with the (stand-in) kubelet and the GPU backend up; a 503 retries
        _wait_http(f"http://127.0.0.1:{port}/readyz", process)
        yield port
    except AssertionError:
        log.flush()
        print((tmp_path / "agent.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_prometheus_scrapes_vgpu_agent_simulate(
    simulated_agent: int,
    prometheus_factory: Callable[[str], Prometheus],  # noqa: F811 - imported fixture
    prometheus_tools: tuple[str, str],  # noqa: F811 - imported fixture
) -> None:
    prometheus = prometheus_factory(f"127.0.0.1:{simulated_agent}")
    prometheus.wait_scrapes(2)

    gpus = prometheus.query("vgpu_gpu_memory_total_bytes")
    assert len(gpus) == 3  # simulate's default inventory: 2xA100-80GB,1xL4-24GB
    by_model = sorted((g["metric"]["model"], float(g["value"][1])) for g in gpus)
    assert [m for m, _ in by_model] == ["NVIDIA A100-80GB", "NVIDIA A100-80GB", "NVIDIA L4-24GB"]
    assert all(g["metric"]["node"] == "sim-node" for g in gpus)
    gpu_memory = {g["metric"]["gpu_uuid"]: float(g["value"][1]) for g in gpus}

    limits = prometheus.query("vgpu_container_memory_limit_bytes")
    assert limits, "no per-container series"
    for series in limits:
        labels = series["metric"]
        for name in ("namespace", "pod", "container", "gpu_uuid", "gpu_index", "job"):
            assert labels.get(name), f"{name} missing or empty in {labels}"
        assert 0 < float(series["value"][1]) <= gpu_memory[labels["gpu_uuid"]]
    core = prometheus.query("vgpu_container_core_limit_ratio")
    assert len(core) == len(limits)
    assert all(0 < float(s["value"][1]) <= 1 for s in core)
    used = prometheus.query("vgpu_container_memory_used_bytes")
    assert all(0 <= float(s["value"][1]) <= gpu_memory[s["metric"]["gpu_uuid"]] for s in used)
    launches = prometheus.query("vgpu_container_kernel_launches_total")
    assert any(float(s["value"][1]) > 0 for s in launches), "the demo workloads never launched"
    ratios = prometheus.query("vgpu_container_core_utilization_ratio")
    assert all(0 <= float(s["value"][1]) <= 1 for s in ratios)
    slices = prometheus.query("sum(vgpu_gpu_slices_allocated)")
    assert slices and float(slices[0]["value"][1]) >= 1
    registered = prometheus.query("vgpu_plugin_registered")
    assert [float(s["value"][1]) for s in registered] == [1.0]
    # what the throttle's ticks and NVML samples cost the node, visible beside its CPU
    ticks = prometheus.query("vgpu_throttle_ticks_total")
    assert len(ticks) == 1 and float(ticks[0]["value"][1]) > 0
    calls = prometheus.query("vgpu_gpu_nvml_process_utilization_calls_total")
    assert {c["metric"]["gpu_uuid"] for c in calls} == set(gpu_memory)
    assert any(float(c["value"][1]) > 0 for c in calls), "the throttle never asked NVML"
    seconds = prometheus.query("vgpu_gpu_nvml_process_utilization_call_seconds_total")
    assert all(float(c["value"][1]) >= 0 for c in seconds) and len(seconds) == len(calls)
    cpu = {c["metric"]["task"]: float(c["value"][1])
           for c in prometheus.query("vgpu_task_cpu_seconds_total")}
    assert {"throttle", "health", "metrics-caches"} <= cpu.keys() and cpu["throttle"] > 0

    with urllib.request.urlopen(f"http://127.0.0.1:{simulated_agent}/metrics", timeout=5) as r:
        body = r.read()
    check = subprocess.run(
        [prometheus_tools[1], "check", "metrics"], input=body, capture_output=True, timeout=30,
        check=False,
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{simulated_agent}/readyz", timeout=5) as r:
        assert r.status == 200

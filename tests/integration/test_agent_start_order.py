"""Start-up order: `Register` first, then the metrics endpoint, then the Kubernetes client; probes
still answer when there is no kubelet or no GPU, and a taken metrics port still stops the agent
before it registers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

import pytest
import structlog.testing

from tests.integration.plugin_harness import config_for, short_dir
from vgpu_agent import agent as agent_module
from vgpu_agent.agent import Agent
from vgpu_agent.gpu.model import GpuError
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.kubelet.standin import KubeletStandIn


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def sim_args(root) -> list[str]:
    return [
        "run", "--backend", "sim", "--sim-gpus", "1xA100-80GB", "--split-count", "2",
        "--device-plugin-dir", str(root / "dp"), "--state-dir", str(root / "state"),
        "--pod-resources-socket", str(root / "pr.sock"), "--metrics-address", "127.0.0.1:0",
        "--log-format", "json", "--log-level", "info",
    ]


async def test_register_comes_before_the_metrics_endpoint_and_the_kubernetes_client(root):
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"))
    await kubelet.start()
    env = {**os.environ, "NODE_NAME": "node-a", "KUBERNETES_SERVICE_HOST": "",
           "KUBECONFIG": str(root / "no-such-kubeconfig")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", *sim_args(root), env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    events: list[dict[str, object]] = []
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(60):
            while not any(str(e["event"]).startswith("kube_api") for e in events):
                line = await proc.stderr.readline()
                assert line, f"the agent exited: {events}"
                events.append(json.loads(line))
        names = [e["event"] for e in events]
        registered, serving = names.index("registered"), names.index("metrics_serving")
        kube = next(i for i, n in enumerate(names) if str(n).startswith("kube_api"))
        assert registered < serving < kube, names
        url = str(events[serving]["url"]).replace("/metrics", "/healthz")
        assert (await asyncio.to_thread(get, url))[0] == 200
        assert len(kubelet.registrations) == 1
    finally:
        proc.terminate()
        await proc.wait()
        await kubelet.stop()


async def test_probes_answer_without_a_kubelet(root):
    agent = Agent(config_for(root))  # the plugin dir exists, the kubelet socket never appears
    os.makedirs(root / "dp")
    task = asyncio.create_task(agent.run())
    try:
        started = time.monotonic()
        await asyncio.wait_for(agent.serving.wait(), 20)
        assert time.monotonic() - started < agent_module.METRICS_START_LATEST_S + 10
        base = agent.metrics.url.removesuffix("/metrics")
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
        status, body = await asyncio.to_thread(get, base + "/readyz")
        assert status == 503 and "not registered" in body
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)


class NeverStarts(SimBackend):
    def start(self) -> None:
        raise GpuError("driver not loaded", call="nvmlInit")


async def test_a_failing_gpu_backend_brings_the_probes_up_at_once(root, monkeypatch):
    # with no cap to speak of, only the first failure can start the endpoint
    monkeypatch.setattr(agent_module, "METRICS_START_LATEST_S", 3600.0)
    os.makedirs(root / "dp")
    agent = Agent(config_for(root), backend=NeverStarts("1xA100-80GB"))
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.serving.wait(), 20)
        base = agent.metrics.url.removesuffix("/metrics")
        status, body = await asyncio.to_thread(get, base + "/readyz")
        assert status == 503 and "driver not loaded" in body
        assert (await asyncio.to_thread(get, base + "/healthz"))[0] == 200
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)


async def test_the_metrics_endpoint_does_not_exist_before_it_serves(root):
    agent = Agent(config_for(root))
    with pytest.raises(RuntimeError, match="not started yet"):
        _ = agent.metrics


async def test_allocate_results_before_the_endpoint_are_counted(root):
    agent = Agent(config_for(root))
    # what the servicer reports for Allocates answered between Register and the endpoint
    agent._on_result("ok", 0.002)
    agent._on_result("ok", 0.003)
    agent._on_result("error", 0.001)
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"), str(root / "pr" / "kubelet.sock"))
    await kubelet.start()
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.serving.wait(), 20)
        text = (await asyncio.to_thread(get, agent.metrics.url))[1]
        counted = {
            line.split('result="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vgpu_allocate_requests_total{")
        }
        assert counted.get("ok") == 2 and counted.get("error") == 1, counted
        assert "vgpu_allocate_duration_seconds_count" in text
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await kubelet.stop()


async def test_a_taken_metrics_port_stops_the_agent_before_it_registers(root):
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"))
    await kubelet.start()
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            args = sim_args(root)
            args[args.index("--metrics-address") + 1] = f"127.0.0.1:{port}"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "vgpu_agent.cli", *args, stderr=asyncio.subprocess.PIPE
            )
            _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}" in stderr.decode()
        assert kubelet.registrations == []
    finally:
        await kubelet.stop()


async def test_a_stop_right_at_register_shuts_down_cleanly(root):
    # the stop and the start of the metrics endpoint are due in the same moment: nothing may
    # go on starting tasks in a task group that is shutting down
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"), str(root / "pr" / "kubelet.sock"))
    await kubelet.start()
    try:
        for _ in range(3):
            agent = Agent(config_for(root))
            with structlog.testing.capture_logs() as logs:
                task = asyncio.create_task(agent.run())
                async with asyncio.timeout(20):
                    while agent.runner is None:
                        await asyncio.sleep(0.001)
                agent.runner.status.listeners.append(agent.stop)  # after the agent's own
                await asyncio.wait_for(task, 20)
            failed = [e for e in logs if e["log_level"] == "error"]
            assert failed == [], failed
            assert agent.runner.status.registrations == 1
    finally:
        await kubelet.stop()

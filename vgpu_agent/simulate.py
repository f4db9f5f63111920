"""`vgpu-agent simulate`: the whole agent on simulated GPUs, with an in-process kubelet stand-in.

It shows, in readable log lines, the registration, the advertised devices and one sample
allocation per policy, then keeps running (until Ctrl-C or `--duration`). With `view` (the
default when stdout is a terminal) the log goes to a file and the terminal shows the live
`vgpu-agent top` view of the agent's own status instead of the share log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import TextIO

import structlog

from vgpu_agent.agent import Agent
from vgpu_agent.config import Config
from vgpu_agent.deviceplugin.allocation import preferred_allocation
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.kubelet.standin import Admission, KubeletStandIn
from vgpu_agent.simulation.demo import run_demo_workloads

log = structlog.get_logger("vgpu_agent.simulate")

DEMO_NAMESPACE = "demo"
SIM_ROOT_PREFIX = "vgpu-agent-sim-"


def simulate_defaults() -> dict[str, object]:
    """Defaults for simulate: simulated GPUs, a fresh temporary root, loopback metrics."""
    root = tempfile.mkdtemp(prefix=SIM_ROOT_PREFIX)
    return {
        "backend": "sim",
        "sim_gpus": "2xA100-80GB,1xL4-24GB",
        "device_plugin_dir": os.path.join(root, "device-plugins"),
        "pod_resources_socket": os.path.join(root, "pod-resources", "kubelet.sock"),
        "state_dir": os.path.join(root, "state"),
        "metrics_address": "127.0.0.1:9394",
        "log_format": "console",
        "node_name": "sim-node",
    }


async def simulate(config: Config, duration: float = 0.0, view: bool = False) -> int:
    log_file = _log_to_file(config) if view else None
    kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
    await kubelet.start()
    agent = Agent(config)
    agent_task = asyncio.create_task(agent.run(), name="agent")
    demo: asyncio.Task[object] | None = None
    view_task: asyncio.Task[None] | None = None
    try:
        resource = config.resource_name
        await kubelet.wait_for(
            lambda: bool(kubelet.registrations) and bool(_devices(kubelet, resource)), limit_s=30
        )
        reg = kubelet.registrations[-1]
        log.info(
            "kubelet_saw_registration",
            resource=reg.resource_name,
            endpoint=reg.endpoint,
            preferred_allocation=reg.options.get_preferred_allocation_available,
        )
        devices = _devices(kubelet, resource)
        log.info("kubelet_saw_devices", count=len(devices), first=devices[:3], last=devices[-1])
        for policy in ("spread", "binpack"):
            admission = await _sample_allocation(kubelet, resource, policy)
            log.info(
                "sample_allocation",
                policy=policy,
                pod=f"{admission.namespace}/{admission.pod}",
                device_ids=admission.device_ids,
                envs=dict(sorted(admission.response.envs.items())),
                mounts=[m.container_path for m in admission.response.mounts],
            )
        # The simulated containers play the shim on the allocations' real region files and
        # feed the simulated GPU's per-process samples to the agent's own controller.
        demo = asyncio.create_task(
            run_demo_workloads(
                agent.regions.regions,
                agent.backend if isinstance(agent.backend, SimBackend) else None,
                controller_status=lambda: agent.controller.status,
                report_every_s=5.0,
            ),
            name="demo-workloads",
        )
        log.info("metrics_url", url=agent.metrics.url)
        print(f"metrics: {agent.metrics.url}  (Ctrl-C to stop)", flush=True)
        if log_file is not None:
            print(f"log: {log_file.name}", flush=True)
            view_task = asyncio.create_task(_live_view(agent), name="live-view")
        if duration > 0:
            await asyncio.wait({agent_task}, timeout=duration)
        else:
            await agent_task
    finally:
        for task in (view_task, demo):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        agent.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await agent_task
        await kubelet.stop()
        _remove_own_root(config)
        if log_file is not None:
            log_file.close()
    return 0


def _log_to_file(config: Config) -> TextIO:
    """Send the log to a file that outlives the run, so the terminal can show the view."""
    from vgpu_agent.logging import configure

    fd, path = tempfile.mkstemp(prefix="vgpu-agent-simulate-", suffix=".log")
    os.close(fd)
    handle = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the run
    configure(config.log_format, config.log_level, stream=handle)
    return handle


async def _live_view(agent: Agent, interval_s: float = 1.0) -> None:
    """The `top` view of the agent's own status, refreshed every `interval_s`, on stdout."""
    from rich.console import Console
    from rich.live import Live

    from vgpu_agent.top import render

    console = Console(file=sys.stdout)
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            try:
                status = json.loads(await agent.metrics.status())
            except Exception as err:  # the view must never stop the demo
                log.warning("live_view_failed", error=repr(err))
            else:
                live.update(render(status), refresh=True)
            await asyncio.sleep(interval_s)


def _remove_own_root(config: Config) -> None:
    """Remove the temporary root `simulate_defaults` made (never a directory the user chose)."""
    root = os.path.dirname(config.state_dir)
    inside = all(
        os.path.dirname(p) == root
        for p in (config.device_plugin_dir, os.path.dirname(config.pod_resources_socket))
    )
    if inside and os.path.basename(root).startswith(SIM_ROOT_PREFIX):
        shutil.rmtree(root, ignore_errors=True)


def _devices(kubelet: KubeletStandIn, resource: str) -> list[str]:
    state = kubelet.resources.get(resource)
    return sorted(state.devices) if state else []


async def _sample_allocation(kubelet: KubeletStandIn, resource: str, policy: str) -> Admission:
    """Choose two slices by `policy` among the free ones and allocate them for a demo pod."""
    free = kubelet.free_devices(resource)
    chosen = preferred_allocation(free, [], 2, "spread" if policy == "spread" else "binpack")
    response = await kubelet.allocate(resource, chosen)
    admission = Admission(DEMO_NAMESPACE, f"{policy}-pod", "main", resource, chosen, response)
    kubelet.admissions.append(admission)
    return admission

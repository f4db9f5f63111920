"""`vgpu-agent simulate`: the whole agent on simulated GPUs, with an in-process kubelet stand-in.

It shows, in readable log lines, the registration, the advertised devices and one sample
allocation per policy, then keeps running (until Ctrl-C or `--duration`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile

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


async def simulate(config: Config, duration: float = 0.0) -> int:
    kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
    await kubelet.start()
    agent = Agent(config)
    agent_task = asyncio.create_task(agent.run(), name="agent")
    demo: asyncio.Task[object] | None = None
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
        if duration > 0:
            await asyncio.wait({agent_task}, timeout=duration)
        else:
            await agent_task
    finally:
        if demo is not None:
            demo.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await demo
        agent.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await agent_task
        await kubelet.stop()
        _remove_own_root(config)
    return 0


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

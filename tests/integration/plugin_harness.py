"""Shared set-up for device-plugin tests: short socket paths, a stand-in kubelet, the agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from vgpu_agent.agent import Agent
from vgpu_agent.config import Config
from vgpu_agent.kubelet.standin import KubeletStandIn

RESOURCE = "nvidia.com/gpu"


@contextlib.contextmanager
def short_dir():
    """A directory under /tmp with a short path: unix socket paths must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="vg-", dir="/tmp")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def until(predicate, within: float = 10.0) -> None:
    """Wait until `predicate()` holds; the agent's periodic work has its own pace, not the test's."""
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.05)


def config_for(root: Path, **overrides: object) -> Config:
    values: dict[str, object] = {
        "backend": "sim",
        "sim_gpus": "2xA100-80GB,1xL4-24GB",
        "device_plugin_dir": str(root / "dp"),
        "pod_resources_socket": str(root / "pr" / "kubelet.sock"),
        "state_dir": str(root / "state"),
        "metrics_address": "127.0.0.1:0",
        "split_count": 4,
        "health_recovery_seconds": 0.5,
        "health_check_seconds": 0.1,
    }
    values.update(overrides)
    return Config(**values)  # type: ignore[arg-type]


@dataclass
class Running:
    agent: Agent
    kubelet: KubeletStandIn
    task: asyncio.Task[None]

    def devices(self) -> dict[str, str]:
        state = self.kubelet.resources.get(RESOURCE)
        return dict(state.devices) if state else {}


@contextlib.asynccontextmanager
async def running_agent(config: Config, **agent_args: object) -> AsyncIterator[Running]:
    os.makedirs(config.device_plugin_dir, exist_ok=True)
    kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
    await kubelet.start()
    agent = Agent(config, **agent_args)  # type: ignore[arg-type]
    task = asyncio.create_task(agent.run())
    running = Running(agent, kubelet, task)
    try:
        await kubelet.wait_for(lambda: bool(running.devices()), limit_s=20)
        await asyncio.wait_for(agent.serving.wait(), 20)  # the metrics endpoint comes after
        yield running
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await kubelet.stop()

"""A container that spills GPU memory to host memory: one event on its pod, through the API.

The agent reads its regions' `state` for spilled bytes, and tells each container once, when its
region is bound to it. The Kubernetes API is the fake one (`tests/fakes/kubeapi.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config

from tests.fakes.kubeapi import NODE, FakeKubeAPI
from tests.fakes.shimstate import ShimWriter
from tests.integration.plugin_harness import config_for
from vgpu_agent.agent import Agent
from vgpu_agent.deviceplugin.allocation import grant
from vgpu_agent.kube.pods import NodePods
from vgpu_agent.kubelet.podresources import ContainerRef

GIB = 1 << 30


@contextlib.asynccontextmanager
async def agent_with_api(tmp_path: Path) -> AsyncIterator[tuple[Agent, FakeKubeAPI]]:
    api = FakeKubeAPI()
    await api.start()
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=configuration,
    )

    async def source() -> client.Configuration:
        return configuration

    settings = config_for(tmp_path, memory_scaling=2.0, memory_oversubscription="spill")
    agent = Agent(settings, host_memory=lambda: 1 << 50)
    agent.backend.start()
    agent.inventory = agent.backend.discover()
    pods = NodePods(NODE, source, request_timeout=0.5, backoff_initial=0.02, backoff_cap=0.1)
    agent.pods = pods
    task = asyncio.create_task(pods.run())
    try:
        yield agent, api
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        agent.regions.close()
        await api.stop()


def pod_events(api: FakeKubeAPI) -> list[dict[str, Any]]:
    return [e for e in api.all_events() if e["involvedObject"]["kind"] == "Pod"]


async def test_a_container_that_spills_gets_one_event_on_its_pod(tmp_path: Path) -> None:
    async with agent_with_api(tmp_path) as (agent, api):
        assert agent.inventory is not None
        gpu = agent.inventory.gpus[1]
        pod = api.add_pod("trainer", "ml", containers=("main",))
        region = agent.regions.create(grant([f"{gpu.uuid}::0"], {gpu.uuid: gpu}, agent.split))
        shim = ShimWriter(region.path)
        shim.device_totals(0, memory=3 * GIB)
        shim.memory_kinds(0, spilled=GIB + GIB // 2)
        shim.close()
        # not bound to a container yet: nobody to tell, and it stays watched
        assert await asyncio.to_thread(agent._spill_notices) == []
        await agent.regions.reconcile({f"{gpu.uuid}::0": ContainerRef("ml", "trainer", "main")})
        async with asyncio.timeout(5):
            while agent.pods is not None and agent.pods.pod("ml", "trainer") is None:
                await asyncio.sleep(0.02)
        (notice,) = await asyncio.to_thread(agent._spill_notices)
        agent._report_spill(notice)
        await api.wait_for(lambda: len(pod_events(api)) == 1)
        # spilling more later is not news
        assert await asyncio.to_thread(agent._spill_notices) == []
        await asyncio.sleep(0.2)
        (event,) = pod_events(api)
        assert event["reason"] == "VgpuMemorySpilled" and event["type"] == "Normal"
        assert event["metadata"]["namespace"] == "ml"
        assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]
        message = event["message"]
        assert "container main" in message
        assert f"1536.0 MiB on GPU {gpu.index} ({gpu.uuid})" in message
        assert f"limit {region.memory_limit(0) >> 20} MiB" in message
        assert "host memory" in message


async def test_the_spill_limit_is_checked_against_host_memory_at_start(tmp_path: Path) -> None:
    settings = config_for(tmp_path, memory_scaling=2.0, memory_oversubscription="spill",
                          spill_host_memory_fraction=0.25)
    backend = Agent(settings).backend
    backend.start()
    gpus = list(backend.discover().gpus)
    promised = sum(2 * g.memory_total for g in gpus)
    Agent(settings, host_memory=lambda: 4 * promised)._check_spill(gpus)  # exactly the share
    refused = Agent(settings, host_memory=lambda: 4 * promised - 4)
    try:
        refused._check_spill(gpus)
    except ValueError as err:
        assert "memory_oversubscription='spill'" in str(err)
        assert "spill_host_memory_fraction (now 0.25)" in str(err)
    else:
        raise AssertionError("spilling past the host's share was accepted")


async def test_the_agent_process_refuses_spill_past_host_memory_with_exit_2(tmp_path: Path) -> None:
    import os
    import sys

    # 8 cards of 80 GiB scaled 10 times: 6.25 TiB, more than 1 % of any host
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", "run", "--backend", "sim",
        "--sim-gpus", "8xA100-80GB", "--memory-scaling", "10",
        "--memory-oversubscription", "spill", "--spill-host-memory-fraction", "0.01", "--device-plugin-dir", str(tmp_path / "dp"),
        "--state-dir", str(tmp_path / "state"), "--metrics-address", "127.0.0.1:0",
        env={**os.environ, "VGPU_AGENT_NODE_NAME": ""},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    text = stderr.decode()
    assert proc.returncode == 2, text
    assert "invalid configuration: memory_oversubscription='spill'" in text
    assert "more than 0.01 of host memory" in text
    assert not (tmp_path / "dp" / "vgpu-agent.sock").exists()

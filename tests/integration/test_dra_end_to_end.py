"""DRA mode, the whole path: the agent publishes its ResourceSlice to the fake API server, the
test allocator allocates claims from it as the scheduler would, the kubelet DRA stand-in prepares
them through the registered driver, the regions carry exactly the claims' grants, the CDI specs
carry the shim's variables, the throttle controller steers the regions, the metrics name the
containers (from PodResources' dynamic resources) and their claims, and unprepare removes it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.dra_allocator import allocate_in
from tests.fakes.kubeapi import FakeKubeAPI
from tests.integration.plugin_harness import config_for, short_dir
from vgpu_agent.agent import Agent
from vgpu_agent.dra import cdi
from vgpu_agent.kubelet.drastandin import DraKubeletStandIn
from vgpu_agent.kubelet.standin import KubeletStandIn
from vgpu_agent.simulate import simulate_defaults
from vgpu_agent.simulation.demo import run_demo_workloads

DRIVER = "gpu.vgpu.io"
NODE = "gpu-node-1"
NS = "team-a"
GIB = 1 << 30


def claim_body(name: str, capacity: dict[str, str] | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"metadata": {"name": name}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": exactly}]}}}  # fmt: skip


@dataclass
class Cluster:
    root: Path
    api: FakeKubeAPI
    agent: Agent
    kubelet: KubeletStandIn
    dra: DraKubeletStandIn

    def claim(self, name: str, capacity: dict[str, str] | None = None) -> tuple[str, str, str]:
        created = self.api.resources.create("resourceclaims", NS, claim_body(name, capacity))
        allocated = allocate_in(self.api.resources, NS, name, NODE)
        assert allocated["status"]["allocation"]
        return NS, name, created["metadata"]["uid"]


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    with short_dir() as root:
        api = FakeKubeAPI(token=None)
        await api.start()
        api.add_node(NODE)
        api.resources.create(
            "deviceclasses",
            "",
            {
                "metadata": {"name": DRIVER},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
            },
        )
        config = config_for(
            root,
            mode="dra",
            node_name=NODE,
            kubeconfig=str(api.write_kubeconfig(root / "kubeconfig")),
            plugin_registry_dir=str(root / "registry"),
            dra_plugin_dir=str(root / "plugins"),
            cdi_dir=str(root / "cdi"),
            sim_gpus="2xA100-80GB",
            pod_resources_refresh_seconds=0.2,
        )
        kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
        await kubelet.start()
        dra = DraKubeletStandIn(str(root / "registry"), str(root / "plugins"), kubelet=kubelet)
        await dra.start()
        agent = Agent(config)
        task = asyncio.create_task(agent.run())
        try:
            await dra.wait_registered(DRIVER, limit_s=20)
            await asyncio.wait_for(agent.serving.wait(), 20)
            for _ in range(400):
                if api.resources.slices(NODE, DRIVER):
                    break
                await asyncio.sleep(0.05)
            yield Cluster(root, api, agent, kubelet, dra)
        finally:
            agent.stop()
            await asyncio.wait_for(task, 10)
            await dra.stop()
            await kubelet.stop()
            await api.stop()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


async def test_publish_allocate_prepare_enforce_measure_unprepare():
    async with cluster() as c:
        (published,) = c.api.resources.slices(NODE, DRIVER)
        assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        # the pod asks for a policy by annotation: a claim's region follows its claim instead
        c.api.add_pod("train-pod", NS, NODE, {"vgpu.io/core-policy": "work-conserving"})
        sized = c.claim("train", {"memory": "10Gi", "cores": "30"})
        default = c.claim("infer")  # one default share: what a device-plugin slice is worth
        claims = {"train": sized, "infer": default}
        for pod, claim in claims.items():
            await c.dra.start_container(NS, f"{pod}-pod", "main", DRIVER, [claim])

        prepared = c.agent.dra.driver.prepared
        regions = {
            pod: c.agent.regions.get(prepared[claim[2]].alloc_id) for pod, claim in claims.items()
        }
        train, infer = regions["train"], regions["infer"]
        assert train.memory_limit(0) == 10 * GIB
        assert train.core_limit(0) == pytest.approx(30.0)
        assert infer.memory_limit(0) == 20 * GIB  # 80 GiB / K=4
        assert infer.core_limit(0) == pytest.approx(25.0)

        spec = json.loads((c.root / "cdi" / cdi.spec_name(DRIVER, sized[2])).read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["VGPU_MEMORY_LIMIT_0"] == "10240m" and env["VGPU_CORE_LIMIT_0"] == "30"
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"  # HAMi-core reads these too
        assert env["VGPU_REGION_DIR"] == "/run/vgpu"

        # simulated containers play the shim on the real region files; the agent's own
        # controller steers them to their grants
        demo = asyncio.create_task(
            run_demo_workloads(
                c.agent.regions.regions,
                c.agent.backend,
                controller_status=lambda: c.agent.controller.status,
                report_every_s=1.0,
                duration_s=5.0,
            )
        )
        shares = await demo
        by_limit = {round(s.limit): s for s in shares}
        assert set(by_limit) == {30, 25}
        for share in shares:
            assert share.share == pytest.approx(share.limit, abs=4), share
        status = c.agent.controller.status
        assert status[(train.alloc_id, 0)].measured_util is not None

        for _ in range(200):
            if c.agent.regions.identity(train.alloc_id) is not None:
                break
            await asyncio.sleep(0.05)
        body = await asyncio.to_thread(_scrape, c.agent.metrics.url)
        assert re.search(
            r'vgpu_container_memory_limit_bytes\{namespace="team-a",pod="train-pod",'
            r'container="main",[^}]*\} 10737418240\n',
            body,
        ), body
        assert (
            'vgpu_container_claim_info{namespace="team-a",pod="train-pod",container="main",'
            f'claim_namespace="team-a",claim_name="train",claim_uid="{sized[2]}"}} 1'
        ) in body
        assert f'vgpu_plugin_registered{{node="{NODE}"}} 1' in body  # the DRA registration
        assert train.policy(0) == "strict"  # the node default: the claim set no corePolicy
        assert re.search(
            r'vgpu_container_core_policy_info\{[^}]*pod="train-pod"[^}]*policy_source="claim"',
            body,
        ), body

        for pod, claim in claims.items():
            assert (await c.dra.remove_pod(NS, f"{pod}-pod", DRIVER, [claim])) == {claim[2]: ""}
        assert c.agent.regions.regions() == []
        assert not train.path.exists() and not infer.path.exists()
        assert list((c.root / "cdi").iterdir()) == []
        assert c.agent.dra.driver.prepared == {}


async def test_two_claims_overfilling_a_gpu_are_refused_at_prepare():
    async with cluster() as c:
        # (the agent holds a claim's own priority to its rules for pods: 100, no namespace)
        from vgpu_agent.dra.grant import ClaimPriorityBound

        assert c.agent.dra is not None
        assert c.agent.dra.driver.priority_bound == ClaimPriorityBound(100, frozenset())
        first = c.claim("big-1", {"memory": "60Gi", "cores": "10"})
        c.api.resources.create("resourceclaims", NS, claim_body("big-2", {"memory": "60Gi"}))

        # a stale allocation: written by hand onto the same device, as no scheduler would
        def stale(obj: dict[str, Any]) -> None:
            allocation = json.loads(json.dumps(c.api.resources.get("resourceclaims", "big-1", NS)))
            obj["status"] = allocation["status"]

        second = c.api.resources.edit("resourceclaims", "big-2", stale, NS, "status")
        ref2 = (NS, "big-2", second["metadata"]["uid"])
        results = await c.dra.prepare(DRIVER, [first, ref2])  # one call, the two in parallel
        errors = sorted((results[first[2]].error, results[ref2[2]].error))
        assert errors[0] == "" and "already hold" in errors[1]
        assert len(c.agent.regions.regions()) == 1
        # the refused claim is retried by the kubelet: still refused while the first is there
        loser = ref2 if results[ref2[2]].error else first
        winner = first if loser is ref2 else ref2
        assert "already hold" in (await c.dra.prepare(DRIVER, [loser]))[loser[2]].error
        assert (await c.dra.unprepare(DRIVER, [winner])) == {winner[2]: ""}
        assert (await c.dra.prepare(DRIVER, [loser]))[loser[2]].error == ""


async def test_simulate_dra_mode_prepares_both_demo_claims_and_cleans_up():
    from structlog.testing import capture_logs

    from vgpu_agent.config import ConfigSources, build_config
    from vgpu_agent.simulate import simulate

    defaults = simulate_defaults()
    config = build_config(
        ConfigSources(flags={**defaults, "mode": "dra", "metrics_address": "127.0.0.1:0"})
    )
    with capture_logs() as logs:
        assert await simulate(config, duration=3.0) == 0
    prepared = [e for e in logs if e["event"] == "sample_claim_prepared"]
    assert [e["claim"] for e in prepared] == ["demo/sized", "demo/default-share"]
    assert prepared[0]["consumed"] == {"memory": "10Gi", "cores": "30"}
    assert all(len(e["cdi_devices"][0]) == 2 for e in prepared)
    registered = [e for e in logs if e["event"] == "kubelet_saw_dra_driver"]
    assert registered and registered[0]["version"] == "v1.DRAPlugin"
    assert not Path(config.state_dir).parent.exists()  # its temporary root is gone

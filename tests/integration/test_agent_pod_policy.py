"""The whole agent: a container admitted by the kubelet stand-in gets its pod's annotated policy
and priority in its region, read from the fake API server, and /metrics says where they came from.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from tests.fakes.kubeapi import NODE, FakeKubeAPI
from tests.fakes.promtext import series
from tests.integration.plugin_harness import (
    RESOURCE,
    config_for,
    running_agent,
    short_dir,
    until,
)
from vgpu_agent.shm import layout


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


def metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


async def test_the_agent_applies_pod_annotations_and_reports_their_source(root: Path) -> None:
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    api.add_pod("llm", "prod", annotations={"vgpu.io/priority": "20"})
    api.add_pod("etl", "jobs", annotations={"vgpu.io/core-policy": "work-conserving",
                                            "vgpu.io/priority": "5"})
    config = config_for(
        root,
        node_name=NODE,
        kubeconfig=str(api.write_kubeconfig(root / "kubeconfig")),
        pod_priority_namespaces=("prod",),
        pod_resources_refresh_seconds=0.2,
    )
    try:
        async with running_agent(config) as run:
            await run.kubelet.admit("prod", "llm", "main", RESOURCE, 1)
            await run.kubelet.admit("jobs", "etl", "main", RESOURCE, 1)
            await run.kubelet.admit("jobs", "unknown-to-the-api", "main", RESOURCE, 1)
            def by_pod() -> dict[str, object]:
                out = {}
                for region in run.agent.regions.regions():
                    key = run.agent.regions.identity(region.alloc_id)
                    if key is not None:
                        out[key[1]] = region
                return out

            await until(lambda: len(by_pod()) == 3)
            regions = by_pod()
            await until(lambda: regions["llm"].priority == 20
                        and regions["etl"].policy(0) == "work-conserving")
            llm = layout.decode_control((regions["llm"].path / "control").read_bytes())
            etl = layout.decode_control((regions["etl"].path / "control").read_bytes())
            assert (llm.priority, llm.devices[0].policy) == (20, layout.POLICY_STRICT)
            # `jobs` may not go above 0: the policy applies, the priority is refused
            assert (etl.priority, etl.devices[0].policy) == (0, layout.POLICY_WORK_CONSERVING)
            await api.wait_for(lambda: any(
                e["involvedObject"].get("name") == "etl" for e in api.all_events()), within=10)

            text = await asyncio.to_thread(metrics, run.agent.metrics.url)
            sources = {labels["pod"]: (labels["policy"], labels["policy_source"])
                       for labels, _ in series(text, "vgpu_container_core_policy_info")}
            assert sources == {
                "llm": ("strict", "pod"),
                "etl": ("work-conserving", "pod"),
                "unknown-to-the-api": ("strict", "default"),
            }
            assert {labels["pod"]: value for labels, value in
                    series(text, "vgpu_container_priority")}["llm"] == 20
            # the controller steers by them from its next tick
            etl_key = (regions["etl"].alloc_id, 0)
            await until(lambda: (decided := run.agent.controller.status.get(etl_key)) is not None
                        and (decided.policy, decided.priority) == ("work-conserving", 0))
            status = json.loads(await run.agent.metrics.status())
            allocations = {a["pod"]: a for a in status["allocations"]}
            assert (allocations["llm"]["priority"], allocations["llm"]["policy_source"]) == (
                20, "pod")
            assert allocations["unknown-to-the-api"]["policy_source"] == "default"
            assert allocations["etl"]["devices"][0]["policy"] == "work-conserving"
    finally:
        await api.stop()

"""Each container's core policy and priority in force, and whether its pod chose them."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.exposition import generate_latest

from tests.fakes.promtext import series
from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics.collectors import AgentInstruments, render_exposition, take_snapshot
from vgpu_agent.metrics.poller import RegionCache
from vgpu_agent.metrics.sources import MetricsSources
from vgpu_agent.shm.regions import RegionStore
from vgpu_agent.throttle.podpolicy import PodInfo, PodPolicyRules
from vgpu_agent.throttle.regionpolicy import RegionPolicies

GPUS = build_inventory("1xA100-80GB")
G0 = GPUS[0].uuid


class Pods:
    def __init__(self) -> None:
        self.known: dict[tuple[str, str], PodInfo] = {}

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self.known.get((namespace, name))


async def test_policy_series_say_whether_the_pod_or_the_node_chose(tmp_path: Path) -> None:
    store = RegionStore(tmp_path, default_policy="strict")
    serving = store.create(Grant((f"{G0}::0",), (GrantedDevice(G0, 0, 1, 1 << 30, 25.0),)))
    batch = store.create(Grant((f"{G0}::1",), (GrantedDevice(G0, 0, 1, 1 << 30, 25.0),)))
    await store.reconcile({f"{G0}::0": ("prod", "llm", "srv"), f"{G0}::1": ("jobs", "etl", "c")})
    pods = Pods()
    pods.known[("prod", "llm")] = PodInfo(
        "uid-1", "prod", "llm", {"vgpu.io/priority": "20", "vgpu.io/core-policy": "strict"}
    )
    rules = PodPolicyRules(priority_namespaces=frozenset({"prod"}))
    policies = RegionPolicies(store.regions, store.identity, rules, pods=pods)
    policies.apply()  # `etl` is not known yet: the node default stays, and says so

    sources = MetricsSources(
        node="n", gpus=lambda: GPUS, slices_per_gpu=4, regions=store.regions,
        identity=store.identity, policy_source=policies.source,
    )
    cache = RegionCache(store.regions)
    await cache.refresh()
    snap = take_snapshot(sources, {}, cache.samples)
    text = render_exposition(snap, AgentInstruments(), False, generate_latest, False).decode()

    info = {(s[0]["pod"], s[0]["policy"], s[0]["policy_source"]): s[1]
            for s in series(text, "vgpu_container_core_policy_info")}
    assert info == {("llm", "strict", "pod"): 1, ("etl", "strict", "default"): 1}
    priority = {(s[0]["pod"], s[0]["policy_source"]): s[1]
                for s in series(text, "vgpu_container_priority")}
    assert priority == {("llm", "pod"): 20, ("etl", "default"): 0}
    # the other container series keep their labels: no policy_source that would split them
    limits = series(text, "vgpu_container_core_limit_ratio")
    assert limits and all("policy_source" not in labels for labels, _ in limits)
    assert serving.priority == 20 and batch.priority == 0
    store.close()


async def test_without_a_policy_source_no_policy_series_are_emitted(tmp_path: Path) -> None:
    store = RegionStore(tmp_path)
    store.create(Grant((f"{G0}::0",), (GrantedDevice(G0, 0, 1, 1 << 30, 25.0),)))
    await store.reconcile({f"{G0}::0": ("a", "b", "c")})
    sources = MetricsSources(node="n", gpus=lambda: GPUS, slices_per_gpu=4,
                             regions=store.regions, identity=store.identity)
    cache = RegionCache(store.regions)
    await cache.refresh()
    snap = take_snapshot(sources, {}, cache.samples)
    text = render_exposition(snap, AgentInstruments(), False, generate_latest, False).decode()
    assert series(text, "vgpu_container_core_policy_info") == []
    assert series(text, "vgpu_container_memory_limit_bytes")
    store.close()

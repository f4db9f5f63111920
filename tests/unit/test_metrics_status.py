"""The `/status` document, built from real region files and cached readings like a scrape:
every allocation with its state, nulls where the agent does not know, and values that agree
with the metrics of the same round."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fakes.promtext import series, value
from tests.fakes.shimstate import DeviceSpec, ShimWriter
from tests.unit.test_metrics_collectors import G0, G1, G2, GIB, Node
from vgpu_agent.gpu.model import GpuReadings
from vgpu_agent.metrics.collectors import take_snapshot
from vgpu_agent.metrics.poller import GpuSample, RegionCache
from vgpu_agent.metrics.status import ALLOCATION_STATES, SCHEMA_VERSION, build_status


@dataclass
class Decision:
    measured_util: float | None
    rate: int
    target: float
    policy: str
    rate_limited: bool = False
    open_loop: bool = False
    paused: bool = False


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


async def _status(node: Node, **overrides: object) -> dict[str, object]:
    cache = RegionCache(lambda: node.handles)
    await cache.refresh()
    sources = node.sources(**overrides)
    snap = take_snapshot(sources, node.gpu_samples, cache.samples, now_ns=10_000_000_000)
    document = build_status(snap, cache.samples, sources.identity, node.throttle, now_s=1.0)
    json.dumps(document, allow_nan=False)  # what the endpoint sends must encode
    return document


def _allocation(document: dict[str, object], alloc_id: str) -> dict[str, object]:
    allocations = document["allocations"]
    assert isinstance(allocations, list)
    return next(a for a in allocations if a["alloc_id"] == alloc_id)


async def test_an_active_container_carries_limits_usage_and_the_controllers_decision(
    node: Node,
) -> None:
    directory = node.region(
        "a1", ("prod", "infer", "main"), [DeviceSpec(G2, 6 * GIB, 25, "strict")], [f"{G2}::0"]
    )
    shim = ShimWriter(directory)
    shim.process(0, 7, 707, 0, memory=2 * GIB, launches=40, wait_ns=1_500_000_000,
                 last_launch_ns=9_500_000_000)
    shim.device_totals(0, memory=2 * GIB)
    shim.memory_kinds(0, context=GIB // 4, pool=GIB // 2, spilled=GIB // 8)
    shim.close()
    node.throttle[("a1", 0)] = Decision(24.0, 1000, target=25.0, policy="strict",
                                        rate_limited=True)
    document = await _status(node, healthy=lambda: {G0: True, G1: False, G2: True})

    assert document["schema_version"] == SCHEMA_VERSION
    assert document["node"] == "node-a"
    gpus = {g["uuid"]: g for g in document["gpus"]}  # type: ignore[attr-defined]
    assert gpus[G2]["slices_allocated"] == 1 and gpus[G2]["slices_total"] == 4
    assert gpus[G1]["healthy"] is False and gpus[G2]["healthy"] is True
    assert gpus[G2]["memory_total_bytes"] == 24 * GIB
    allocation = _allocation(document, "a1")
    assert (allocation["namespace"], allocation["pod"], allocation["container"]) == (
        "prod", "infer", "main")
    assert allocation["state"] == "active"
    (device,) = allocation["devices"]  # type: ignore[misc]
    assert device == {
        "gpu_uuid": G2,
        "gpu_index": 2,
        "memory_limit_bytes": 6 * GIB,
        "memory_used_bytes": 2 * GIB,
        "memory_by_kind_bytes": {"data": 2 * GIB - GIB // 4 - GIB // 2, "context": GIB // 4,
                                 "module": 0, "pool": GIB // 2},
        "memory_spilled_bytes": GIB // 8,
        "core_limit_ratio": 0.25,
        "core_target_ratio": 0.25,
        "core_measured_ratio": 0.24,
        "policy": "strict",
        "rate_limited": True,
        "open_loop": False,
        "paused": False,
        "token_wait_seconds": 1.5,
        "launches": 40,
        "last_launch_age_seconds": 0.5,
    }


async def test_every_region_is_listed_with_its_state_and_unknowns_are_null(node: Node) -> None:
    node.region("old", ("ns", "p", "c"), [DeviceSpec(G0, 4 * GIB, 10)], [f"{G0}::0"], seq=1)
    node.region("new", ("ns", "p", "c"), [DeviceSpec(G0, 8 * GIB, 20)], [f"{G0}::1"], seq=2)
    node.region("orphan", None, [DeviceSpec(G1, GIB, 25)], [f"{G1}::0"], seq=3)
    bad = node.region("bad", ("ns", "q", "c"), [DeviceSpec(G1, GIB, 25)], [f"{G1}::1"], seq=4)
    shim = ShimWriter(bad)
    shim.scribble_header()
    shim.close()
    gone = node.region("gone", ("ns", "r", "c"), [DeviceSpec(G1, GIB, 25)], [f"{G1}::2"], seq=5)
    (gone / "state").write_bytes(b"")
    document = await _status(node)

    states = {a["alloc_id"]: a["state"] for a in document["allocations"]}  # type: ignore[attr-defined]
    assert states == {"old": "superseded", "new": "active", "orphan": "unidentified",
                      "bad": "corrupt", "gone": "unreadable"}
    assert set(states.values()) == set(ALLOCATION_STATES)
    orphan = _allocation(document, "orphan")
    assert orphan["namespace"] is None and orphan["pod"] is None
    corrupt = _allocation(document, "bad")["devices"][0]  # type: ignore[index]
    # limits are the agent's own and known; usage comes from the corrupt file and is not
    assert corrupt["memory_limit_bytes"] == GIB
    assert corrupt["memory_used_bytes"] is None and corrupt["launches"] is None
    assert corrupt["memory_by_kind_bytes"] is None
    assert corrupt["core_measured_ratio"] is None and corrupt["core_target_ratio"] is None
    assert _allocation(document, "gone")["error"].startswith("state unreadable")  # type: ignore[union-attr]


async def test_status_agrees_with_the_metrics_of_the_same_round(node: Node) -> None:
    directory = node.region(
        "a1", ("prod", "infer", "main"), [DeviceSpec(G0, 6 * GIB, 25), DeviceSpec(G1, 3 * GIB, 50)],
        [f"{G0}::0", f"{G1}::0"],
    )
    shim = ShimWriter(directory)
    shim.process(0, 7, 707, 0, memory=GIB, launches=3)
    shim.process(0, 7, 707, 1, memory=2 * GIB, launches=5)
    shim.device_totals(0, memory=GIB)
    shim.device_totals(1, memory=2 * GIB)
    shim.close()
    node.throttle[("a1", 1)] = Decision(47.0, 5000, target=50.0, policy="strict")
    node.gpu_samples[G1] = GpuSample(GpuReadings(9 * GIB, 0.47, 50.0, 100.0), False)
    text = await node.scrape()
    document = await _status(node)

    for device in _allocation(document, "a1")["devices"]:  # type: ignore[attr-defined]
        labels = {"pod": "infer", "gpu_uuid": device["gpu_uuid"]}
        assert device["memory_limit_bytes"] == value(
            text, "vgpu_container_memory_limit_bytes", **labels)
        # the metric splits the total by kind; /status gives the total
        assert device["memory_used_bytes"] == sum(
            v for lab, v in series(text, "vgpu_container_memory_used_bytes")
            if labels.items() <= lab.items())
        assert device["core_limit_ratio"] == value(
            text, "vgpu_container_core_limit_ratio", **labels)
        assert device["core_measured_ratio"] == value(
            text, "vgpu_container_core_utilization_ratio", **labels)
        assert device["launches"] == value(text, "vgpu_container_kernel_launches_total", **labels)
    gpu = next(g for g in document["gpus"] if g["uuid"] == G1)  # type: ignore[attr-defined]
    assert gpu["utilization_ratio"] == value(text, "vgpu_gpu_utilization_ratio", gpu_uuid=G1)
    assert gpu["memory_used_bytes"] == value(text, "vgpu_gpu_memory_used_bytes", gpu_uuid=G1)
    assert gpu["slices_allocated"] == value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G1)


async def test_a_stale_gpu_has_no_live_readings(node: Node) -> None:
    node.gpu_samples[G0] = GpuSample(GpuReadings(GIB, 0.9, 80.0, 300.0), True, "lost", 0.0, 4)
    gpu = next(g for g in (await _status(node))["gpus"] if g["uuid"] == G0)  # type: ignore[attr-defined]
    assert gpu["readings_stale"] is True
    assert gpu["memory_used_bytes"] is None and gpu["utilization_ratio"] is None


async def test_a_gpu_says_whether_its_samples_are_read_as_time_sliced(node: Node) -> None:
    document = await _status(node, time_sliced_gpus=lambda: frozenset({G1}),
                             use_only_strangers_gpus=lambda: frozenset({G0}),
                             use_charged_to_nobody=lambda: {G1: 42.5})
    sliced = {g["uuid"]: g["nvml_time_sliced"] for g in document["gpus"]}  # type: ignore[attr-defined]
    assert sliced[G1] is True
    assert sliced[G0] is False
    strangers = {g["uuid"]: g["nvml_use_only_strangers"] for g in document["gpus"]}  # type: ignore[attr-defined]
    assert (strangers[G0], strangers[G1]) == (True, False)
    uncharged = {g["uuid"]: g["uncharged_use_ratio"] for g in document["gpus"]}  # type: ignore[attr-defined]
    assert uncharged[G1] == 0.425
    assert uncharged[G0] is None  # not split
    # no throttle controller: not known, not false
    bare = await _status(node)
    assert all(g["nvml_time_sliced"] is None for g in bare["gpus"])  # type: ignore[attr-defined]
    assert all(g["nvml_use_only_strangers"] is None for g in bare["gpus"])  # type: ignore[attr-defined]
    assert all(g["uncharged_use_ratio"] is None for g in bare["gpus"])  # type: ignore[attr-defined]

"""Node labels: what the agent sets, that it changes only its own keys, and how it patches."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.kubeapi import NODE, STRATEGIC, gpu, wired
from vgpu_agent.kube import labels as L

# --- the labels themselves (pure) -------------------------------------------------------------


def test_labels_describe_gpus_in_gfd_style() -> None:
    got = L.node_labels([gpu(0), gpu(1)], split_count=4, version="0.1.0")
    assert got == {
        "vgpu.io/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "vgpu.io/gpu.memory": "81920",
        "vgpu.io/gpu.count": "2",
        "vgpu.io/gpu.replicas": "4",
        "vgpu.io/gpu.compute.major": "8",
        "vgpu.io/gpu.compute.minor": "0",
        "vgpu.io/agent.version": "0.1.0",
    }


def test_mixed_gpus_take_lowest_index_product_and_smallest_memory() -> None:
    gpus = [gpu(1, "NVIDIA L4", 23034), gpu(0, "NVIDIA H100 80GB HBM3", 81559)]
    got = L.node_labels(gpus, 2, "1")
    assert got["vgpu.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert got["vgpu.io/gpu.memory"] == "23034"


def test_no_gpus_sets_count_zero_and_no_product() -> None:
    got = L.node_labels([], 4, "1")
    assert got["vgpu.io/gpu.count"] == "0"
    assert "vgpu.io/gpu.product" not in got and "vgpu.io/gpu.memory" not in got


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
        ("  Tesla V100 (PCIe) ", "Tesla-V100-PCIe"),
        ("0.1.0+g1234.dirty", "0.1.0-g1234.dirty"),
        ("x" * 80, "x" * 63),
        ("---", ""),
        ("a" * 62 + "/b", "a" * 62),
    ],
)
def test_label_values_are_made_valid(text: str, value: str) -> None:
    assert L.label_value(text) == value


def test_split_count_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="split_count must be at least 1, got 0"):
        L.node_labels([gpu(0)], 0, "1")


def test_patch_touches_only_own_prefix_and_removes_stale_own_keys() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/gpu.product": "Tesla-T4",
        "vgpu.io/gpu.product": "Tesla-T4",
        "vgpu.io/gpu.count": "2",
        "vgpu.io/old-label": "x",
    }
    desired = {"vgpu.io/gpu.product": "NVIDIA-L4", "vgpu.io/gpu.count": "2"}
    assert L.labels_patch(current, desired) == {
        "vgpu.io/gpu.product": "NVIDIA-L4",
        "vgpu.io/old-label": None,
    }
    assert L.labels_patch({**current, **desired, "vgpu.io/old-label": "x"}, desired) == {
        "vgpu.io/old-label": None
    }
    assert L.labels_patch(desired, desired) == {}


def test_patch_refuses_foreign_keys() -> None:
    with pytest.raises(ValueError, match=r"\['nvidia.com/gpu.count'\] are outside"):
        L.labels_patch({}, {"nvidia.com/gpu.count": "1"})


# --- against the fake API server --------------------------------------------------------------


async def test_publish_sets_labels_and_leaves_others_alone(tmp_path: Path) -> None:
    others = {"kubernetes.io/hostname": NODE, "nvidia.com/gpu.product": "Tesla-T4"}
    async with wired(tmp_path, labels={**others, "vgpu.io/gone": "x"}) as w:
        await w.node.publish_labels([gpu(0), gpu(1)], 4, "0.1.0")
        labels = lambda: w.api.nodes[NODE]["metadata"]["labels"]  # noqa: E731
        await w.api.wait_for(lambda: labels().get("vgpu.io/gpu.count") == "2")

        assert {k: v for k, v in labels().items() if not k.startswith("vgpu.io/")} == others
        assert labels()["vgpu.io/gpu.replicas"] == "4"
        assert "vgpu.io/gone" not in labels()
        patches = [r for r in w.api.requests if r.method == "PATCH"]
        assert len(patches) == 1
        assert patches[0].content_type == STRATEGIC
        sent = patches[0].body["metadata"]["labels"]
        assert set(sent) == {k for k in L.node_labels([gpu(0)], 4, "x")} | {"vgpu.io/gone"}
        assert sent["vgpu.io/gone"] is None


async def test_republish_of_same_labels_sends_no_patch(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: any(r.method == "PATCH" for r in w.api.requests))
        before = len(w.api.requests)
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: len(w.api.requests) > before)
        assert [r.method for r in w.api.requests[before:]] == ["GET"]


async def test_new_split_count_replaces_label(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.node.publish_labels([gpu(0)], 8, "1")
        labels = lambda: w.api.nodes[NODE]["metadata"]["labels"]  # noqa: E731
        await w.api.wait_for(lambda: labels().get("vgpu.io/gpu.replicas") == "8")


async def test_conflict_rereads_node_and_keeps_the_other_writers_change(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        # Another controller updates the node between our read and our patch: the
        # resourceVersion precondition makes the server answer 409.
        w.api.after("GET", lambda: w.api.set_labels(NODE, team="ml"))
        await w.node.publish_labels([gpu(0)], 4, "1")
        labels = lambda: w.api.nodes[NODE]["metadata"]["labels"]  # noqa: E731
        await w.api.wait_for(lambda: labels().get("vgpu.io/gpu.count") == "1")
        assert labels()["team"] == "ml"
        statuses = [r.status for r in w.api.requests if r.method == "PATCH"]
        assert statuses == [409, 200]


async def test_patch_carries_resource_version_precondition(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        rv = w.api.nodes[NODE]["metadata"]["resourceVersion"]
        await w.node.publish_labels([gpu(0)], 4, "1")
        await w.api.wait_for(lambda: any(r.method == "PATCH" for r in w.api.requests))
        patch = next(r for r in w.api.requests if r.method == "PATCH")
        assert patch.body["metadata"]["resourceVersion"] == rv
        assert w.api.nodes[NODE]["metadata"]["resourceVersion"] != rv


async def test_a_node_with_a_large_status_is_handled(tmp_path: Path) -> None:
    async with wired(tmp_path) as w:
        w.api.nodes[NODE]["status"] = {
            "images": [
                {"names": [f"registry.example/image{n}:v1"], "sizeBytes": 10**8}
                for n in range(300)
            ],
            "conditions": [{"type": "Ready", "status": "True"}],
        }
        await w.node.publish_labels([gpu(0)], 4, "1")
        labels = lambda: w.api.nodes[NODE]["metadata"]["labels"]  # noqa: E731
        await w.api.wait_for(lambda: labels().get("vgpu.io/gpu.count") == "1")
        assert len(w.api.nodes[NODE]["status"]["images"]) == 300

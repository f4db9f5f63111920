"""The ResourceSlice a node publishes: devices, capacities, attributes, taints (pure)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from tests.fakes.dra_allocator import Allocator
from tests.fakes.kubeapi import gpu
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.quantity import parse
from vgpu_agent.dra.slices import (
    HEALTHY,
    DeviceHealth,
    SliceError,
    architecture,
    build_device,
    build_spec,
    carry_taint_times,
    classify_health,
    metadata_current,
    same_devices,
    semver,
    slice_name,
    slice_object,
    taints,
)
from vgpu_agent.gpu.model import MIB

DRIVER = "gpu.vgpu.io"
NODE = "node-a"


FOUR = Split(4)


def spec(split: Split = FOUR, health: dict[str, DeviceHealth] | None = None, n: int = 2,
         generation: int = 1) -> dict:
    return build_spec(NODE, DRIVER, [gpu(i) for i in range(n)], split, health or {}, generation,
                      "535.104.05")


def test_one_shared_device_per_gpu_with_memory_and_cores() -> None:
    built = spec()
    assert built["driver"] == DRIVER and built["nodeName"] == NODE
    assert built["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    first = built["devices"][0]
    assert [d["name"] for d in built["devices"]] == ["gpu-0", "gpu-1"]
    assert first["allowMultipleAllocations"] is True
    assert first["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {
            "default": "20Gi",
            "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"},
        },
    }
    assert first["capacity"]["cores"] == {
        "value": "100",
        "requestPolicy": {"default": "25", "validRange": {"min": "1", "max": "100", "step": "1"}},
    }
    assert "taints" not in first


def test_attributes_follow_the_published_conventions() -> None:
    device = build_device(
        dataclasses.replace(gpu(3), numa_node=1, compute_capability=(9, 0)),
        Split(2), DRIVER, driver_version="535.104.05",
    )
    assert device["attributes"] == {
        "uuid": {"string": gpu(3).uuid},
        "productName": {"string": "NVIDIA A100-SXM4-80GB"},
        "index": {"int": 3},
        "minor": {"int": 3},
        "pciBusID": {"string": "00000000:04:00.0"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "535.104.5"},
        "numaNode": {"int": 1},
    }
    unknown = build_device(dataclasses.replace(gpu(0), compute_capability=(0, 0)), Split(2),
                           DRIVER)
    for absent in ("architecture", "cudaComputeCapability", "driverVersion", "numaNode"):
        assert absent not in unknown["attributes"]


@pytest.mark.parametrize(
    ("capability", "name"),
    [((7, 0), "Volta"), ((7, 5), "Turing"), ((8, 0), "Ampere"), ((8, 6), "Ampere"),
     ((8, 9), "Ada Lovelace"), ((9, 0), "Hopper"), ((10, 0), "Blackwell"), ((1, 0), None)],
)
def test_architecture_from_compute_capability(capability: tuple[int, int], name: str | None) -> None:
    assert architecture(capability) == name


@pytest.mark.parametrize(
    ("text", "version"),
    [("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"), ("560.28", "560.28.0"),
     ("", None), (None, None), ("550.54.15-beta", None), ("1.2.3.4", None)],
)
def test_driver_versions_become_semantic_versions(text: str | None, version: str | None) -> None:
    assert semver(text) == version


def test_scaling_and_odd_splits_round_to_whole_units() -> None:
    device = build_device(gpu(0, mib=40960 + 1), Split(3, memory_scaling=0.9, cores_scaling=0.5),
                          DRIVER)
    memory = device["capacity"]["memory"]
    total, default = parse(memory["value"]), parse(memory["requestPolicy"]["default"])
    assert total % MIB == 0 and default % MIB == 0
    assert total == (int(0.9 * (40960 + 1) * MIB) // MIB) * MIB
    assert default == (int(0.9 * (40960 + 1) * MIB / 3) // MIB) * MIB
    assert parse(memory["requestPolicy"]["validRange"]["max"]) == total
    assert device["capacity"]["cores"]["requestPolicy"]["default"] == "16"  # 0.5*100/3


def test_a_gpu_too_small_to_split_is_named() -> None:
    with pytest.raises(SliceError, match=r"GPU-00000000.*at least 1 MiB"):
        build_device(gpu(0, mib=1), Split(4), DRIVER)


def test_mig_gpus_are_not_offered() -> None:
    built = build_spec(NODE, DRIVER, [gpu(0), dataclasses.replace(gpu(1), mig_enabled=True)],
                       Split(2), {}, 1)
    assert [d["name"] for d in built["devices"]] == ["gpu-0"]


def test_duplicate_indexes_are_refused() -> None:
    twin = dataclasses.replace(gpu(0), uuid="GPU-other")
    with pytest.raises(SliceError, match="not unique"):
        build_spec(NODE, DRIVER, [gpu(0), twin], Split(2), {}, 1)


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        (classify_health(False, "critical XID 48", 48),
         [{"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule"}]),
        (classify_health(False, "critical XID 79", 79),
         [{"key": f"{DRIVER}/gpu-lost", "value": "true", "effect": "NoExecute"}]),
        (classify_health(False, "NVML query failed: nvmlDeviceGetMemoryInfo on GPU-1 failed: "
                                "GPU is lost (NVML code 15)"),
         [{"key": f"{DRIVER}/gpu-lost", "value": "true", "effect": "NoExecute"}]),
        (classify_health(False, "NVML query failed: timeout"),
         [{"key": f"{DRIVER}/unhealthy", "value": "nvml-query-failed", "effect": "NoSchedule"}]),
        (classify_health(True, "recovered"), []),
    ],
)
def test_health_becomes_taints(health: DeviceHealth, expected: list[dict[str, str]]) -> None:
    assert taints(health, DRIVER) == expected


def test_xid_is_read_from_the_reason_when_not_given() -> None:
    assert classify_health(False, "critical XID 31").xid == 31
    assert classify_health(False, "x", lost=True).lost


def test_only_the_unhealthy_gpu_is_tainted() -> None:
    built = spec(health={gpu(1).uuid: classify_health(False, "critical XID 48", 48)})
    assert "taints" not in built["devices"][0]
    assert built["devices"][1]["taints"][0]["value"] == "48"


def test_same_devices_compares_values_not_spelling_nor_generation_nor_taint_times() -> None:
    wanted = spec(health={gpu(0).uuid: classify_health(False, "critical XID 48", 48)})
    stored = copy.deepcopy(wanted)
    stored["pool"]["generation"] = 7
    stored["devices"][0]["capacity"]["memory"]["value"] = "81920Mi"
    stored["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    assert same_devices(stored, wanted)
    stored["devices"][1]["capacity"]["cores"]["requestPolicy"]["default"] = "30"
    assert not same_devices(stored, wanted)
    assert not same_devices(spec(n=1), spec(n=2))
    assert not same_devices(spec(), wanted)


def test_taint_times_carry_over_only_for_the_same_taint() -> None:
    xid48 = {gpu(0).uuid: classify_health(False, "critical XID 48", 48)}
    stored = spec(health=xid48)
    stored["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    wanted = spec(health=xid48)
    carry_taint_times(wanted, stored)
    assert wanted["devices"][0]["taints"][0]["timeAdded"] == "2026-01-01T00:00:00Z"
    other = spec(health={gpu(0).uuid: classify_health(False, "critical XID 79", 79)})
    carry_taint_times(other, stored)
    assert "timeAdded" not in other["devices"][0]["taints"][0]


def test_slice_names_are_fixed_valid_and_unique_per_node_and_driver() -> None:
    assert slice_name(NODE, DRIVER) == "node-a-gpu.vgpu.io"
    long_node = "n" * 250
    name = slice_name(long_node, DRIVER)
    assert len(name) <= 253 and name != slice_name(long_node, "other.io")
    assert slice_name("Node_A", DRIVER) != slice_name("node-a", DRIVER)


def test_slice_object_is_owned_by_the_node_and_labelled() -> None:
    obj = slice_object(NODE, DRIVER, spec(), node_uid="uid-1")
    assert obj["metadata"]["ownerReferences"][0] == {
        "apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-1", "controller": True
    }
    assert metadata_current(obj, obj)
    unlabelled = copy.deepcopy(obj)
    unlabelled["metadata"]["labels"] = {}
    assert not metadata_current(unlabelled, obj)
    assert "ownerReferences" not in slice_object(NODE, DRIVER, spec())["metadata"]


def test_a_default_request_gets_one_device_plugin_slice_worth() -> None:
    """What the scheduler would grant from this slice: the split's share when nothing is asked,
    the asked amount rounded to whole MiB otherwise."""
    published = {"metadata": {"name": "s"}, "spec": spec(Split(4), n=1)}
    device_class = {"metadata": {"name": "vgpu"}, "spec": {"selectors": [
        {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}
    claim = {"metadata": {"name": "c", "uid": "u"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "vgpu"}}]}}}
    result = Allocator([published], [device_class]).allocate(claim)["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "20Gi", "cores": "25"}
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {
        "requests": {"memory": "10000000000", "cores": "30"}}
    result = Allocator([published], [device_class]).allocate(claim)["devices"]["results"][0]
    assert parse(result["consumedCapacity"]["memory"]) == 9537 * MIB  # rounded up to 1 MiB
    assert result["consumedCapacity"]["cores"] == "30"


def test_healthy_default() -> None:
    assert DeviceHealth() == HEALTHY and taints(HEALTHY, DRIVER) == []


@pytest.mark.parametrize("driver", ["GPU.vgpu.io", "gpu_vgpu", "", "a" * 64, "-gpu.io"])
def test_bad_driver_names_are_named(driver: str) -> None:
    with pytest.raises(SliceError, match="driver name"):
        build_spec(NODE, driver, [gpu(0)], Split(2), {}, 1)


def test_bad_node_names_are_named() -> None:
    with pytest.raises(SliceError, match="node name 'Node_A'"):
        build_spec("Node_A", DRIVER, [gpu(0)], Split(2), {}, 1)

"""The test allocator follows the scheduler's structured-parameters and consumable-capacity rules."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.fakes.dra_allocator import (
    AllocationError,
    Allocator,
    UnsupportedSelector,
    allocate_in,
    consumed_amount,
)
from tests.fakes.resourceapi import ResourceStore

DRIVER = "gpu.vgpu.io"


def device(name: str, *, memory: str = "80Gi", default_memory: str = "20Gi",
           taints: list[dict[str, str]] | None = None, shared: bool = True,
           product: str = "A100") -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name,
        "attributes": {
            "productName": {"string": product},
            "index": {"int": int(name.rsplit("-", 1)[1])},
        },
        "capacity": {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": default_memory,
                    "validRange": {"min": "1Mi", "max": memory, "step": "1Mi"},
                },
            },
            "cores": {
                "value": "100",
                "requestPolicy": {"default": "25", "validRange": {"min": "1", "step": "1"}},
            },
        },
    }
    if shared:
        dev["allowMultipleAllocations"] = True
    if taints:
        dev["taints"] = taints
    return dev


def slice_of(node: str, devices: list[dict[str, Any]], generation: int = 1, count: int = 1,
             name: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name or f"{node}-{generation}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": devices,
        },
    }


CLASS = {
    "metadata": {"name": "vgpu"},
    "spec": {
        "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
        "config": [{"opaque": {"driver": DRIVER, "parameters": {"priority": 1}}}],
    },
}

_uids = itertools.count()


def claim(*requests: dict[str, Any], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": f"c{next(_uids)}", "namespace": "team", "uid": f"uid-{next(_uids)}"},
        "spec": {"devices": {"requests": list(requests)}},
    }
    if config:
        body["spec"]["devices"]["config"] = config
    return body


def request(name: str = "gpu", cls: str = "vgpu", **exactly: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, **exactly}}


def memory_cores(memory: str | None = None, cores: str | None = None) -> dict[str, Any]:
    wanted = {}
    if memory is not None:
        wanted["memory"] = memory
    if cores is not None:
        wanted["cores"] = cores
    return {"requests": wanted}


def allocate(slices: list[dict[str, Any]], the_claim: dict[str, Any],
             others: list[dict[str, Any]] = (), classes: list[dict[str, Any]] | None = None,
             node: str | None = None) -> dict[str, Any]:
    ids = (f"share-{i}" for i in itertools.count())
    return Allocator(slices, classes or [CLASS], list(others), share_id=lambda: next(ids)).allocate(
        the_claim, node
    )


def allocated(the_claim: dict[str, Any], allocation: dict[str, Any]) -> dict[str, Any]:
    return {**the_claim, "status": {"allocation": allocation}}


def test_default_share_consumes_the_policy_defaults_and_carries_config() -> None:
    c = claim(request(), config=[{"requests": ["gpu"], "opaque": {
        "driver": DRIVER, "parameters": {"corePolicy": "hard"}}}])
    result = allocate([slice_of("node-a", [device("gpu-0")])], c)
    assert result["devices"]["results"] == [
        {
            "request": "gpu",
            "driver": DRIVER,
            "pool": "node-a",
            "device": "gpu-0",
            "consumedCapacity": {"memory": "20Gi", "cores": "25"},
            "shareID": "share-0",
        }
    ]
    assert result["devices"]["config"] == [
        {"source": "FromClass", "requests": ["gpu"],
         "opaque": {"driver": DRIVER, "parameters": {"priority": 1}}},
        {"source": "FromClaim", "requests": ["gpu"],
         "opaque": {"driver": DRIVER, "parameters": {"corePolicy": "hard"}}},
    ]
    assert result["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"] == [
        {"key": "metadata.name", "operator": "In", "values": ["node-a"]}
    ]


@pytest.mark.parametrize(
    ("asked", "consumed"),
    [("10Gi", "10Gi"), ("1.5Mi", "2Mi"), ("0", "1Mi"), ("10000Mi", "10000Mi"), ("80Gi", "80Gi"),
     ("81Gi", None), ("1", "1Mi")],
)
def test_requested_memory_is_rounded_up_to_the_policy(asked: str, consumed: str | None) -> None:
    entry = device("gpu-0")["capacity"]["memory"]
    amount = consumed_amount(entry, asked)
    if consumed is None:
        assert amount is None
    else:
        assert amount is not None and amount == consumed_amount(entry, consumed)


def test_valid_values_pick_the_smallest_that_fits() -> None:
    entry = {"value": "100", "requestPolicy": {"default": "50", "validValues": ["25", "50", "100"]}}
    assert consumed_amount(entry, "30") == 50
    assert consumed_amount(entry, "100") == 100
    assert consumed_amount(entry, "101") is None
    assert consumed_amount(entry, None) == 50
    assert consumed_amount({"value": "8"}, None) == 8  # no policy: the whole capacity


def test_claims_share_a_device_until_a_capacity_is_used_up() -> None:
    slices = [slice_of("node-a", [device("gpu-0")])]
    held: list[dict[str, Any]] = []
    for _ in range(3):
        c = claim(request(capacity=memory_cores("10Gi", "30")))
        held.append(allocated(c, allocate(slices, c, held)))
    # 90 cores in use: 30 more would be 120 > 100
    c = claim(request(capacity=memory_cores("10Gi", "30")))
    with pytest.raises(AllocationError, match=r"cores: 30 more would exceed 100 \(90 in use\)"):
        allocate(slices, c, held)
    # 10 cores still fit, memory still has room
    c = claim(request(capacity=memory_cores("10Gi", "10")))
    result = allocate(slices, c, held)["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "10Gi", "cores": "10"}


def test_a_full_device_sends_the_next_claim_to_another_gpu() -> None:
    slices = [slice_of("node-a", [device("gpu-0"), device("gpu-1")])]
    first = claim(request(capacity=memory_cores("70Gi")))
    held = [allocated(first, allocate(slices, first))]
    second = claim(request(capacity=memory_cores("20Gi")))
    assert allocate(slices, second, held)["devices"]["results"][0]["device"] == "gpu-1"


def test_two_requests_of_one_claim_count_against_each_other() -> None:
    slices = [slice_of("node-a", [device("gpu-0")])]
    c = claim(request("a", capacity=memory_cores(cores="60")),
              request("b", capacity=memory_cores(cores="60")))
    with pytest.raises(AllocationError, match="request b"):
        allocate(slices, c)


def test_an_exclusive_device_is_allocated_once() -> None:
    slices = [slice_of("node-a", [device("gpu-0", shared=False)])]
    first = claim(request())
    result = allocate(slices, first)
    assert "consumedCapacity" not in result["devices"]["results"][0]
    assert "shareID" not in result["devices"]["results"][0]
    with pytest.raises(AllocationError, match="already allocated"):
        allocate(slices, claim(request()), [allocated(first, result)])


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_tainted_devices_are_skipped_unless_tolerated(effect: str) -> None:
    taint = {"key": f"{DRIVER}/xid", "value": "79", "effect": effect}
    slices = [slice_of("node-a", [device("gpu-0", taints=[taint]), device("gpu-1")])]
    assert allocate(slices, claim(request()))["devices"]["results"][0]["device"] == "gpu-1"
    only_tainted = [slice_of("node-a", [device("gpu-0", taints=[taint])])]
    with pytest.raises(AllocationError, match=f"tainted {DRIVER}/xid=79:{effect}"):
        allocate(only_tainted, claim(request()))
    toleration = {"key": f"{DRIVER}/xid", "operator": "Exists", "effect": effect}
    result = allocate(only_tainted, claim(request(tolerations=[toleration])))
    assert result["devices"]["results"][0]["tolerations"] == [toleration]
    wrong_value = {"key": f"{DRIVER}/xid", "operator": "Equal", "value": "48"}
    with pytest.raises(AllocationError, match="tainted"):
        allocate(only_tainted, claim(request(tolerations=[wrong_value])))


def test_a_taint_with_effect_none_does_not_block() -> None:
    taint = {"key": "note", "value": "x", "effect": "None"}
    slices = [slice_of("node-a", [device("gpu-0", taints=[taint])])]
    assert allocate(slices, claim(request()))["devices"]["results"][0]["device"] == "gpu-0"


def test_only_the_newest_complete_pool_generation_counts() -> None:
    old = slice_of("node-a", [device("gpu-0"), device("gpu-1")], generation=1)
    new = slice_of("node-a", [device("gpu-1")], generation=2)
    result = allocate([old, new], claim(request()))
    assert result["devices"]["results"][0]["device"] == "gpu-1"
    incomplete = slice_of("node-b", [device("gpu-0")], count=2)
    with pytest.raises(AllocationError, match=r"node node-b: request gpu: 0 of 1 devices"):
        allocate([incomplete], claim(request()), node="node-b")


def test_selectors_of_class_and_request() -> None:
    slices = [slice_of("node-a", [device("gpu-0", product="A100"), device("gpu-1", product="H100")])]
    picked = allocate(slices, claim(request(selectors=[{"cel": {"expression":
        f'device.attributes["{DRIVER}"].productName == "H100" && '
        f'device.attributes["{DRIVER}"]["index"] != 0'}}])))
    assert picked["devices"]["results"][0]["device"] == "gpu-1"
    big = allocate(slices, claim(request(selectors=[{"cel": {"expression":
        f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0'}}])))
    assert big["devices"]["results"][0]["device"] == "gpu-0"
    other_driver = {**CLASS, "spec": {"selectors": [
        {"cel": {"expression": 'device.driver == "other.example.com"'}}]}}
    with pytest.raises(AllocationError, match="no device matches"):
        allocate(slices, claim(request()), classes=[other_driver])
    with pytest.raises(AllocationError, match="does not exist"):
        allocate(slices, claim(request(cls="missing")))


@pytest.mark.parametrize(
    "expression",
    [
        'device.attributes["gpu.vgpu.io"].productName.startsWith("A")',
        "device.driver in ['a']",
        'device.driver == "a" || device.driver == "b"',
    ],
)
def test_unsupported_cel_is_refused_not_guessed(expression: str) -> None:
    slices = [slice_of("node-a", [device("gpu-0")])]
    with pytest.raises(UnsupportedSelector, match="does not understand"):
        allocate(slices, claim(request(selectors=[{"cel": {"expression": expression}}])))


def test_a_missing_attribute_is_a_runtime_error() -> None:
    slices = [slice_of("node-a", [device("gpu-0")])]
    with pytest.raises(AllocationError, match=r"has no attribute gpu\.vgpu\.io/uuid"):
        allocate(slices, claim(request(selectors=[{"cel": {"expression":
            f'device.attributes["{DRIVER}"].uuid == "x"'}}])))


def test_first_available_falls_back_to_a_later_subrequest() -> None:
    slices = [slice_of("node-a", [device("gpu-0")])]
    c = claim({"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": "vgpu", "capacity": memory_cores("90Gi")},
        {"name": "small", "deviceClassName": "vgpu", "capacity": memory_cores("40Gi")},
    ]})
    result = allocate(slices, c)["devices"]["results"][0]
    assert result["request"] == "gpu/small"
    assert result["consumedCapacity"]["memory"] == "40Gi"


def test_count_takes_distinct_devices_and_all_takes_every_one() -> None:
    slices = [slice_of("node-a", [device("gpu-0"), device("gpu-1")])]
    two = allocate(slices, claim(request(count=2)))["devices"]["results"]
    assert [r["device"] for r in two] == ["gpu-0", "gpu-1"]
    with pytest.raises(AllocationError, match="2 of 3"):
        allocate(slices, claim(request(count=3)))
    every = allocate(slices, claim(request(allocationMode="All")))["devices"]["results"]
    assert len(every) == 2


def test_a_claim_lands_on_one_node_only() -> None:
    slices = [slice_of("node-a", [device("gpu-0")]), slice_of("node-b", [device("gpu-0")])]
    c = claim(request("a", capacity=memory_cores("50Gi")),
              request("b", capacity=memory_cores("50Gi")))
    with pytest.raises(AllocationError, match=r"node node-a: .*node node-b: "):
        allocate(slices, c)  # 50 + 50 fits neither single 80Gi GPU, and is never split
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    slices[0] = slice_of("node-a", [device("gpu-0", taints=[taint])])
    result = allocate(slices, claim(request()))
    assert result["devices"]["results"][0]["pool"] == "node-b"
    assert result["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [
        "node-b"
    ]


def test_allocate_in_writes_the_status_like_the_scheduler() -> None:
    rv = itertools.count(1)
    last = [0]

    def next_rv() -> str:
        last[0] = next(rv)
        return str(last[0])

    store = ResourceStore(next_rv, lambda: last[0])
    store.create("deviceclasses", "", {"metadata": {"name": "vgpu"}, "spec": CLASS["spec"]})
    store.create("resourceslices", "", slice_of("node-a", [device("gpu-0")]))
    created = store.create("resourceclaims", "team", claim(request(capacity=memory_cores(
        "10240Mi", "30"))))
    name = created["metadata"]["name"]
    stored = allocate_in(store, "team", name)
    result = stored["status"]["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "10Gi", "cores": "30"}
    assert stored["metadata"]["generation"] == 1
    assert int(stored["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    again = allocate_in(store, "team", name)
    assert again["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]

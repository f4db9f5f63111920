"""A claim's allocation becomes the device plugin's grant: capacities, parameters, bad input."""

import pytest

from vgpu_agent.deviceplugin.allocation import Split, container_envs
from vgpu_agent.dra.grant import (
    ClaimError,
    ClaimPriorityBound,
    ClaimRef,
    claim_grant,
    device_table,
    over_capacity,
    parse_parameters,
)
from vgpu_agent.gpu.model import MIB, GpuInfo

DRIVER = "gpu.vgpu.io"
NODE = "node-a"
UID = "6f1c2d3e-0000-4000-8000-00000000abcd"
REF = ClaimRef("team-a", "train", UID)
GIB = 1024 * MIB


def gpu(index, gib=80):
    return GpuInfo(index, f"GPU-{index:08x}-aaaa", "NVIDIA A100", gib * GIB, index, f"0:{index}")


DEVICES = device_table([gpu(0), gpu(1)], Split(4))


def result(device="gpu-0", request="gpu", memory="10Gi", cores="30", **extra):
    out = {"request": request, "driver": DRIVER, "pool": NODE, "device": device}
    if memory is not None or cores is not None:
        out["consumedCapacity"] = {
            k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None
        }
    out.update(extra)
    return out


def claim(*results, config=(), uid=UID):
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": REF.namespace, "name": REF.name, "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results), "config": list(config)}}},
    }


def opaque(params, requests=None, source="FromClaim", driver=DRIVER):
    entry = {"source": source, "opaque": {"driver": driver, "parameters": params}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def grant_of(obj, ref=REF):
    return claim_grant(obj, ref, driver=DRIVER, node=NODE, devices=DEVICES)


def test_consumed_capacity_becomes_exactly_the_region_limits():
    out = grant_of(claim(result(shareID="3f0c")))
    assert out.grant is not None
    (device,) = out.grant.devices
    assert device.uuid == gpu(0).uuid
    assert device.memory_limit == 10 * GIB
    assert device.core_percent == 30.0
    assert out.grant.device_ids == (f"{UID}-gpu-0",)
    assert out.consumed == {gpu(0).uuid: (10 * GIB, 30)}
    (prepared,) = out.devices
    assert (prepared.pool, prepared.device, prepared.share_id, prepared.requests) == (
        NODE,
        "gpu-0",
        "3f0c",
        ("gpu",),
    )
    # the same variables a device-plugin container gets, with the claim's numbers in them
    envs = container_envs(out.grant, "cdi")
    assert envs["VGPU_MEMORY_LIMIT_0"] == f"{10 * 1024}m"
    assert envs["VGPU_CORE_LIMIT_0"] == "30"
    assert "NVIDIA_VISIBLE_DEVICES" not in envs  # the NVIDIA CDI device makes the GPU visible


def test_quantities_in_any_form_and_qualified_capacity_names():
    out = grant_of(
        claim(
            result(
                memory=None,
                cores=None,
                consumedCapacity={f"{DRIVER}/memory": "10240Mi", "cores": "25", "other": "1"},
            )
        )
    )
    assert out.consumed[gpu(0).uuid] == (10 * GIB, 25)


def test_no_consumed_capacity_means_the_whole_device():
    out = grant_of(claim(result(memory=None, cores=None)))
    assert out.consumed[gpu(0).uuid] == (80 * GIB, 100)


def test_results_of_other_drivers_are_ignored_and_devices_follow_gpu_order():
    other = {"request": "nic", "driver": "net.example.com", "pool": "x", "device": "eth0"}
    out = grant_of(claim(result("gpu-1", "b"), other, result("gpu-0", "a")))
    assert out.grant is not None
    assert [d.gpu_index for d in out.grant.devices] == [0, 1]
    assert [d.device for d in out.devices] == ["gpu-1", "gpu-0"]  # the kubelet's order


def test_two_requests_on_one_device_add_up():
    out = grant_of(claim(result(request="a", memory="1Gi", cores="10"), result(request="b")))
    assert out.consumed[gpu(0).uuid] == (11 * GIB, 40)
    assert out.grant is not None and len(out.grant.devices) == 1


def test_admin_access_gets_the_device_without_a_region():
    out = grant_of(claim(result(adminAccess=True)))
    assert out.grant is None and out.consumed == {}
    assert out.devices[0].admin_access


def test_parameters_apply_by_request_and_claim_overrides_class():
    out = grant_of(
        claim(
            result("gpu-0", "a"),
            result("gpu-1", "b"),
            config=[
                opaque({"corePolicy": "off", "priority": 1}, source="FromClass"),
                opaque({"corePolicy": "work-conserving"}, requests=["b"]),
                opaque({"priority": 5}),
                opaque({"corePolicy": "x"}, driver="other.example.com"),  # not ours: ignored
            ],
        )
    )
    assert out.policies == ("off", "work-conserving")
    assert out.priority == 5


def test_no_parameters_leave_the_agent_defaults():
    out = grant_of(claim(result()))
    assert out.policies == (None,) and out.priority == 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"corePolicy": "fast"}, "corePolicy is 'fast': must be one of off, strict"),
        ({"priority": "high"}, "priority is 'high': must be a 32-bit signed integer"),
        ({"priority": True}, "priority is True"),
        ({"priority": 2**40}, "32-bit"),
        ({"corePolicy": "off", "memory": "1Gi"}, "unknown field(s) memory: allowed are"),
        ({"kind": "Other"}, "kind is 'Other': must be 'GpuConfig'"),
        ({"apiVersion": "v1"}, f"must be '{DRIVER}/v1alpha1'"),
        ("corePolicy=off", "must be a JSON object, got str"),
    ],
)
def test_malformed_parameters_are_rejected_naming_the_field(params, message):
    with pytest.raises(ClaimError, match=r"config\[0\]\.opaque\.parameters") as caught:
        grant_of(claim(result(), config=[opaque(params)]))
    assert message in str(caught.value)
    assert str(REF) in str(caught.value)


def test_well_formed_parameters_with_version_and_kind():
    params = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "corePolicy": "strict"}
    assert parse_parameters(params, "p", DRIVER).core_policy == "strict"


def test_conflicting_parameters_on_one_device_or_claim_are_refused():
    conflicting = [opaque({"corePolicy": "off"}, ["a"]), opaque({"corePolicy": "strict"}, ["b"])]
    with pytest.raises(ClaimError, match="different corePolicy"):
        grant_of(claim(result(request="a", memory="1Gi"), result(request="b"), config=conflicting))
    priorities = [opaque({"priority": 1}, ["a"]), opaque({"priority": 2}, ["b"])]
    with pytest.raises(ClaimError, match=r"different priority values \[1, 2\]"):
        grant_of(claim(result("gpu-0", "a"), result("gpu-1", "b"), config=priorities))


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (claim(result(), uid="another"), "uid 'another'"),
        ({"metadata": {"uid": UID}, "status": {}}, "not allocated"),
        (claim(result(pool="node-b")), "pool 'node-b', but this node's pool is 'node-a'"),
        (claim(result(device="gpu-7")), "device 'gpu-7' is not a device of this node"),
        (claim(result(memory="81Gi")), "memory is 86973087744 bytes"),
        (claim(result(memory="0")), "more than 0"),
        (claim(result(cores="101")), "cores is 101"),
        (claim(result(memory="ten")), "consumedCapacity.memory"),
        (claim(result(request="")), "request is ''"),
        (claim(result(shareID="")), "shareID is ''"),
        (claim(result(memory="50Gi"), result(request="b", memory="40Gi")), "has 85899345920"),
        ({"metadata": "x"}, "metadata is str"),
        (claim("not an object"), "results[0] is str"),
        (claim(result(driver="other.example.com")), "from: other.example.com"),
        (claim(), "no device of it is allocated from driver gpu.vgpu.io"),
    ],
)
def test_bad_claims_are_refused_with_a_specific_message(obj, message):
    with pytest.raises(ClaimError) as caught:
        grant_of(obj)
    assert message in str(caught.value)


def test_two_claims_sharing_a_device_may_not_exceed_it():
    first = grant_of(claim(result(memory="60Gi", cores="50")))
    ref2 = ClaimRef("team-b", "infer", "9a9a9a9a-0000-4000-8000-000000000001")
    fits = claim_grant(
        claim(result(memory="20Gi", cores="50"), uid=ref2.uid),
        ref2,
        driver=DRIVER,
        node=NODE,
        devices=DEVICES,
    )
    assert over_capacity(fits, [first], DEVICES) is None
    too_big = claim_grant(
        claim(result(memory="21Gi", cores="10"), uid=ref2.uid),
        ref2,
        driver=DRIVER,
        node=NODE,
        devices=DEVICES,
    )
    reason = over_capacity(too_big, [first], DEVICES)
    assert reason is not None and "team-a/train" in reason and str(60 * GIB) in reason
    too_many_cores = claim_grant(
        claim(result(memory="1Gi", cores="51"), uid=ref2.uid),
        ref2,
        driver=DRIVER,
        node=NODE,
        devices=DEVICES,
    )
    assert over_capacity(too_many_cores, [first], DEVICES) is not None
    # a claim is never counted against itself (Prepare again of the same claim)
    assert over_capacity(first, [first], DEVICES) is None
    # another device is not affected
    other = claim_grant(
        claim(result("gpu-1", memory="80Gi", cores="100"), uid=ref2.uid),
        ref2,
        driver=DRIVER,
        node=NODE,
        devices=DEVICES,
    )
    assert over_capacity(other, [first], DEVICES) is None


def test_memory_scaling_scales_the_device_capacity():
    table = device_table([gpu(0, gib=16)], Split(2, memory_scaling=0.5))
    assert table["gpu-0"].memory == 8 * GIB
    assert table["gpu-0"].cores == 100


def test_a_claims_own_priority_is_held_to_the_nodes_rules_for_pods():
    # as a pod's vgpu.io/priority: at most pod_priority_max, above 0 only in the namespaces
    # allowed; the DeviceClass's configuration (the admin's) is not bounded
    bound = ClaimPriorityBound(most=50, namespaces=frozenset({REF.namespace}))

    def granted(config, ref=REF, limit=bound):
        return claim_grant(claim(result(), config=config), ref, driver=DRIVER, node=NODE,
                           devices=DEVICES, priority_bound=limit)

    assert granted([opaque({"priority": 50})]).priority == 50
    assert granted([opaque({"priority": 2**31 - 1}, source="FromClass")]).priority == 2**31 - 1
    assert granted([opaque({"priority": -2**31})]).priority == -2**31  # lower: anyone may
    with pytest.raises(ClaimError, match=r"priority is 51: .* up to 50"):
        granted([opaque({"priority": 51})])
    with pytest.raises(ClaimError, match=r"priority is 2147483647: .* up to 50"):
        granted([opaque({"priority": 1}, source="FromClass"),
                 opaque({"priority": 2**31 - 1}, requests=["gpu"])])
    # an entry without its source is taken for the claim's own
    entry = opaque({"priority": 99})
    del entry["source"]
    with pytest.raises(ClaimError, match="up to 50"):
        granted([entry])
    other = ClaimRef("elsewhere", REF.name, REF.uid)
    with pytest.raises(ClaimError, match=f"above 0 are allowed to claims in {REF.namespace} only"):
        granted([opaque({"priority": 10})], ref=other)
    nowhere = ClaimPriorityBound(most=100, namespaces=frozenset())
    with pytest.raises(ClaimError, match="in no namespace only"):
        granted([opaque({"priority": 10})], limit=nowhere)
    assert granted([opaque({"priority": 0})], limit=nowhere).priority == 0
    # no bound given: any 32-bit priority, as before
    assert granted([opaque({"priority": 2**31 - 1})], limit=None).priority == 2**31 - 1

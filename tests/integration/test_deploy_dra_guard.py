"""The DRA slice guard (deploy/components/dra-guard): its admission policy, evaluated with a CEL
interpreter on the ResourceSlice writes the agent really makes and on ones it must refuse.

This checks the expressions' logic; the API server's CEL type-checker does not run here."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.fakes.kubeapi import gpu
from tests.integration.deploy_support import one, render
from tests.integration.test_deploy_node_guard import celpy
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.slices import build_spec, classify_health, slice_object
from vgpu_agent.kube.resourceslices import DEFAULT_DRIVER

AGENT = "system:serviceaccount:vgpu-system:vgpu-agent-dra"
BOUND = {"authentication.kubernetes.io/node-name": ["gpu-1"]}


def policy(name: str = "vgpu-agent-dra-slice-guard") -> dict[str, Any]:
    return one(render("overlays/dra-hardened"), "ValidatingAdmissionPolicy", name)


def admit(
    operation: str,
    old: dict[str, Any] | None,
    new: dict[str, Any] | None,
    username: str = AGENT,
    extra: Any = BOUND,
) -> list[str]:
    """Evaluate the policy as the API server would; the messages of failed validations."""
    cel = celpy()
    env = cel.Environment()
    spec = policy()["spec"]
    user: dict[str, Any] = {"username": username}
    if extra is not None:
        user["extra"] = extra
    activation = {
        "object": cel.json_to_cel(new),
        "oldObject": cel.json_to_cel(old),
        "request": cel.json_to_cel({"operation": operation, "userInfo": user}),
    }

    def run(expression: str, variables: dict[str, Any]) -> Any:
        program = env.program(env.compile(expression))
        bound = cel.celtypes.MapType({cel.celtypes.StringType(k): v for k, v in variables.items()})
        return program.evaluate({**activation, "variables": bound})

    for condition in spec["matchConditions"]:
        if not run(condition["expression"], {}):
            return []
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        variables[variable["name"]] = run(variable["expression"], variables)
    return [v["message"] for v in spec["validations"] if not run(v["expression"], variables)]


def the_slice(node: str = "gpu-1", driver: str = DEFAULT_DRIVER, **health: Any) -> dict[str, Any]:
    spec = build_spec(node, driver, [gpu(0), gpu(1)], Split(4), health, 1)
    return slice_object(node, driver, spec, node_uid="uid-1")


ON_OTHER_NODE = "the vgpu-agent may only write ResourceSlices of the node it runs on"
OTHER_DRIVER = "the vgpu-agent may only write ResourceSlices of its driver gpu.vgpu.io"


def test_the_agents_own_writes_are_allowed() -> None:
    created = the_slice()
    assert admit("CREATE", None, created) == []
    tainted = the_slice(**{gpu(0).uuid: classify_health(False, "critical XID 48", 48)})
    tainted["spec"]["pool"]["generation"] = 2
    assert admit("UPDATE", created, tainted) == []
    assert admit("DELETE", created, None) == []
    stale = the_slice(driver="old.vgpu.io")  # labelled by the agent, driver no longer served
    assert admit("DELETE", stale, None) == []


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_another_nodes_slices_are_refused(operation: str) -> None:
    theirs = the_slice(node="gpu-2")
    old = theirs if operation != "CREATE" else None
    new = theirs if operation != "DELETE" else None
    assert ON_OTHER_NODE in admit(operation, old, new)


def test_another_drivers_slices_are_refused() -> None:
    foreign = the_slice(driver="gpu.nvidia.com")
    assert admit("CREATE", None, foreign) == [OTHER_DRIVER]
    unlabelled = copy.deepcopy(foreign)
    unlabelled["metadata"]["labels"] = {}
    assert admit("DELETE", unlabelled, None) == [OTHER_DRIVER]


def test_a_slice_for_all_nodes_is_refused() -> None:
    everywhere = the_slice()
    del everywhere["spec"]["nodeName"]
    everywhere["spec"]["allNodes"] = True
    assert admit("CREATE", None, everywhere) == [ON_OTHER_NODE]


@pytest.mark.parametrize("extra", [None, {}, {"other": ["x"]}])
def test_a_token_without_its_node_is_refused(extra: Any) -> None:
    assert admit("CREATE", None, the_slice(), extra=extra) == [ON_OTHER_NODE]


def test_other_users_are_not_matched() -> None:
    theirs = the_slice(node="gpu-2", driver="gpu.nvidia.com")
    assert admit("CREATE", None, theirs, username="system:node:gpu-2") == []
    assert admit("CREATE", None, theirs, username="system:serviceaccount:x:vgpu-agent-dra") == []


def test_policy_matches_the_deployed_service_account_and_driver_and_is_bound() -> None:
    docs = render("overlays/dra-hardened")
    daemonset = one(docs, "DaemonSet")
    namespace = daemonset["metadata"]["namespace"]
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    (condition,) = policy()["spec"]["matchConditions"]
    assert f"system:serviceaccount:{namespace}:{account}" in condition["expression"]
    assert one(docs, "DeviceClass")["metadata"]["name"] == DEFAULT_DRIVER
    binding = one(docs, "ValidatingAdmissionPolicyBinding", policy()["metadata"]["name"])
    assert binding["spec"]["policyName"] == policy()["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy()["spec"]["failurePolicy"] == "Fail"
    rules = policy()["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [{
        "apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["resourceslices"],
    }]


def test_the_node_guard_covers_the_dra_agent_too() -> None:
    node_guard = policy("vgpu-agent-node-guard")
    (condition,) = node_guard["spec"]["matchConditions"]
    cel = celpy()
    program = cel.Environment().program(cel.Environment().compile(condition["expression"]))
    for user, matched in ((AGENT, True), ("system:serviceaccount:vgpu-system:vgpu-agent", True),
                          ("system:serviceaccount:vgpu-system:other", False)):
        request = cel.json_to_cel({"userInfo": {"username": user}})
        assert bool(program.evaluate({"request": request})) is matched, user

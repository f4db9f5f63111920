"""The node guard (deploy/components/node-guard): its admission policy, evaluated with a CEL
interpreter on the requests the agent really sends and on the ones it must refuse.

This checks the expressions' logic; the API server's CEL type-checker does not run here."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from tests.fakes.kubeapi import gpu, merge_patch
from tests.integration.deploy_support import CEL_PATH, one, render
from vgpu_agent.kube.labels import labels_patch, node_labels

AGENT = "system:serviceaccount:vgpu-system:vgpu-agent"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


def celpy() -> Any:
    if not (CEL_PATH / "celpy").is_dir():
        raise AssertionError(f"cel-python missing at {CEL_PATH}: run scripts/install-tools")
    if str(CEL_PATH) not in sys.path:
        sys.path.append(str(CEL_PATH))  # after the project's own packages, never before
    import celpy as module

    return module


def policy() -> dict[str, Any]:
    return one(render("overlays/hardened"), "ValidatingAdmissionPolicy")


def admit(old: dict[str, Any], new: dict[str, Any], username: str, extra: Any) -> list[str]:
    """Evaluate the policy as the API server would: match conditions, variables, validations.
    Returns the messages of failed validations ([] = allowed, or not matched)."""
    cel = celpy()
    env = cel.Environment()
    spec = policy()["spec"]
    user: dict[str, Any] = {"username": username}
    if extra is not None:
        user["extra"] = extra
    activation = {
        "object": cel.json_to_cel(new),
        "oldObject": cel.json_to_cel(old),
        "request": cel.json_to_cel({"operation": "UPDATE", "userInfo": user}),
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
    return [
        v["message"] for v in spec["validations"] if not run(v["expression"], variables)
    ]


def node(name: str = "gpu-1", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": "10.0.0.0/24"},
    }


BOUND = {NODE_NAME_KEY: ["gpu-1"]}


def test_the_agents_own_label_patch_is_allowed() -> None:
    old = node(labels={"vgpu.io/stale": "1"})
    desired = node_labels([gpu(0), gpu(1)], 4, "0.1.0")
    patch = {"metadata": {"labels": labels_patch(old["metadata"]["labels"], desired)}}
    new = merge_patch(old, patch)
    assert "vgpu.io/stale" not in new["metadata"]["labels"]
    assert admit(old, new, AGENT, BOUND) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"metadata": {"labels": {"team": "ml"}}}, "only add or change labels under vgpu.io/"),
        (
            {"metadata": {"labels": {"kubernetes.io/hostname": "x"}}},
            "only add or change labels under vgpu.io/",
        ),
        (
            {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
            "only remove labels under vgpu.io/",
        ),
        ({"metadata": {"annotations": {"a": "b"}}}, "may not change node annotations"),
        ({"spec": {"unschedulable": True}}, "may not change the node's spec"),
        (
            {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}},
            "may not change the node's spec",
        ),
    ],
)
def test_anything_else_on_its_node_is_refused(change: dict[str, Any], message: str) -> None:
    old = node()
    new = merge_patch(old, change)
    assert message in " ".join(admit(old, new, AGENT, BOUND))


def test_another_node_is_refused() -> None:
    old = node("gpu-2")
    new = merge_patch(old, {"metadata": {"labels": {"vgpu.io/gpu.count": "1"}}})
    assert admit(old, new, AGENT, BOUND) == ["the vgpu-agent may only change the node it runs on"]


@pytest.mark.parametrize("extra", [None, {}, {"other": ["x"]}])
def test_tokens_without_a_node_name_skip_only_the_node_check(extra: Any) -> None:
    old = node("gpu-2")
    allowed = merge_patch(old, {"metadata": {"labels": {"vgpu.io/gpu.count": "1"}}})
    assert admit(old, allowed, AGENT, extra) == []
    refused = merge_patch(old, {"metadata": {"labels": {"team": "x"}}})
    assert admit(old, refused, AGENT, extra) != []


def test_other_users_are_not_matched() -> None:
    old = node()
    new = merge_patch(old, {"spec": {"unschedulable": True}, "metadata": {"labels": {"a": "b"}}})
    assert admit(old, new, "system:node:gpu-1", None) == []
    assert admit(old, new, "system:serviceaccount:other:vgpu-agent", BOUND) == []


def test_policy_matches_the_deployed_service_account_and_is_bound() -> None:
    docs = render("overlays/hardened")
    daemonset = one(docs, "DaemonSet", "vgpu-agent")
    namespace = daemonset["metadata"]["namespace"]
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    (condition,) = policy()["spec"]["matchConditions"]
    assert f"system:serviceaccount:{namespace}:{account}" in condition["expression"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy()["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy()["spec"]["failurePolicy"] == "Fail"


def test_a_node_without_labels_or_annotations_is_handled() -> None:
    old = copy.deepcopy(node())
    del old["metadata"]["labels"], old["metadata"]["annotations"]
    new = merge_patch(old, {"metadata": {"labels": {"vgpu.io/gpu.count": "0"}}})
    assert admit(old, new, AGENT, BOUND) == []

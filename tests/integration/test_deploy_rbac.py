"""The RBAC in deploy/ grants exactly the API calls the agent makes, nothing more.

The calls are taken two ways: recorded at the fake API server while each part of the agent does
everything it can do, and read from the code (every Kubernetes API method it calls). Both must
agree with each other and, per deployed mode (device plugin: base; DRA: overlays/dra), with the
rules bound to that DaemonSet's service account.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.fakes.kubeapi import NODE, Change, FakeKubeAPI, gpu
from tests.integration.deploy_support import REPO, one, render
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.claims import ClaimReader, ClaimReadError
from vgpu_agent.dra.slices import slice_name
from vgpu_agent.kube.node import NodeIntegration
from vgpu_agent.kube.pods import NodePods
from vgpu_agent.kube.resourceslices import ResourceSlicePublisher
from vgpu_agent.throttle.podpolicy import PodPolicyRules, resolve


class Access(NamedTuple):
    group: str
    resource: str
    verb: str
    namespace: str | None  # None: cluster-scoped


Rule = tuple[str, str, str]  # (group, resource, verb)

# Kubernetes API client methods -> what RBAC must allow (namespace filled in from the call).
CLIENT_METHODS: dict[str, set[Rule]] = {
    "read_node": {("", "nodes", "get")},
    "patch_node": {("", "nodes", "patch")},
    "create_namespaced_event": {("", "events", "create")},
    # list_* with watch=True is a watch
    "list_resource_slice": {
        ("resource.k8s.io", "resourceslices", "list"),
        ("resource.k8s.io", "resourceslices", "watch"),
    },
    "create_resource_slice": {("resource.k8s.io", "resourceslices", "create")},
    "replace_resource_slice": {("resource.k8s.io", "resourceslices", "update")},
    "delete_resource_slice": {("resource.k8s.io", "resourceslices", "delete")},
    "read_namespaced_resource_claim": {("resource.k8s.io", "resourceclaims", "get")},
    # called twice: a list, then a watch from the list's resourceVersion
    "list_pod_for_all_namespaces": {("", "pods", "list"), ("", "pods", "watch")},
    "create_namespaced_pod_eviction": {("", "pods/eviction", "create")},
}

# Granted ahead of the code that makes the call: excused as unused only while no code calls it.
GRANTED_AHEAD: dict[Rule, str] = {}

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete", "GET": "get"}


def access_of(method: str, path: str, query: str = "") -> Access:
    match = _PATH.match(path)
    assert match, f"not a Kubernetes resource path: {path}"
    verb = _VERBS[method]
    if verb == "get" and not match["name"]:
        watching = re.search(r"(^|&)watch=(1|t|T|true|True|TRUE)(&|$)", query)
        verb = "watch" if watching else "list"
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    return Access(match["group"] or "", resource, verb, match["ns"])


def granted(docs: list[dict[str, Any]], service_account: tuple[str, str]) -> set[Access]:
    """Every (group, resource, verb, namespace) the service account is granted."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    grants: set[Access] = set()
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = {
            (s["namespace"], s["name"]) for s in binding["subjects"] if s["kind"] == "ServiceAccount"
        }
        if service_account not in subjects:
            continue
        namespace = binding["metadata"].get("namespace")  # None for a ClusterRoleBinding
        ref = binding["roleRef"]
        role = roles[ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]]
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"wildcard in {role}"
                        grants.add(Access(group, resource, verb, namespace))
    return grants


def allowed(call: Access, grants: set[Access]) -> bool:
    cluster_wide = call._replace(namespace=None)
    return call in grants or cluster_wide in grants


def methods_called_in_code() -> set[str]:
    """Names of the API client methods vgpu_agent uses (the client lives in the API adapters)."""
    package = REPO / "vgpu_agent"
    users = []
    called = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        imports = {
            alias.name if isinstance(node, ast.Import) else (node.module or "")
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        if not any(name.startswith("kubernetes_asyncio") for name in imports):
            continue
        users.append(path.relative_to(REPO).as_posix())
        for node in ast.walk(tree):
            # `self._api.read_node(...)` or a method handed on: `self._call(self._api.read_node)`
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr in ("_api", "_core_api")
            ):
                called.add(node.attr)
    # the API adapters: kube/ (node, ResourceSlices) and dra/ (claim reads)
    assert users and all(u.startswith(("vgpu_agent/kube/", "vgpu_agent/dra/")) for u in users), (
        users
    )
    return called


async def exercise_everything(tmp_path: Path, namespace: str) -> list[Access]:
    """Drive every API path of the node integration: label set and removal, a conflict, events
    for unhealthy and recovered, a lost answer; the pod list and watch sharing its client, and
    an event on a pod whose annotation is refused."""
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE, {"vgpu.io/stale": "x", "other": "y"})
    api.add_pod("job", "team-a", annotations={"vgpu.io/core-policy": "fastest"})
    node = NodeIntegration(
        NODE,
        str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        environ={"POD_NAMESPACE": namespace},
        request_timeout=0.2,
        backoff_initial=0.01,
        backoff_cap=0.05,
    )
    pods = NodePods(NODE, node.api_configuration, request_timeout=0.2, backoff_initial=0.01)
    task = asyncio.create_task(node.run())
    pod_task = asyncio.create_task(pods.run())
    try:
        api.after("GET", lambda: api.set_labels(NODE, other="z"), path="/nodes/")
        api.stall(0.4, method="POST", handled=True)
        await node.publish_labels([gpu(0)], 4, "1")
        node.on_health_change(Change("GPU-1", False, "XID", 79))
        node.on_health_change(Change("GPU-1", True, "recovered", None))
        async with asyncio.timeout(10):  # a watch stays open: no request end to wake on
            while pods.watches == 0:
                await asyncio.sleep(0.02)
        job = pods.pod("team-a", "job")
        assert job is not None
        for refusal in resolve(job.annotations, "team-a", "main", PodPolicyRules()).refusals:
            pods.report_refusal(job, refusal)
        victim = api.add_pod("train-0", "team-a")
        node.on_container_breach("team-a", "train-0", victim["metadata"]["uid"], "main",
                                 "over its limits", evict=True)
        await api.wait_for(
            lambda: len(api.all_events()) == 5 and api.evicted
            and "vgpu.io/gpu.count" in api.nodes[NODE]["metadata"]["labels"],
            within=10,
        )
    finally:
        for running in (pod_task, task):
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        await api.stop()
    return [access_of(r.method, r.path, r.query) for r in api.requests]


async def exercise_resource_slices(tmp_path: Path, namespace: str) -> list[Access]:
    """Drive every API path of the ResourceSlice publisher: create, update on a health change,
    a conflict, a duplicate removed, the watch."""
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    publisher = ResourceSlicePublisher(
        NODE,
        "gpu.vgpu.io",
        [gpu(0)],
        Split(2),
        kubeconfig=str(api.write_kubeconfig(tmp_path / "kubeconfig-dra")),
        request_timeout=0.5,
        backoff_initial=0.01,
        backoff_cap=0.05,
    )
    task = asyncio.create_task(publisher.run())
    name = slice_name(NODE, "gpu.vgpu.io")
    try:
        await publisher.wait_for(lambda p: p.published is not None)
        async with asyncio.timeout(5):  # the watch is open: the next slice GET is a reconcile's
            while not api.resources.watchers:
                await asyncio.sleep(0.01)
        mine = api.resources.get("resourceslices", name)
        api.resources.create("resourceslices", "", {
            "metadata": {"name": "duplicate"}, "spec": mine["spec"]})
        api.before("PUT", lambda: api.resources.edit(
            "resourceslices", name, lambda s: s["metadata"].update(annotations={"a": "b"})),
            path="/resourceslices/")
        publisher.on_health_change(Change(gpu(0).uuid, False, "critical XID 48", 48))
        await publisher.wait_for(
            lambda p: p.published is not None and p.published.generation >= 2
            and len(api.resources.slices()) == 1
        )
        assert any(r.status == 409 for r in api.requests if r.method == "PUT")
        assert any("watch=" in r.query for r in api.requests)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.stop()
    return [access_of(r.method, r.path, r.query) for r in api.requests]


async def exercise_claim_reads(tmp_path: Path, namespace: str) -> list[Access]:
    """The DRA driver reads each claim it prepares; a claim that is gone is read too."""
    api = FakeKubeAPI()
    await api.start()
    body = {"metadata": {"name": "train"}, "spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.vgpu.io"}}]}}}
    api.resources.create("resourceclaims", "team-a", body)
    reader = ClaimReader(str(api.write_kubeconfig(tmp_path / "kubeconfig-claims")))
    try:
        await reader.read("team-a", "train")
        with contextlib.suppress(ClaimReadError):
            await reader.read("team-a", "deleted")
    finally:
        await reader.close()
        await api.stop()
    return [access_of(r.method, r.path, r.query) for r in api.requests]


Exercise = Callable[[Path, str], Awaitable[list[Access]]]
# What each deployed mode runs. DRA parts that call the API add their exercise here.
DRA_EXERCISES: list[Exercise] = [exercise_resource_slices, exercise_claim_reads]
EXERCISES: dict[str, list[Exercise]] = {
    "base": [exercise_everything],
    "overlays/dra": [exercise_everything, *DRA_EXERCISES],
}


def rules(calls: set[Access]) -> set[Rule]:
    return {(c.group, c.resource, c.verb) for c in calls}


@pytest.mark.parametrize("variant", sorted(EXERCISES))
async def test_cluster_role_grants_exactly_what_the_agent_calls(
    tmp_path: Path, variant: str
) -> None:
    docs = render(variant)
    daemonset = one(docs, "DaemonSet")
    namespace = daemonset["metadata"]["namespace"]
    service_account = (namespace, daemonset["spec"]["template"]["spec"]["serviceAccountName"])
    grants = granted(docs, service_account)

    calls: set[Access] = set()
    for exercise in EXERCISES[variant]:
        calls |= set(await exercise(tmp_path, namespace))
    denied = {c for c in calls if not allowed(c, grants)}
    assert not denied, f"the agent makes calls its RBAC does not allow: {denied}"
    in_code = methods_called_in_code()
    unused = {
        g
        for g in grants
        if not any(allowed(c, {g}) for c in calls)
        and GRANTED_AHEAD.get((g.group, g.resource, g.verb), "") in ("", *in_code)
    }
    assert not unused, f"RBAC grants what the agent never uses: {unused}"


async def test_every_api_call_in_the_code_is_known_and_exercised(tmp_path: Path) -> None:
    in_code = methods_called_in_code()
    unknown = in_code - set(CLIENT_METHODS)
    assert not unknown, (
        f"new API calls {unknown}: add them to the RBAC in deploy/ and to CLIENT_METHODS here"
    )
    exercised: set[Access] = set()
    for exercise in {e for mode in EXERCISES.values() for e in mode}:
        exercised |= set(await exercise(tmp_path, "vgpu-system"))
    from_code = set().union(*(CLIENT_METHODS[m] for m in in_code))
    assert from_code == rules(exercised), (
        "the recorded runs did not exercise every API call in the code "
        f"(add an exercise to EXERCISES / DRA_EXERCISES): {from_code ^ rules(exercised)}"
    )


def test_dra_grants_are_the_base_ones_plus_resource_slices_and_claims() -> None:
    base = render("base")
    dra = render("overlays/dra")
    ns = one(base, "DaemonSet")["metadata"]["namespace"]
    base_grants = granted(base, (ns, "vgpu-agent"))
    dra_grants = granted(dra, (ns, "vgpu-agent-dra"))
    slices = {
        Access("resource.k8s.io", "resourceslices", verb, None)
        for verb in ("list", "watch", "create", "update", "delete")
    }
    claims = {Access("resource.k8s.io", "resourceclaims", "get", None)}
    assert dra_grants == base_grants | slices | claims
    # the device-plugin agents get none of it
    assert granted(base + dra, (ns, "vgpu-agent")) == base_grants


def test_node_events_grant_is_namespaced_and_the_rest_cluster_wide() -> None:
    docs = render("base")
    daemonset = one(docs, "DaemonSet", "vgpu-agent")
    namespace = daemonset["metadata"]["namespace"]
    grants = granted(docs, (namespace, "vgpu-agent"))
    # events cluster-wide: an event about a pod lives in the pod's namespace
    assert grants == {
        Access("", "nodes", "get", None),
        Access("", "nodes", "patch", None),
        Access("", "events", "create", namespace),
        # pods of any namespace run on the node: their list, watch and events are cluster-wide
        Access("", "pods", "list", None),
        Access("", "pods", "watch", None),
        Access("", "events", "create", None),
        Access("", "pods/eviction", "create", None),
    }


def test_request_paths_map_to_rbac_terms() -> None:
    assert access_of("GET", "/api/v1/nodes/n1") == Access("", "nodes", "get", None)
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    assert access_of("GET", slices, "fieldSelector=x").verb == "list"
    assert access_of("GET", slices, "fieldSelector=x&watch=True").verb == "watch"
    assert access_of("PUT", slices + "/s1") == Access(
        "resource.k8s.io", "resourceslices", "update", None
    )
    assert access_of("GET", "/api/v1/pods", "fieldSelector=x&watch=True") == Access(
        "", "pods", "watch", None
    )
    assert access_of("GET", "/api/v1/pods", "watch=false") == Access("", "pods", "list", None)
    assert access_of("GET", "/api/v1/namespaces/a/events") == Access("", "events", "list", "a")
    assert access_of("POST", "/api/v1/namespaces/a/pods/p/eviction") == Access(
        "", "pods/eviction", "create", "a"
    )
    assert access_of("POST", "/apis/events.k8s.io/v1/namespaces/a/events") == Access(
        "events.k8s.io", "events", "create", "a"
    )


def test_a_grant_for_another_service_account_does_not_count() -> None:
    docs = render("base")
    assert granted(docs, ("default", "vgpu-agent")) == set()

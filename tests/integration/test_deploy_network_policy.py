"""deploy/components/metrics-network-policy: only the Prometheus namespace reaches the metrics
port, and nothing else reaches the agent pods.

The rendered policy is evaluated with NetworkPolicy's rules (the rules of a policy that selects
a pod are OR'ed; inside a peer, namespaceSelector and podSelector are AND'ed; a named port is
resolved through the selected pod's container ports) on the peers a cluster has."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.deploy_support import one, render

PROMETHEUS = {"kubernetes.io/metadata.name": "monitoring"}
TENANT = {"kubernetes.io/metadata.name": "team-a"}
AGENT_NS = {"kubernetes.io/metadata.name": "vgpu-system"}


def rendered() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = render("overlays/hardened")
    return one(docs, "NetworkPolicy"), one(docs, "DaemonSet")


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, "only matchLabels is evaluated here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def port_number(port: Any, pod_spec: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    for c in pod_spec["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
    raise AssertionError(f"named port {port!r} is not a container port of the selected pods")


def admitted(namespace_labels: dict[str, str], pod_labels: dict[str, str], port: int) -> bool:
    policy, daemonset = rendered()
    pod_spec = daemonset["spec"]["template"]["spec"]
    same_namespace = namespace_labels == AGENT_NS
    for rule in policy["spec"].get("ingress", []):
        ports = [port_number(p["port"], pod_spec) for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule.get("from", []):
            ns_ok = (
                matches(peer["namespaceSelector"], namespace_labels)
                if "namespaceSelector" in peer
                else same_namespace
            )
            if ns_ok and matches(peer.get("podSelector"), pod_labels):
                return True
    return False


def test_the_policy_selects_the_agent_pods_in_their_namespace_for_ingress_only() -> None:
    policy, daemonset = rendered()
    template = daemonset["spec"]["template"]
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    assert matches(policy["spec"]["podSelector"], template["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # the agent's own calls stay open


@pytest.mark.parametrize(
    ("namespace", "pod", "port", "allowed"),
    [
        (PROMETHEUS, {"app": "prometheus"}, 9394, True),
        (PROMETHEUS, {"app": "anything"}, 9394, True),
        (PROMETHEUS, {"app": "prometheus"}, 22, False),
        (TENANT, {"app": "prometheus"}, 9394, False),  # a pod calling itself prometheus
        (TENANT, {}, 9394, False),
        (AGENT_NS, {"app.kubernetes.io/name": "vgpu-agent"}, 9394, False),
    ],
)
def test_only_the_prometheus_namespace_reaches_the_metrics_port(
    namespace: dict[str, str], pod: dict[str, str], port: int, allowed: bool
) -> None:
    assert admitted(namespace, pod, port) is allowed


def test_the_named_port_is_the_one_the_agent_serves_metrics_on() -> None:
    policy, daemonset = rendered()
    (rule,) = policy["spec"]["ingress"]
    (port,) = rule["ports"]
    assert port_number(port["port"], daemonset["spec"]["template"]["spec"]) == 9394
    assert port["protocol"] == "TCP"

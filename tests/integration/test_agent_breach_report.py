"""What the agent does with a breach its backstop found: reported on the container's pod (and the
pod evicted with `backstop_action: evict`), or said in the log with why it could not be."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from tests.integration.plugin_harness import config_for, short_dir
from vgpu_agent.agent import Agent
from vgpu_agent.throttle.backstop import Breach
from vgpu_agent.throttle.podpolicy import PodInfo

OVER = Breach("alloc-1", 0, "sm", 91.5, 32.0)


class _Pods:
    """The node's pods as the pod watch would hold them."""

    def __init__(self, *pods: PodInfo) -> None:
        self.pods = {(p.namespace, p.name): p for p in pods}

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self.pods.get((namespace, name))


class _Node:
    """The node integration's side that reports breaches."""

    def __init__(self) -> None:
        self.breaches: list[tuple[object, ...]] = []

    def on_container_breach(self, namespace: str, pod: str, uid: str, container: str,
                            what: str, evict: bool = False) -> None:
        self.breaches.append((namespace, pod, uid, container, what, evict))


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


def _agent(root, monkeypatch, action: str, owners: dict[str, tuple[str, str, str]]) -> Agent:
    agent = Agent(config_for(root, backstop_action=action))
    monkeypatch.setattr(agent.regions, "identity", owners.get)
    return agent


@pytest.mark.parametrize(("action", "evict"), [("report", False), ("evict", True)])
def test_a_breach_is_reported_on_its_pod_and_evicts_only_when_asked(root, monkeypatch, action,
                                                                   evict):
    agent = _agent(root, monkeypatch, action, {"alloc-1": ("team-a", "train-0", "main")})
    agent.pod_policies.pods = _Pods(PodInfo("uid-7", "team-a", "train-0", {}))
    node = _Node()
    agent.node = node  # type: ignore[assignment]
    with capture_logs() as logs:
        agent._on_breach(OVER)
    assert node.breaches == [("team-a", "train-0", "uid-7", "main", OVER.describe(), evict)]
    assert not [e for e in logs if e["event"] == "backstop_breach_unreported"]


@pytest.mark.parametrize(("owners", "pods", "with_node", "reason"), [
    ({}, _Pods(PodInfo("uid-7", "team-a", "train-0", {})), True, "its container is not known"),
    ({"alloc-1": ("team-a", "train-0", "main")}, _Pods(PodInfo("uid-7", "team-a", "train-0", {})),
     False, "no Kubernetes API"),
    ({"alloc-1": ("team-a", "train-0", "main")}, _Pods(), True,
     "its pod is not (yet) in the node's pod list"),
    ({"alloc-1": ("team-a", "train-0", "main")}, None, True,
     "its pod is not (yet) in the node's pod list"),
])
def test_a_breach_that_cannot_be_reported_is_said_with_why(root, monkeypatch, owners, pods,
                                                          with_node, reason):
    agent = _agent(root, monkeypatch, "evict", owners)
    agent.pod_policies.pods = pods
    node = _Node()
    agent.node = node if with_node else None  # type: ignore[assignment]
    with capture_logs() as logs:
        agent._on_breach(OVER)
    assert node.breaches == []  # nothing reported, nobody evicted on a guess
    said = [e for e in logs if e["event"] == "backstop_breach_unreported"]
    assert [(e["alloc_id"], e["reason"]) for e in said] == [("alloc-1", reason)]

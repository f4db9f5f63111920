"""Which regions get their pod's choice, when, and what they say until then."""

from __future__ import annotations

from structlog.testing import capture_logs

from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.podpolicy import PodInfo, PodPolicyRules, Refusal
from vgpu_agent.throttle.regionpolicy import RegionPolicies

UUID = "GPU-1"
RULES = PodPolicyRules(priority_namespaces=frozenset({"prod"}))


class Pods:
    def __init__(self, *pods: PodInfo) -> None:
        self.known = {(p.namespace, p.name): p for p in pods}
        self.lookups = 0

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        self.lookups += 1
        return self.known.get((namespace, name))


def region(alloc_id: str, policy: str = "strict", priority: int = 0) -> SimRegion:
    return SimRegion(alloc_id, (UUID,), (25.0,), (policy,), priority=priority)  # type: ignore[arg-type]


def setup(regions, bindings, pods):
    refused: list[tuple[str, Refusal]] = []
    policies = RegionPolicies(
        lambda: list(regions), bindings.get, RULES, pods=pods,
        on_refusal=lambda pod, refusal: refused.append((pod.uid, refusal)),
    )
    return policies, refused


def test_an_unbound_or_unknown_region_keeps_what_it_holds_and_says_default():
    fresh, unknown_pod = region("a"), region("b")
    pods = Pods()
    policies, _ = setup([fresh, unknown_pod], {"b": ("ns", "gone", "c")}, pods)
    assert policies.apply() == 0
    assert policies.source("a") == policies.source("b") == "default"
    assert (fresh.policies, fresh.priority) == (("strict",), 0)
    assert pods.lookups == 1  # only the bound region was looked up


def test_an_adopted_region_keeps_its_pods_choice_until_the_pod_is_known_again():
    adopted = region("a", "work-conserving", 30)  # written for its pod before a restart
    pods = Pods()
    policies, _ = setup([adopted], {"a": ("prod", "llm", "c")}, pods)
    policies.apply()
    assert (adopted.policies, adopted.priority) == (("work-conserving",), 30)
    assert policies.source("a") == "pod"
    pods.known[("prod", "llm")] = PodInfo("u1", "prod", "llm", {"vgpu.io/priority": "30"})
    assert policies.apply() == 1  # now known: the policy annotation is gone, strict again
    assert (adopted.policies, adopted.priority) == (("strict",), 30)


def test_writes_happen_only_on_change_and_refusals_are_handed_on_each_time():
    r = region("a")
    pod = PodInfo("u1", "team", "p", {"vgpu.io/priority": "9", "vgpu.io/core-policy": "work-conserving"})
    policies, refused = setup([r], {"a": ("team", "p", "c")}, Pods(pod))
    with capture_logs() as logs:
        assert policies.apply() == 1
        assert policies.apply() == 0
    assert r.policies == ("work-conserving",) and r.priority == 0
    assert [e["event"] for e in logs] == ["region_policy_applied"]  # logged once, not per apply
    assert [(uid, x.annotation) for uid, x in refused] == [("u1", "vgpu.io/priority")] * 2
    assert policies.writes == 1


class Broken(SimRegion):
    def set_policy(self, policy, priority):  # type: ignore[no-untyped-def]
        raise OSError("control unmapped")


def test_one_failing_region_does_not_keep_the_others_at_their_old_policy():
    broken = Broken("a", (UUID,), (25.0,), ("strict",))
    good = region("b")
    pods = Pods(PodInfo("u1", "ns", "p", {"vgpu.io/core-policy": "work-conserving"}))
    policies, _ = setup([broken, good], {"a": ("ns", "p", "x"), "b": ("ns", "p", "y")}, pods)
    with capture_logs():
        policies.apply()
    assert good.policies == ("work-conserving",) and policies.failures == 1


def test_regions_gone_are_forgotten():
    regions = [region("a")]
    policies, _ = setup(regions, {}, Pods())
    policies.apply()
    assert "a" in policies._sources
    regions.clear()
    policies.apply()
    assert policies._sources == {}

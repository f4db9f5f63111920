"""A pod's annotations within the node's rules: what applies, what is refused and why."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_agent.throttle.podpolicy import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    PodPolicyRules,
    relevant,
    resolve,
)

RULES = PodPolicyRules(
    default_policy="strict",
    allowed_policies=frozenset({"strict", "work-conserving"}),
    priority_max=50,
    priority_namespaces=frozenset({"inference"}),
)


def test_no_annotations_is_the_node_default():
    chosen = resolve({}, "team-a", "main", RULES)
    assert (chosen.policy, chosen.priority, chosen.source, chosen.refusals) == (
        "strict", 0, "default", ()
    )


def test_pod_annotations_apply_to_every_container():
    chosen = resolve(
        {"vgpu.io/core-policy": "work-conserving", "vgpu.io/priority": "-5"}, "batch", "x", RULES
    )
    assert (chosen.policy, chosen.priority, chosen.source) == ("work-conserving", -5, "pod")


def test_a_container_annotation_wins_over_the_pods():
    annotations = {
        "vgpu.io/core-policy": "work-conserving",
        "vgpu.io/core-policy.server": "strict",
        "vgpu.io/priority.server": "40",
    }
    server = resolve(annotations, "inference", "server", RULES)
    sidecar = resolve(annotations, "inference", "sidecar", RULES)
    assert (server.policy, server.priority) == ("strict", 40)
    assert (sidecar.policy, sidecar.priority) == ("work-conserving", 0)


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("Strict", "allowed values are strict, work-conserving"),
        ("", "allowed values are strict, work-conserving"),
        ("off", "this node lets pods choose strict, work-conserving"),
    ],
)
def test_a_refused_policy_names_the_annotation_and_what_is_allowed(value, allowed):
    chosen = resolve({"vgpu.io/core-policy": value, "vgpu.io/priority": "-1"}, "ns", "c", RULES)
    assert chosen.policy == "strict"  # the node default
    assert chosen.priority == -1 and chosen.source == "pod"  # the other field still applies
    (refusal,) = chosen.refusals
    assert refusal.annotation == "vgpu.io/core-policy" and refusal.value == value
    assert allowed in refusal.message
    assert "the node default policy 'strict' applies" in refusal.message


def test_a_node_that_allows_no_policy_says_so():
    rules = PodPolicyRules(allowed_policies=frozenset())
    (refusal,) = resolve({"vgpu.io/core-policy": "strict"}, "ns", "c", rules).refusals
    assert "pods may not choose a policy here" in refusal.message


@pytest.mark.parametrize(
    ("namespace", "value", "allowed"),
    [
        ("inference", "51", "up to 50"),
        ("inference", "101", f"range over {PRIORITY_MIN}..{PRIORITY_MAX}"),
        ("inference", "-101", f"range over {PRIORITY_MIN}..{PRIORITY_MAX}"),
        ("team-a", "1", "above 0 are allowed only in inference (not 'team-a')"),
        ("inference", "ten", "an integer in -100..100"),
        ("inference", "1.5", "an integer in -100..100"),
        ("inference", " 5", "an integer in -100..100"),
        ("inference", "9" * 40, "an integer in -100..100"),
    ],
)
def test_a_refused_priority_names_what_is_allowed_and_the_default_applies(
    namespace, value, allowed
):
    chosen = resolve({"vgpu.io/priority.c": value}, namespace, "c", RULES)
    assert (chosen.policy, chosen.priority, chosen.source) == ("strict", 0, "default")
    (refusal,) = chosen.refusals
    assert refusal.annotation == "vgpu.io/priority.c"
    assert allowed in refusal.message and "node default priority 0 applies" in refusal.message


def test_priorities_at_or_below_the_default_need_no_allow_list():
    assert resolve({"vgpu.io/priority": "0"}, "team-a", "c", RULES).priority == 0
    assert resolve({"vgpu.io/priority": "-100"}, "team-a", "c", RULES).priority == -100
    assert resolve({"vgpu.io/priority": "+50"}, "inference", "c", RULES).priority == 50


def test_without_an_allow_list_no_namespace_goes_above_the_default():
    rules = PodPolicyRules()
    (refusal,) = resolve({"vgpu.io/priority": "1"}, "kube-system", "c", rules).refusals
    assert "allowed only in no namespace" in refusal.message


def test_both_fields_refused_give_two_refusals():
    chosen = resolve({"vgpu.io/core-policy": "x", "vgpu.io/priority": "y"}, "n", "c", RULES)
    assert [r.annotation for r in chosen.refusals] == ["vgpu.io/core-policy", "vgpu.io/priority"]
    assert chosen.source == "default"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"default_policy": "fast"}, "default policy 'fast'"),
        ({"allowed_policies": frozenset({"fair"})}, r"pod policies \['fair'\]"),
        ({"priority_max": 101}, "priority_max=101"),
    ],
)
def test_bad_rules_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PodPolicyRules(**kwargs)


def test_only_the_annotations_read_here_are_kept():
    kept = relevant(
        {
            "vgpu.io/core-policy": "strict",
            "vgpu.io/priority.main": "3",
            "kubectl.kubernetes.io/last-applied-configuration": "{...}",
            "vgpu.io/other": "x",
        }
    )
    assert kept == {"vgpu.io/core-policy": "strict", "vgpu.io/priority.main": "3"}


@given(st.dictionaries(st.text(max_size=40), st.text(max_size=12), max_size=6), st.text(max_size=8))
def test_any_annotations_resolve_within_the_rules(annotations, container):
    chosen = resolve(annotations, "team-a", container, RULES)
    assert chosen.policy in RULES.allowed_policies | {RULES.default_policy}
    assert PRIORITY_MIN <= chosen.priority <= RULES.default_priority  # team-a is not allowed more
    mine = [k for k in annotations if k.startswith(("vgpu.io/core-policy", "vgpu.io/priority"))]
    if chosen.source == "pod":
        assert mine
    assert len(chosen.refusals) <= min(2, len(mine))


def test_a_huge_refused_value_is_shortened_in_the_refusal():
    (refusal,) = resolve({"vgpu.io/core-policy": "x" * 100_000}, "ns", "c", RULES).refusals
    assert len(refusal.value) < 100 and refusal.value.endswith("...")
    assert len(refusal.message) < 400

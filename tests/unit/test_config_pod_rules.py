"""The node's rules for pod annotations: keys, layers and what a bad value says."""

from __future__ import annotations

import pytest

from vgpu_agent.agent import pod_policy_rules
from vgpu_agent.config import ConfigError, ConfigSources, build_config


def build(file_text=None, env=None, flags=None):
    return build_config(ConfigSources(file_text=file_text, env=env or {}, flags=flags or {}))


def test_defaults_let_pods_choose_strict_or_work_conserving_and_no_higher_priority():
    config = build()
    assert config.pod_core_policies == ("strict", "work-conserving")
    assert config.pod_priority_max == 100
    assert config.pod_priority_namespaces == ()
    rules = pod_policy_rules(config)
    assert rules.default_policy == "strict" and rules.default_priority == 0
    assert rules.allowed_policies == {"strict", "work-conserving"}
    assert rules.priority_namespaces == frozenset()


def test_file_environment_and_flags_each_set_the_rules():
    text = "pod_core_policies: [off, strict]\npod_priority_namespaces: [prod, serving]\n"
    env = {"VGPU_AGENT_POD_PRIORITY_MAX": "30", "VGPU_AGENT_POD_PRIORITY_NAMESPACES": "prod"}
    config = build(text, env, {"pod_core_policies": "work-conserving"})
    assert config.pod_core_policies == ("work-conserving",)  # the flag wins
    assert config.pod_priority_namespaces == ("prod",)  # the environment wins over the file
    assert config.pod_priority_max == 30
    assert build(file_text="pod_core_policies: []\n").pod_core_policies == ()
    # YAML reads a bare `off` as false; it still means the policy
    assert build(file_text=text).pod_core_policies == ("off", "strict")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("pod_core_policies", "strict,fast", "from off, strict, work-conserving"),
        ("pod_priority_max", "101", "integer in -100..100"),
        ("pod_priority_max", "high", "integer in -100..100"),
        ("pod_priority_namespaces", "prod,Team_A", "namespace names"),
        ("pod_priority_namespaces", "x" * 64, "at most 63"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as err:
        build(flags={key: value})
    assert err.value.key == key and expected in str(err.value)


@pytest.mark.parametrize(
    "text",
    ["pod_priority_max: true\n", "pod_priority_namespaces: 5\n", "pod_core_policies: {a: 1}\n"],
)
def test_wrong_yaml_types_are_refused(text):
    with pytest.raises(ConfigError):
        build(file_text=text)

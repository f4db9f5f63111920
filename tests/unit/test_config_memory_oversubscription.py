"""memory_oversubscription (off | spill) and spill_host_memory_fraction: layers, bounds, and how
they combine with memory_scaling and the older allow_memory_oversubscription."""

import argparse

import pytest

from vgpu_agent.cli import _parser, load_config
from vgpu_agent.config import ConfigError, ConfigSources, build_config


def build(file_text=None, env=None, flags=None):
    return build_config(ConfigSources(file_text=file_text, env=env or {}, flags=flags or {}))


def test_off_by_default_with_half_the_host_memory():
    config = build()
    assert config.memory_oversubscription == "off"
    assert config.spill_host_memory_fraction == 0.5


def test_spill_alone_accepts_scaling_above_one():
    config = build("memory_scaling: 1.5\nmemory_oversubscription: spill\n")
    assert (config.memory_scaling, config.memory_oversubscription) == (1.5, "spill")
    assert config.allow_memory_oversubscription is False


def test_the_older_switch_still_accepts_scaling_above_one_without_spilling():
    config = build("memory_scaling: 2\nallow_memory_oversubscription: true\n")
    assert config.memory_oversubscription == "off"


def test_scaling_above_one_without_either_names_both_choices():
    with pytest.raises(ConfigError) as err:
        build(env={"VGPU_AGENT_MEMORY_SCALING": "2"})
    assert err.value.key == "memory_scaling"
    assert "memory_oversubscription: spill" in str(err.value)
    assert "allow_memory_oversubscription: true" in str(err.value)


def test_environment_and_flag_layers():
    env = {"VGPU_AGENT_MEMORY_OVERSUBSCRIPTION": "spill", "VGPU_AGENT_SPILL_HOST_MEMORY_FRACTION": "0.25"}
    assert build(env=env).spill_host_memory_fraction == 0.25
    assert build(env=env, flags={"memory_oversubscription": "off"}).memory_oversubscription == "off"


def test_command_line_flags_reach_the_config():
    args = _parser().parse_args(
        ["run", "--memory-scaling", "2", "--memory-oversubscription", "spill",
         "--spill-host-memory-fraction", "0.8"]
    )
    assert isinstance(args, argparse.Namespace)
    config = load_config(args, {})
    assert (config.memory_oversubscription, config.spill_host_memory_fraction) == ("spill", 0.8)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("memory_oversubscription", "swap", "must be one of off, spill"),
        ("memory_oversubscription", "", "must be one of off, spill"),
        ("spill_host_memory_fraction", "0", "must be a number > 0 and <= 1"),
        ("spill_host_memory_fraction", "1.5", "must be a number > 0 and <= 1"),
        ("spill_host_memory_fraction", "half", "must be a number > 0 and <= 1"),
        ("spill_host_memory_fraction", "nan", "must be a number > 0 and <= 1"),
    ],
)
def test_bad_values_are_named_with_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as err:
        build(env={"VGPU_AGENT_" + key.upper(): value})
    assert err.value.key == "VGPU_AGENT_" + key.upper()
    assert repr(value) in str(err.value) and expected in str(err.value)


def test_a_bare_off_in_yaml_is_off_and_true_is_not_a_choice():
    assert build("memory_oversubscription: off\n").memory_oversubscription == "off"
    with pytest.raises(ConfigError, match="must be one of off, spill"):
        build("memory_oversubscription: true\n")

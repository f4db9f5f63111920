"""Configuration: defaults < file < environment < flags, and every bad value named."""

import pytest

from vgpu_agent.config import Config, ConfigError, ConfigSources, build_config


def build(file_text=None, env=None, flags=None):
    return build_config(ConfigSources(file_text=file_text, env=env or {}, flags=flags or {}))


def test_defaults_match_the_documented_values():
    config = build()
    assert config == Config()
    assert config.resource_name == "nvidia.com/gpu"
    assert config.xid_ignore == (13, 31, 43, 45, 68, 109)
    assert config.allocation_policy == "spread"
    assert config.metrics_host_port() == ("0.0.0.0", 9394)


def test_file_then_environment_then_flags_override_in_order():
    text = "split_count: 3\nmemory_scaling: 0.5\nallocation_policy: binpack\n"
    env = {"VGPU_AGENT_SPLIT_COUNT": "5", "VGPU_AGENT_MEMORY_SCALING": "0.75", "UNRELATED": "x"}
    config = build(text, env, {"split_count": "7"})
    assert config.split_count == 7  # flag beats env beats file
    assert config.memory_scaling == 0.75  # env beats file
    assert config.allocation_policy == "binpack"  # file beats default


def test_node_name_defaults_from_node_name_variable():
    assert build(env={"NODE_NAME": "gpu-7"}).node_name == "gpu-7"
    assert build(env={"NODE_NAME": "gpu-7"}, flags={"node_name": "x"}).node_name == "x"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("split_count", "0", "integer >= 1"),
        ("split_count", "two", "integer >= 1"),
        ("memory_scaling", "0", "> 0"),
        ("memory_scaling", "nan", "> 0"),
        ("cores_scaling", "1.5", "<= 1"),
        ("allocation_policy", "random", "spread, binpack"),
        ("device_list_strategy", "volume-mounts", "envvar, cdi"),
        ("backend", "cuda", "nvml, sim"),
        ("resource_name", "gpu", "extended resource name"),
        ("resource_name", "kubernetes.io/gpu", "outside kubernetes.io"),
        ("resource_name", "nvidia.com/g pu", "extended resource name"),
        ("metrics_address", "9394", "HOST:PORT"),
        ("metrics_address", "0.0.0.0:99999", "port 0-65535"),
        ("state_dir", "relative/dir", "absolute path"),
        ("xid_ignore", "13,abc", "XID numbers"),
        ("log_format", "xml", "json, console"),
        ("health_recovery_seconds", "-1", ">= 0"),
        ("sim_gpus", "2xA100", "GB"),
    ],
)
def test_bad_flag_values_name_key_value_and_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as err:
        build(flags={key: value})
    message = str(err.value)
    assert key in message
    assert repr(value) in message
    assert expected in message
    assert "command line" in message


def test_unknown_file_key_is_rejected_with_the_known_keys():
    with pytest.raises(
        ConfigError, match=r"splitcount=3 \(from cfg.yaml\): unknown key; known keys: "
    ):
        build_config(ConfigSources(file_text="splitcount: 3\n", file_name="cfg.yaml"))


def test_unknown_environment_key_names_the_variable():
    with pytest.raises(ConfigError, match="VGPU_AGENT_SPLITS='2'"):
        build(env={"VGPU_AGENT_SPLITS": "2"})


def test_wrong_yaml_types_are_rejected():
    with pytest.raises(ConfigError, match="split_count=True"):
        build("split_count: true\n")
    with pytest.raises(ConfigError, match="allocation_policy=3"):
        build("allocation_policy: 3\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        build("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be valid YAML"):
        build("split_count: [\n")


def test_memory_oversubscription_needs_the_explicit_switch():
    with pytest.raises(ConfigError, match="allow_memory_oversubscription"):
        build(flags={"memory_scaling": "1.5"})
    config = build(flags={"memory_scaling": "1.5", "allow_memory_oversubscription": True})
    assert config.memory_scaling == 1.5


def test_xid_list_accepts_yaml_lists_and_comma_strings():
    assert build("xid_ignore: [79, 13, 13]\n").xid_ignore == (13, 79)
    assert build(env={"VGPU_AGENT_XID_IGNORE": "48, 63"}).xid_ignore == (48, 63)
    assert build(env={"VGPU_AGENT_XID_IGNORE": ""}).xid_ignore == ()


def test_plugin_socket_path_must_fit_a_unix_address():
    with pytest.raises(ConfigError, match="107 bytes"):
        build(flags={"device_plugin_dir": "/" + "d" * 120})

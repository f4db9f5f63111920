"""The DRA keys: defaults, each layer, bad values named, socket paths, and what DRA mode needs."""

import pytest

from vgpu_agent.cli import main
from vgpu_agent.config import ConfigError, ConfigSources, build_config, missing_for_mode


def build(env=None, flags=None):
    return build_config(ConfigSources(env=env or {}, flags=flags or {}))


def test_defaults_are_the_device_plugin_and_the_kubelet_paths():
    config = build()
    assert config.mode == "device-plugin"
    assert config.dra_driver_name == "gpu.vgpu.io"
    assert config.plugin_registry_dir == "/var/lib/kubelet/plugins_registry"
    assert config.dra_plugin_dir == "/var/lib/kubelet/plugins"
    assert config.cdi_dir == "/var/run/cdi"
    assert config.dra_socket == "/var/lib/kubelet/plugins/gpu.vgpu.io/dra.sock"
    assert config.registration_socket == "/var/lib/kubelet/plugins_registry/gpu.vgpu.io-reg.sock"


def test_every_key_comes_from_environment_and_flags():
    env = {
        "VGPU_AGENT_MODE": "dra",
        "VGPU_AGENT_DRA_DRIVER_NAME": "vgpu.example.com",
        "VGPU_AGENT_PLUGIN_REGISTRY_DIR": "/r",
        "VGPU_AGENT_DRA_PLUGIN_DIR": "/p/",
        "VGPU_AGENT_CDI_DIR": "/etc/cdi",
    }
    config = build(env)
    assert (config.mode, config.dra_driver_name, config.cdi_dir) == (
        "dra",
        "vgpu.example.com",
        "/etc/cdi",
    )
    assert config.dra_socket == "/p/vgpu.example.com/dra.sock"
    assert config.registration_socket == "/r/vgpu.example.com-reg.sock"
    assert build(env, {"mode": "device-plugin"}).mode == "device-plugin"  # flag beats env


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("mode", "both", "device-plugin, dra"),
        ("dra_driver_name", "GPU.vgpu.io", "DNS subdomain"),
        ("dra_driver_name", "gpu_vgpu.io", "DNS subdomain"),
        ("dra_driver_name", "-gpu.io", "DNS subdomain"),
        ("dra_driver_name", "a." + "b" * 64 + ".io", "DNS subdomain"),
        ("dra_driver_name", "", "DNS subdomain"),
        ("plugin_registry_dir", "plugins_registry", "absolute path"),
        ("dra_plugin_dir", "relative", "absolute path"),
        ("cdi_dir", "cdi", "absolute path"),
    ],
)
def test_bad_values_are_named_with_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as caught:
        build(flags={key: value})
    assert caught.value.key == key
    assert expected in str(caught.value)
    assert repr(value) in str(caught.value)


def test_socket_paths_must_fit_a_unix_address_in_dra_mode_only():
    long_dir = "/" + "d" * 100
    assert build(flags={"dra_plugin_dir": long_dir}).dra_plugin_dir == long_dir  # not used
    with pytest.raises(ConfigError, match="107 bytes") as caught:
        build(flags={"mode": "dra", "dra_plugin_dir": long_dir})
    assert caught.value.key == "dra_plugin_dir"
    with pytest.raises(ConfigError, match="107 bytes") as caught:
        build(flags={"mode": "dra", "plugin_registry_dir": long_dir})
    assert caught.value.key == "plugin_registry_dir"


def test_dra_mode_needs_an_api_and_a_node_name():
    config = build(flags={"mode": "dra"})
    missing = missing_for_mode(config, {})
    assert len(missing) == 2
    assert "Kubernetes API" in missing[0] and "node name" in missing[1]
    in_cluster = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert missing_for_mode(build(flags={"mode": "dra", "node_name": "n1"}), in_cluster) == []
    with_file = build(flags={"mode": "dra", "node_name": "n1", "kubeconfig": "/k"})
    assert missing_for_mode(with_file, {}) == []
    assert missing_for_mode(build(flags={"mode": "dra", "kubeconfig": "/k"}), {}) == [
        "the node name: --node-name, VGPU_AGENT_NODE_NAME or NODE_NAME"
    ]
    assert missing_for_mode(build(), {}) == []  # the device plugin runs without either


def test_run_in_dra_mode_without_api_exits_2_naming_both(monkeypatch, capsys):
    for name in ("KUBERNETES_SERVICE_HOST", "NODE_NAME", "VGPU_AGENT_NODE_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("vgpu_agent.logging.configure", lambda *a: None)
    assert main(["run", "--mode", "dra"]) == 2
    err = capsys.readouterr().err
    assert "mode dra needs" in err and "Kubernetes API" in err and "node name" in err

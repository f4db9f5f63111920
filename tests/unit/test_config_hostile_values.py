"""Config parsing is total: hostile files and values end in a ConfigError naming the key, fast.

Each case is an attack on the start of the agent: it must neither hang, nor run out of memory,
nor end in a traceback, and the error it gives must stay short.
"""

from __future__ import annotations

import time

import pytest

from vgpu_agent.config import (
    MAX_CONFIG_BYTES,
    MAX_SPLIT_COUNT,
    ConfigError,
    ConfigSources,
    build_config,
)

BOMB_LEVELS = 9


def alias_bomb(key: str) -> str:
    """Under 500 bytes that expand to 9**9 (387 million) strings under `key`."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for level in range(1, BOMB_LEVELS):
        ref = f"*a{level - 1}"
        lines.append(f"a{level}: &a{level} [{','.join([ref] * 9)}]")
    lines.append(f"{key}: [{','.join([f'*a{BOMB_LEVELS - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def alias_bomb_under_one_key(key: str) -> str:
    """The same bomb with every anchor inside the value of one known key."""
    inner = '&a0 ["x","x","x","x","x","x","x","x","x"]'
    for level in range(1, BOMB_LEVELS):
        inner = f"&a{level} [{inner}, " + ", ".join([f"*a{level - 1}"] * 8) + "]"
    return f"{key}: {inner}\n"


def from_file(text: str) -> ConfigError:
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        build_config(ConfigSources(file_text=text, file_name="cfg.yaml"))
    assert time.perf_counter() - started < 2.0
    assert len(str(err.value)) < 2100  # the value is shown cut short, whatever its size
    return err.value


@pytest.mark.parametrize("key", ["xid_ignore", "split_count", "node_name", "memory_scaling"])
def test_an_alias_bomb_under_a_known_key_is_rejected_at_once_naming_the_key(key):
    text = alias_bomb_under_one_key(key)
    assert len(text) < 700
    err = from_file(text)
    assert err.key == key
    assert "aliases are expanded" in str(err)


def test_an_alias_bomb_spread_over_keys_is_rejected_too():
    text = alias_bomb("xid_ignore")
    assert len(text) < 500
    err = from_file(text)
    assert "more than 10000 values" in str(err)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("split_count: " + "9" * 5000 + "\n", "split_count"),
        ("health_check_seconds: " + "9" * 5000 + "\n", "health_check_seconds"),
        ("xid_ignore: [" + "1" * 5000 + "]\n", "xid_ignore"),
        ("region_gc_grace_seconds: .inf\n", "region_gc_grace_seconds"),
        ("health_recovery_seconds: -.inf\n", "health_recovery_seconds"),
        ("throttle_tick_seconds: .nan\n", "throttle_tick_seconds"),
        ("throttle_calm_slowdown: 0\n", "throttle_calm_slowdown"),
        ("throttle_calm_slowdown: 11\n", "throttle_calm_slowdown"),
        ("throttle_calm_slowdown: 2.5\n", "throttle_calm_slowdown"),
        ("throttle_settled_tick_seconds: 0.05\n", "throttle_settled_tick_seconds"),
        ("throttle_settled_tick_seconds: 61\n", "throttle_settled_tick_seconds"),
        ("throttle_settled_tick_seconds: .nan\n", "throttle_settled_tick_seconds"),
        ("throttle_settled_tick_seconds: four\n", "throttle_settled_tick_seconds"),
        ("throttle_nvml_poll_periods: 0\n", "throttle_nvml_poll_periods"),
        ("throttle_nvml_poll_periods: 6\n", "throttle_nvml_poll_periods"),
        ("throttle_nvml_poll_periods: true\n", "throttle_nvml_poll_periods"),
        ("throttle_solo_turns: sometimes\n", "throttle_solo_turns"),
        ("throttle_solo_turn_spare_priority: high\n", "throttle_solo_turn_spare_priority"),
        ("throttle_solo_turn_spare_priority: 2147483648\n", "throttle_solo_turn_spare_priority"),
        ("throttle_solo_turn_spare_priority: 50.5\n", "throttle_solo_turn_spare_priority"),
        ("throttle_solo_turn_spare_priority: true\n", "throttle_solo_turn_spare_priority"),
        ("throttle_figure_max_age_seconds: -1\n", "throttle_figure_max_age_seconds"),
        ("throttle_figure_max_age_seconds: .inf\n", "throttle_figure_max_age_seconds"),
        ("throttle_figure_max_age_seconds: 1e9\n", "throttle_figure_max_age_seconds"),
        ("memory_scaling: 1e999\nallow_memory_oversubscription: true\n", "memory_scaling"),
        ("health_check_seconds: 1e308\n", "health_check_seconds"),
        ("pod_resources_refresh_seconds: 0\n", "pod_resources_refresh_seconds"),
        ("split_count: 2000000\n", "split_count"),
        (f"split_count: {MAX_SPLIT_COUNT + 1}\n", "split_count"),
        ("memory_scaling: 11\nallow_memory_oversubscription: true\n", "memory_scaling"),
        ("endpoint_name: ../kubelet.sock\n", "endpoint_name"),
        ("endpoint_name: sub/dir.sock\n", "endpoint_name"),
        ("endpoint_name: kubelet.sock\n", "endpoint_name"),
        ("endpoint_name: ..\n", "endpoint_name"),
        ('endpoint_name: "x.sock\\n"\n', "endpoint_name"),
        ('state_dir: "/var/lib/x\\0y"\n', "state_dir"),
        ("state_dir: /" + "a" * 5000 + "\n", "state_dir"),
        ("node_name: " + "n" * 5000 + "\n", "node_name"),
        ("xid_ignore: [" + ",".join(["1"] * 300) + "]\n", "xid_ignore"),
        ("xid_ignore: [4294967296]\n", "xid_ignore"),
    ],
)
def test_huge_infinite_and_out_of_range_values_name_their_key(text, key):
    err = from_file(text)
    assert err.key == key
    assert err.source == "cfg.yaml"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("VGPU_AGENT_SPLIT_COUNT", "9" * 5000),
        ("VGPU_AGENT_HEALTH_CHECK_SECONDS", "inf"),
        ("VGPU_AGENT_HEALTH_CHECK_SECONDS", "Infinity"),
        ("VGPU_AGENT_REGION_GC_GRACE_SECONDS", "nan"),
        ("VGPU_AGENT_HEALTH_RECOVERY_SECONDS", "1" + "0" * 400),
        ("VGPU_AGENT_NVML_POLL_SECONDS", "1" * 100_000),
        ("VGPU_AGENT_ENDPOINT_NAME", "../../etc/evil.sock"),
        ("VGPU_AGENT_THROTTLE_CALM_SLOWDOWN", "-1"),
    ],
)
def test_environment_values_are_bounded_too(variable, value):
    with pytest.raises(ConfigError) as err:
        build_config(ConfigSources(env={variable: value}))
    assert err.value.key == variable
    assert len(str(err.value)) < 2100


def test_deep_nesting_is_a_config_error_not_a_recursion_crash():
    err = from_file("xid_ignore: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert err.key == "config"


def test_a_file_over_the_size_cap_is_refused_before_parsing():
    err = from_file("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert f"at most {MAX_CONFIG_BYTES} bytes" in str(err)


def test_bounds_that_are_allowed_still_load():
    config = build_config(
        ConfigSources(
            file_text=(
                f"split_count: {MAX_SPLIT_COUNT}\nendpoint_name: vgpu-agent-2.sock\n"
                "health_check_seconds: 60\nregion_gc_grace_seconds: 0\n"
                "memory_scaling: 10\nallow_memory_oversubscription: true\n"
            )
        )
    )
    assert config.split_count == MAX_SPLIT_COUNT
    assert config.plugin_socket.endswith("/vgpu-agent-2.sock")
    assert config.memory_scaling == 10.0


def test_the_calm_slowdown_sets_how_slow_the_settled_controller_ticks():
    """1 keeps the controller at its tick, lent or not; the default lets it grow to four times
    that, and where nothing is lent to 2 s (or the slowdown, if longer)."""
    from vgpu_agent.agent import Agent

    assert build_config(ConfigSources()).throttle_calm_slowdown == 4
    assert build_config(ConfigSources()).throttle_nvml_poll_periods == 2
    for raw, tick, expected, unlent in (("1", "0.2", 0.2, 0.2), ("3", "0.2", 0.6, 2.0),
                                        ("10", "0.3", 3.0, 3.0)):
        config = build_config(ConfigSources(env={
            "VGPU_AGENT_THROTTLE_CALM_SLOWDOWN": raw, "VGPU_AGENT_THROTTLE_TICK_SECONDS": tick,
            "VGPU_AGENT_BACKEND": "sim"}))
        controller = Agent(config).controller
        assert controller.max_tick_s == pytest.approx(expected)
        assert controller.unlent_tick_s == pytest.approx(unlent)


def test_the_settled_tick_sets_how_slow_a_gpu_lending_nothing_ticks():
    """2 s by default; longer saves CPU and NVML calls, costing how soon spare share is lent
    and how soon a change no look sees is steered; never below the calm tick, and a tick kept
    fast (slowdown 1) stays fast."""
    from vgpu_agent.agent import Agent

    assert build_config(ConfigSources()).throttle_settled_tick_seconds == 2.0
    # the tick at 0.2 s: calm ticks up to 0.2 x the slowdown
    for slowdown, settled, unlent in (("4", "4", 4.0), ("4", "0.1", 0.8), ("10", "2", 2.0),
                                      ("1", "8", 0.2)):
        config = build_config(ConfigSources(env={
            "VGPU_AGENT_THROTTLE_CALM_SLOWDOWN": slowdown,
            "VGPU_AGENT_THROTTLE_SETTLED_TICK_SECONDS": settled,
            "VGPU_AGENT_THROTTLE_TICK_SECONDS": "0.2", "VGPU_AGENT_BACKEND": "sim"}))
        controller = Agent(config).controller
        assert controller.unlent_tick_s == pytest.approx(unlent)


def test_the_nvml_poll_periods_reach_the_controller():
    from vgpu_agent.agent import Agent

    config = build_config(ConfigSources(env={"VGPU_AGENT_THROTTLE_NVML_POLL_PERIODS": "3",
                                             "VGPU_AGENT_BACKEND": "sim"}))
    assert Agent(config).controller.nvml_poll_periods == 3


def test_solo_turns_are_on_by_default_and_can_be_switched_off():
    from vgpu_agent.agent import Agent

    assert Agent(build_config(ConfigSources(env={"VGPU_AGENT_BACKEND": "sim"}))
                 ).controller.solo_turns is True
    config = build_config(ConfigSources(env={"VGPU_AGENT_THROTTLE_SOLO_TURNS": "false",
                                             "VGPU_AGENT_BACKEND": "sim"}))
    assert Agent(config).controller.solo_turns is False


def test_no_container_is_spared_a_pause_by_default_and_a_priority_reaches_the_controller():
    from vgpu_agent.agent import Agent

    env = {"VGPU_AGENT_BACKEND": "sim"}
    assert Agent(build_config(ConfigSources(env=env))
                 ).controller.solo_turn_spare_priority is None
    for raw, expected in (("50", 50), ("-3", -3), ("", None)):
        config = build_config(ConfigSources(
            env={**env, "VGPU_AGENT_THROTTLE_SOLO_TURN_SPARE_PRIORITY": raw}))
        assert Agent(config).controller.solo_turn_spare_priority == expected
    config = build_config(ConfigSources(file_text="throttle_solo_turn_spare_priority: null\n",
                                        env=env))
    assert config.throttle_solo_turn_spare_priority is None


def test_figures_are_never_measured_again_by_age_unless_asked_and_the_age_reaches_the_controller():
    from vgpu_agent.agent import Agent

    env = {"VGPU_AGENT_BACKEND": "sim"}
    assert Agent(build_config(ConfigSources(env=env))).controller.figure_max_age_s == 0.0
    config = build_config(ConfigSources(
        env={**env, "VGPU_AGENT_THROTTLE_FIGURE_MAX_AGE_SECONDS": "600"}))
    assert Agent(config).controller.figure_max_age_s == 600.0
    with pytest.raises(ConfigError, match=r"THROTTLE_FIGURE_MAX_AGE_SECONDS=.-5.*between 0 and 86400"):
        build_config(ConfigSources(env={**env, "VGPU_AGENT_THROTTLE_FIGURE_MAX_AGE_SECONDS":
                                        "-5"}))

"""What a grant says about spilling, and the host-memory bound that spilling must fit."""

import pytest

from vgpu_agent.deviceplugin.allocation import (
    SpillHostMemoryError,
    Split,
    check_spill_host_memory,
    container_envs,
    grant,
)
from vgpu_agent.gpu.sim import build_inventory

GIB = 1 << 30
GPUS = {g.uuid: g for g in build_inventory("2xA100-80GB")}
UUID = next(iter(GPUS))


def test_spilling_needs_both_the_setting_and_scaling_above_one():
    assert Split(4, 2.0, spill=True).spills
    assert not Split(4, 2.0, spill=False).spills
    assert not Split(4, 1.0, spill=True).spills  # limits fit the card: nothing to spill


def test_a_grant_carries_the_spill_policy_and_its_limit_past_the_card():
    g = grant([f"{UUID}::0", f"{UUID}::1"], GPUS, Split(4, 2.0, spill=True))
    (device,) = g.devices
    assert device.spill is True
    assert device.memory_limit == 2 * 2 * GPUS[UUID].memory_total // 4
    envs = container_envs(g, "envvar")
    assert envs["VGPU_MEMORY_OVERSUBSCRIPTION"] == "spill"
    assert envs["CUDA_OVERSUBSCRIBE"] == "true"


@pytest.mark.parametrize(("scaling", "spill"), [(2.0, False), (1.0, True), (0.5, False)])
def test_without_spilling_the_envs_say_off(scaling, spill):
    g = grant([f"{UUID}::0"], GPUS, Split(4, scaling, spill=spill))
    assert g.devices[0].spill is False
    envs = container_envs(g, "envvar")
    assert envs["VGPU_MEMORY_OVERSUBSCRIPTION"] == "off"
    assert "CUDA_OVERSUBSCRIBE" not in envs


def test_the_bound_is_scaling_times_memory_summed_over_gpus():
    memory = [80 * GIB, 80 * GIB]
    assert check_spill_host_memory(memory, Split(4, 1.5, spill=True), 480 * GIB, 0.5) == 240 * GIB


def test_past_the_share_of_host_memory_is_refused_naming_the_numbers():
    with pytest.raises(SpillHostMemoryError) as err:
        check_spill_host_memory([80 * GIB, 80 * GIB], Split(4, 2.0, spill=True), 512 * GIB, 0.5)
    text = str(err.value)
    assert "327680 MiB" in text  # 2 x 160 GiB promised
    assert "0.5 of host memory" in text and "262144 of 524288 MiB" in text


def test_unknown_host_memory_is_refused():
    with pytest.raises(SpillHostMemoryError, match="host memory is unknown"):
        check_spill_host_memory([GIB], Split(1, 2.0, spill=True), 0, 0.5)

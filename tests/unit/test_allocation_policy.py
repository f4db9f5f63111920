"""Splitting arithmetic, preferred-allocation policies and container grants."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vgpu_agent.deviceplugin.allocation import (
    AllocationError,
    Split,
    cdi_device_names,
    container_envs,
    device_list,
    grant,
    preferred_allocation,
)
from vgpu_agent.deviceplugin.ids import format_device_id, parse_device_id
from vgpu_agent.gpu.model import MIB, GpuInfo

GIB = 1024 * MIB


def gpu(index, memory_gib=80, numa=None):
    return GpuInfo(
        index,
        f"GPU-{index:08x}-0000-0000-0000-000000000000",
        "A100",
        memory_gib * GIB,
        index,
        f"0000:{index:02x}:00.0",
        numa,
    )


GPUS = [gpu(i, numa=i % 2) for i in range(4)]
BY_UUID = {g.uuid: g for g in GPUS}


def ids_of(g, slices):
    return [format_device_id(g.uuid, n) for n in slices]


def test_slice_is_floor_of_scaled_memory_over_k_and_cores_over_k():
    split = Split(3, memory_scaling=0.9, cores_scaling=1.0)
    assert split.slice_memory(80 * GIB) == (80 * GIB * 9 // 10) // 3
    assert split.slice_cores() == pytest.approx(100 / 3)


def test_device_list_has_every_slice_with_health_and_numa():
    devices = device_list(GPUS[:2], Split(4), {GPUS[1].uuid: False})
    assert [d.device_id for d in devices] == ids_of(GPUS[0], range(4)) + ids_of(GPUS[1], range(4))
    assert [d.healthy for d in devices] == [True] * 4 + [False] * 4
    assert {d.numa_node for d in devices[4:]} == {1}


def test_spread_puts_slices_on_distinct_gpus_with_most_free_first():
    # GPU0 has 4 free, GPU1 1 free, GPU2 3 free: two slices go to GPU0 and GPU2.
    available = ids_of(GPUS[0], range(4)) + ids_of(GPUS[1], [3]) + ids_of(GPUS[2], [1, 2, 3])
    chosen = preferred_allocation(available, [], 2, "spread")
    assert {parse_device_id(c).uuid for c in chosen} == {GPUS[0].uuid, GPUS[2].uuid}


def test_binpack_fills_the_fullest_gpu_first():
    available = ids_of(GPUS[0], range(4)) + ids_of(GPUS[1], [3]) + ids_of(GPUS[2], [1, 2, 3])
    chosen = preferred_allocation(available, [], 3, "binpack")
    # GPU1 has a single free slice (fullest), then GPU2 (3 free) is filled before GPU0.
    assert chosen[0] == ids_of(GPUS[1], [3])[0]
    assert [parse_device_id(c).uuid for c in chosen[1:]] == [GPUS[2].uuid] * 2


def test_must_include_is_kept_and_unavailable_must_include_is_dropped():
    available = ids_of(GPUS[0], range(2)) + ids_of(GPUS[1], range(2))
    must = ids_of(GPUS[1], [1]) + ids_of(GPUS[3], [0])  # the second is not available
    chosen = preferred_allocation(available, must, 2, "spread")
    assert chosen[0] == must[0]
    assert ids_of(GPUS[3], [0])[0] not in chosen
    assert parse_device_id(chosen[1]).uuid == GPUS[0].uuid


def test_short_answer_when_not_enough_and_malformed_ids_never_chosen():
    available = [*ids_of(GPUS[0], [0]), "garbage", "GPU-x::01"]
    assert preferred_allocation(available, [], 3, "spread") == ids_of(GPUS[0], [0])


available_sets = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 7)), min_size=0, max_size=32, unique=True
).map(lambda pairs: [format_device_id(GPUS[g].uuid, n) for g, n in pairs])


@given(available_sets, st.integers(0, 10), st.sampled_from(["spread", "binpack"]), st.data())
def test_answers_are_valid_subsets_of_available(available, size, policy, data):
    must = data.draw(
        st.lists(st.sampled_from(available), unique=True) if available else st.just([])
    )
    chosen = preferred_allocation(available, must, size, policy)
    assert len(chosen) == min(size, len(available))
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(available)
    assert set(must[:size]) <= set(chosen)


@given(available_sets, st.integers(1, 4))
def test_spread_never_doubles_up_while_another_gpu_is_free(available, size):
    chosen = preferred_allocation(available, [], size, "spread")
    gpus_available = {parse_device_id(a).uuid for a in available}
    gpus_used = [parse_device_id(c).uuid for c in chosen]
    assert len(set(gpus_used)) == min(len(gpus_used), len(gpus_available))


@given(available_sets, st.integers(1, 8))
def test_binpack_uses_as_few_gpus_as_the_free_slices_allow(available, size):
    assume(available)
    chosen = preferred_allocation(available, [], size, "binpack")
    free = {}
    for a in available:
        free[parse_device_id(a).uuid] = free.get(parse_device_id(a).uuid, 0) + 1
    used = {parse_device_id(c).uuid for c in chosen}
    # Every GPU but the last one touched is used up completely.
    counts = {u: sum(parse_device_id(c).uuid == u for c in chosen) for u in used}
    assert sum(1 for u in used if counts[u] < free[u]) <= 1


@given(st.integers(1, 16), st.floats(0.1, 1.0), st.floats(0.1, 1.0), st.data())
def test_grant_sums_slices_per_gpu_and_never_exceeds_the_card(k, mem_scale, core_scale, data):
    split = Split(k, mem_scale, core_scale)
    picks = data.draw(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, k - 1)), min_size=1, unique=True)
    )
    ids = [format_device_id(GPUS[g].uuid, n) for g, n in picks]
    result = grant(ids, BY_UUID, split)
    assert [d.gpu_index for d in result.devices] == sorted({g for g, _ in picks})
    for device in result.devices:
        slices = sum(1 for g, _ in picks if GPUS[g].uuid == device.uuid)
        assert device.slices == slices
        assert device.memory_limit == slices * split.slice_memory(80 * GIB)
        assert device.memory_limit <= 80 * GIB
        assert device.core_percent <= 100.0


def test_two_slices_of_one_gpu_give_one_device_with_twice_the_share():
    result = grant(ids_of(GPUS[2], [0, 3]), BY_UUID, Split(4))
    assert len(result.devices) == 1
    assert result.devices[0].memory_limit == 40 * GIB
    assert result.devices[0].core_percent == 50.0
    envs = container_envs(result, "envvar")
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPUS[2].uuid
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40960m"
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert envs["VGPU_CORE_LIMIT_0"] == "50"


def test_envs_for_two_gpus_in_stable_order_and_hami_gets_the_smaller_share():
    ids = ids_of(GPUS[3], [1]) + ids_of(GPUS[0], [0, 1])
    result = grant(ids, BY_UUID, Split(4))
    envs = container_envs(result, "envvar")
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{GPUS[0].uuid},{GPUS[3].uuid}"
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40960m"
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == "20480m"
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "25"


def test_memory_values_round_down_to_whole_mib_and_cores_to_whole_percent():
    odd = GpuInfo(0, "GPU-odd", "L4", 23034 * MIB + 123, 0, "0000:01:00.0")
    result = grant(["GPU-odd::0"], {"GPU-odd": odd}, Split(3))
    envs = container_envs(result, "envvar")
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{(23034 * MIB + 123) // 3 // MIB}m"
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "33"


def test_cdi_strategy_names_devices_instead_of_the_variable():
    result = grant(ids_of(GPUS[1], [0]), BY_UUID, Split(2))
    assert "NVIDIA_VISIBLE_DEVICES" not in container_envs(result, "cdi")
    assert cdi_device_names(result, "nvidia.com/gpu") == [f"nvidia.com/gpu={GPUS[1].uuid}"]


@pytest.mark.parametrize(
    ("ids", "named", "reason"),
    [
        (["nonsense"], "nonsense", "no '::'"),
        (["GPU-ffffffff-0000-0000-0000-000000000000::0"], "GPU-ffffffff", "not on this node"),
        ([f"{GPUS[0].uuid}::9"], "::9", "out of range 0..3"),
        ([f"{GPUS[0].uuid}::1", f"{GPUS[0].uuid}::1"], "::1", "listed twice"),
        ([], "", "no device IDs"),
    ],
)
def test_bad_ids_are_named(ids, named, reason):
    with pytest.raises(AllocationError) as err:
        grant(ids, BY_UUID, Split(4))
    assert named in str(err.value)
    assert reason in str(err.value)

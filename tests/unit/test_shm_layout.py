"""Encoding control files, aligned stores with the generation, and reading state defensively."""

from __future__ import annotations

import mmap
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm import layout
from vgpu_agent.shm.layout import Control, ControlDevice, RegionFormatError

UUID0 = "GPU-12345678-1234-1234-1234-123456789abc"
UUID1 = "GPU-87654321-4321-4321-4321-cba987654321"


def _control(**kw: object) -> Control:
    fields: dict[str, object] = {
        "devices": (
            ControlDevice(UUID0, 8 << 30, 250_000, 10**9, 10**8, layout.POLICY_STRICT),
            ControlDevice(UUID1, 4 << 30, 500_000, 5, 7, layout.POLICY_WORK_CONSERVING, 0, 99),
        ),
        "device_ids": (f"{UUID0}::3", f"{UUID1}::0"),
        "priority": -2,
        "seq": 41,
        "created_ns": 123,
        "heartbeat_ns": 456,
    }
    fields.update(kw)
    return Control(**fields)  # type: ignore[arg-type]


def test_control_round_trips() -> None:
    control = _control()
    data = layout.encode_control(control)
    assert len(data) == layout.CONTROL_SIZE
    assert layout.decode_control(data) == control


def test_control_longest_ids_fit() -> None:
    ids = tuple(("x" * 60) + f"{i:03d}" for i in range(layout.MAX_DEVICE_IDS))
    control = _control(device_ids=ids)
    assert layout.decode_control(layout.encode_control(control)).device_ids == ids


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"devices": ()}, "0 devices"),
        ({"devices": (ControlDevice(UUID0),) * 17}, "17 devices"),
        ({"device_ids": ("a",) * 65}, "65 device IDs"),
        ({"device_ids": ("x" * 64,)}, "at most 63 characters"),
        ({"device_ids": ("gpü",)}, "ASCII"),
        ({"priority": 2**63}, "priority"),
        ({"seq": -1}, "seq=-1"),
        ({"generation": 3}, "odd"),
        ({"devices": (ControlDevice(""),)}, "uuid is empty"),
        ({"devices": (ControlDevice(UUID0, policy=7),)}, "policy=7"),
        ({"devices": (ControlDevice(UUID0, core_limit=1_000_001),)}, "core_limit=1000001"),
        ({"devices": (ControlDevice(UUID0, rate=2**62 + 1),)}, "rate="),
        ({"devices": (ControlDevice(UUID0, memory_limit=-5),)}, "memory_limit=-5"),
    ],
)
def test_control_rejects_bad_values_by_name(change: dict[str, object], message: str) -> None:
    with pytest.raises(RegionFormatError, match=message):
        layout.encode_control(_control(**change))


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, 0x1234, "magic"),
        (8, 2, "ABI major 2"),
        (16, 99, "header/total size"),
        (20, 17, "device count 17"),
    ],
)
def test_decode_control_refuses_foreign_files(offset: int, value: int, message: str) -> None:
    data = bytearray(layout.encode_control(_control()))
    fmt = "<Q" if offset == 0 else "<I"
    struct.pack_into(fmt, data, offset, value)
    with pytest.raises(RegionFormatError, match=message):
        layout.decode_control(data)


def test_decode_control_refuses_short_file() -> None:
    with pytest.raises(RegionFormatError, match="at least 7296"):
        layout.decode_control(layout.encode_control(_control())[:-1])


def test_newer_minor_version_is_accepted() -> None:
    data = bytearray(layout.encode_control(_control()))
    struct.pack_into("<I", data, layout.CONTROL_OFFSETS["abi_minor"], 7)
    assert layout.decode_control(data).abi_minor == 7


def test_set_rate_on_an_mmap_bumps_generation_to_next_even() -> None:
    with mmap.mmap(-1, layout.CONTROL_SIZE) as mm:
        mm[:] = layout.encode_control(_control())
        assert layout.set_rate(mm, 1, 1234, 5678) == 2
        assert layout.set_rate(mm, 1, 1235, 5679) == 4
        decoded = layout.decode_control(mm)
        assert (decoded.devices[1].rate, decoded.devices[1].burst) == (1235, 5679)
        assert decoded.devices[0] == _control().devices[0]
        assert decoded.generation == 4


def test_update_closes_a_generation_left_odd() -> None:
    buf = bytearray(layout.encode_control(_control()))
    layout.store_u64(buf, layout.CONTROL_OFFSETS["generation"], 9)  # writer died mid-update
    assert layout.set_rate(buf, 0, 1, 1) == 10


def test_heartbeat_is_a_single_store_without_generation() -> None:
    buf = bytearray(layout.encode_control(_control()))
    layout.set_heartbeat(buf, 777)
    decoded = layout.decode_control(buf)
    assert (decoded.heartbeat_ns, decoded.generation) == (777, 0)


def test_store_rejects_misaligned_offsets_and_out_of_range_values() -> None:
    buf = bytearray(64)
    with pytest.raises(RegionFormatError, match="offset 4 is not 8-byte aligned"):
        layout.store_u64(buf, 4, 1)
    with pytest.raises(RegionFormatError, match=r"0\.\.18446744073709551615"):
        layout.store_u64(buf, 8, 2**64)
    with pytest.raises(RegionFormatError, match="device index 16"):
        layout.set_rate(buf, 16, 1, 1)


# ------------------------------------------------------------------ state


def _state(device_count: int = 2) -> bytearray:
    return bytearray(layout.encode_state(device_count))


def _put_slot(buf: bytearray, index: int, pid: int, host_pid: int,
              per_dev: list[tuple[int, int, int, int, int]]) -> None:
    """Fill slot `index` as the shim does: the high-water mark first raised above it."""
    mark = layout.STATE_OFFSETS["slot_high_water"]
    layout.store_u64(buf, mark, max(layout.load_u64(buf, mark), index + 1))
    base = layout.STATE_OFFSETS["slots"] + index * layout.SLOT_SIZE
    struct.pack_into("<QQ", buf, base, pid, host_pid)
    for d, values in enumerate(per_dev):
        struct.pack_into("<5Q", buf, base + layout.SLOT_OFFSETS["devices"]
                         + d * layout.PROC_DEVICE_SIZE, *values)


def _put_device(buf: bytearray, dev: int, balance: int, memory: int, spent: int) -> None:
    base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
    struct.pack_into("<qQQQ", buf, base, balance, 1, memory, spent)


def test_fresh_state_reads_empty() -> None:
    usage = layout.decode_state(_state(), device_count=2)
    assert not usage.corrupt
    assert usage.processes == ()
    assert usage.memory_used == (0, 0)
    assert usage.skipped_records == 0


def test_state_reports_live_slots_and_totals() -> None:
    buf = _state()
    _put_slot(buf, 0, 7, 4321, [(100, 2, 300, 4, 5), (0, 0, 0, 0, 0)])
    _put_slot(buf, 1023, 9, 0, [(50, 1, 1, 1, 1), (60, 0, 0, 0, 0)])
    _put_slot(buf, 5, layout.PID_RECLAIMING | 3, 0, [(10**6, 0, 0, 0, 0), (0,) * 5])
    _put_device(buf, 0, -20, 150, 301)
    _put_device(buf, 1, 5, 60, 0)
    usage = layout.decode_state(buf, device_count=2)
    assert [(p.pid, p.host_pid) for p in usage.processes] == [(7, 4321), (9, 0)]
    assert usage.processes[0].memory_used == (100, 0)
    assert usage.processes[0].launches == (2, 0)
    assert usage.processes[0].tokens_spent == (300, 0)
    assert usage.processes[0].wait_ns == (4, 0)
    assert usage.processes[0].last_launch_ns == (5, 0)
    assert usage.memory_used == (150, 60)
    assert usage.tokens_spent == (301, 0)
    assert usage.bucket_balance == (-20, 5)
    assert usage.skipped_records == 0


def test_nonsense_slots_are_skipped_and_counted() -> None:
    buf = _state()
    _put_slot(buf, 0, 7, 0, [(100, 0, 0, 0, 0), (0,) * 5])
    _put_slot(buf, 1, 2**40, 0, [(1, 0, 0, 0, 0), (0,) * 5])  # pid beyond PID_MAX
    _put_slot(buf, 2, 8, 2**30, [(1, 0, 0, 0, 0), (0,) * 5])  # host pid beyond PID_MAX
    _put_slot(buf, 3, 9, 0, [(2**63, 0, 0, 0, 0), (0,) * 5])  # negative memory as int64
    _put_slot(buf, 4, 10, 0, [(0, 2**64 - 1, 0, 0, 0), (0,) * 5])  # absurd counter
    _put_slot(buf, 6, 2**64 - 1, 0, [(0,) * 5, (0,) * 5])  # reclaim marker, nonsense reclaimer
    _put_device(buf, 0, 0, 2**64 - 17, 2**63)  # totals nonsense: use the valid slots
    _put_device(buf, 1, -(2**63), 0, 0)  # balance nonsense
    usage = layout.decode_state(buf, device_count=2)
    assert [p.pid for p in usage.processes] == [7]
    assert usage.memory_used == (100, 0)
    assert usage.tokens_spent == (0, 0)
    assert usage.bucket_balance == (0, 0)
    assert usage.skipped_records == 5 + 3


def test_slot_count_beyond_the_file_is_clamped_and_counted() -> None:
    buf = _state()[: layout.STATE_HEADER_SIZE + 3 * layout.SLOT_SIZE + 100]
    struct.pack_into("<I", buf, layout.STATE_OFFSETS["slot_count"], 2**32 - 1)
    _put_slot(buf, 2, 5, 0, [(1, 1, 1, 1, 1), (0,) * 5])
    usage = layout.decode_state(buf)
    assert [p.pid for p in usage.processes] == [5]
    assert usage.skipped_records == 2  # the slots, and the 1.1 extension, are past its end
    assert not usage.memory_context[0]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:10],
        lambda b: b[: layout.STATE_HEADER_SIZE - 1],
        lambda b: bytearray(len(b)),
        lambda b: b[:0] + struct.pack("<Q", layout.CONTROL_MAGIC) + b[8:],
        lambda b: b[:8] + struct.pack("<I", 2) + b[12:],
        lambda b: b[:20] + struct.pack("<I", 99) + b[24:],
    ],
)
def test_unreadable_header_is_corrupt_not_an_exception(damage: object) -> None:
    usage = layout.decode_state(damage(_state()))  # type: ignore[operator]
    assert usage.corrupt
    assert usage.processes == ()


def test_device_count_mismatch_with_control_is_corrupt() -> None:
    assert layout.decode_state(_state(2), device_count=3).corrupt


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE),
       st.integers(0, 2**64 - 1), st.integers(0, layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE))
def test_random_bytes_never_raise_and_never_yield_implausible_values(
    noise: bytes, word: int, where: int
) -> None:
    buf = _state(1)[: layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE]
    layout.store_u64(buf, layout.STATE_OFFSETS["slot_high_water"], 2)  # both slots are read
    buf[layout.STATE_HEADER_SIZE : layout.STATE_HEADER_SIZE + len(noise)] = noise[
        : len(buf) - layout.STATE_HEADER_SIZE]
    where -= where % 8
    if where + 8 <= len(buf) and where >= 32:
        struct.pack_into("<Q", buf, where, word)
    usage = layout.decode_state(buf)
    for process in usage.processes:
        assert 0 < process.pid < layout.PID_MAX
        assert all(0 <= m <= layout.PLAUSIBLE_BYTES for m in process.memory_used)
    assert all(0 <= m <= layout.PLAUSIBLE_BYTES for m in usage.memory_used)
    assert all(-layout.TOKEN_MAX <= b <= layout.TOKEN_MAX for b in usage.bucket_balance)

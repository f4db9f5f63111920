"""The free-slot skip in front of `decode_state` changes nothing in what is decoded."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import _used_slots_only

SLOTS = layout.STATE_OFFSETS["slots"]
U64 = st.one_of(
    st.integers(0, 1 << 20),
    st.sampled_from([0, 1, layout.PID_MAX, layout.PLAUSIBLE_BYTES + 1, layout.U64_MAX]),
)


def write_slot(buf: bytearray, index: int, pid: int, host_pid: int, counters: list[int]) -> None:
    base = SLOTS + index * layout.SLOT_SIZE
    struct.pack_into("<QQ", buf, base, pid, host_pid)
    for n, value in enumerate(counters):
        struct.pack_into("<Q", buf, base + layout.SLOT_OFFSETS["devices"] + 8 * n, value)


@settings(max_examples=50, deadline=None)
@given(
    device_count=st.integers(1, 3),
    slots=st.dictionaries(
        st.integers(0, layout.MAX_PROCS - 1),
        st.tuples(
            st.one_of(U64, st.just(layout.PID_RECLAIMING | 7)), U64, st.lists(U64, max_size=15)
        ),
        max_size=12,
    ),
    totals=st.lists(U64, min_size=3, max_size=3),
)
def test_same_result_as_decoding_the_whole_file(device_count, slots, totals) -> None:
    buf = bytearray(layout.encode_state(device_count))
    for index, (pid, host_pid, counters) in slots.items():
        write_slot(buf, index, pid, host_pid, counters)
    for d, value in enumerate(totals[:device_count]):
        offset = layout.STATE_OFFSETS["devices"] + d * layout.STATE_DEVICE_SIZE
        struct.pack_into("<Q", buf, offset + layout.STATE_DEVICE_OFFSETS["memory_used"], value)
    whole = layout.decode_state(bytes(buf), device_count)
    with memoryview(buf) as view:
        compact = _used_slots_only(view)
        assert layout.decode_state(compact, device_count) == whole
    assert len(compact) <= len(buf)


def test_only_used_slots_are_kept() -> None:
    buf = bytearray(layout.encode_state(1))
    write_slot(buf, 3, 42, 4242, [1 << 20, 5, 500, 0, 9])
    write_slot(buf, 900, 43, 0, [0, 1, 1, 0, 1])
    with memoryview(buf) as view:
        compact = _used_slots_only(view)
    assert len(compact) == layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE
    usage = layout.decode_state(compact, 1)
    assert [p.pid for p in usage.processes] == [42, 43]
    assert usage.processes[0].memory_used == (1 << 20,)


def test_odd_files_are_passed_through_unchanged() -> None:
    buf = bytearray(layout.encode_state(1))
    struct.pack_into("<I", buf, layout.STATE_OFFSETS["slot_count"], 0xFFFFFFFF)
    with memoryview(buf) as view:
        assert _used_slots_only(view) is view  # the decoder sees (and counts) the odd count
    short = bytes(buf[: layout.STATE_HEADER_SIZE + 10])
    with memoryview(short) as view:
        assert _used_slots_only(view) is view

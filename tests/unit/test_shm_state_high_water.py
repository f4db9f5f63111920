"""Reading `state` up to its slot high-water mark: what is read, what is clamped, what is counted."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm import layout

MARK = layout.STATE_OFFSETS["slot_high_water"]
SLOTS = layout.STATE_OFFSETS["slots"]


def _state(device_count: int = 1) -> bytearray:
    return bytearray(layout.encode_state(device_count))


def _slot(buf: bytearray, index: int, pid: int, memory: int = 0, tokens: int = 0) -> None:
    """Write slot `index` by hand, leaving the mark alone (each test sets the mark it means)."""
    base = SLOTS + index * layout.SLOT_SIZE
    struct.pack_into("<QQ", buf, base, pid, 40000 + pid)
    struct.pack_into("<3Q", buf, base + layout.SLOT_OFFSETS["devices"], memory, 1, tokens)


def _mark(buf: bytearray, value: int) -> None:
    layout.store_u64(buf, MARK, value)


def _partial(buf: bytearray, slots: int) -> bytes:
    """What a reader that fetched the header and the first `slots` slots holds."""
    return bytes(buf[: layout.STATE_HEADER_SIZE + slots * layout.SLOT_SIZE])


def test_a_fresh_file_has_mark_zero_and_reads_no_slot() -> None:
    buf = _state()
    assert layout.load_u64(buf, MARK) == 0
    assert layout.state_slots_to_read(buf) == 0
    usage = layout.decode_state(_partial(buf, 0), 1, slots_read=0)
    assert usage == layout.decode_state(bytes(buf), 1)
    assert not usage.corrupt and usage.processes == () and usage.skipped_records == 0


def test_slots_at_or_beyond_the_mark_are_not_read() -> None:
    buf = _state()
    _slot(buf, 0, 11, memory=100)
    _slot(buf, 2, 12, memory=200)
    _slot(buf, 3, 13, memory=400)  # beyond the mark: never claimed as far as the reader knows
    _slot(buf, 1000, 14, memory=800)
    _mark(buf, 3)
    usage = layout.decode_state(bytes(buf), 1)
    assert [p.pid for p in usage.processes] == [11, 12]
    assert usage.skipped_records == 0
    _mark(buf, 4)
    assert [p.pid for p in layout.decode_state(bytes(buf), 1).processes] == [11, 12, 13]


def test_free_slots_below_the_mark_are_skipped_without_counting() -> None:
    buf = _state(2)
    _slot(buf, 700, 5, memory=1 << 20, tokens=9)
    _mark(buf, 1024)
    usage = layout.decode_state(bytes(buf), 2)
    (proc,) = usage.processes
    assert (proc.pid, proc.host_pid, proc.memory_used, proc.tokens_spent) == (
        5, 40005, (1 << 20, 0), (9, 0))
    assert usage.skipped_records == 0


@pytest.mark.parametrize("mark", [layout.MAX_PROCS + 1, 1 << 32, layout.U64_MAX])
def test_a_mark_beyond_the_slots_is_clamped_and_counted(mark: int) -> None:
    buf = _state()
    _slot(buf, 0, 21)
    _slot(buf, layout.MAX_PROCS - 1, 22)
    _mark(buf, mark)
    usage = layout.decode_state(bytes(buf), 1)
    assert [p.pid for p in usage.processes] == [21, 22]  # clamped to slot_count: all slots read
    assert usage.skipped_records == 1
    assert layout.state_slots_to_read(buf) == layout.MAX_PROCS


def test_a_mark_beyond_a_small_slot_count_is_clamped_to_it_and_counted() -> None:
    buf = _state()
    struct.pack_into("<I", buf, layout.STATE_OFFSETS["slot_count"], 2)
    _slot(buf, 1, 31)
    _slot(buf, 2, 32)  # past slot_count: not read even though the mark covers it
    _mark(buf, 3)
    usage = layout.decode_state(bytes(buf), 1)
    assert [p.pid for p in usage.processes] == [31]
    assert usage.skipped_records == 1
    assert layout.state_slots_to_read(buf) == 2


def test_a_partial_read_does_not_count_the_tail_it_left_out() -> None:
    buf = _state()
    _slot(buf, 0, 41)
    _slot(buf, 1, 42)
    _mark(buf, 2)
    seen = layout.state_slots_to_read(buf)
    _slot(buf, 2, 43)  # claimed between the reader's two reads: the mark in the buffer is 3
    _mark(buf, 3)
    usage = layout.decode_state(_partial(buf, seen), 1, slots_read=seen)
    assert [p.pid for p in usage.processes] == [41, 42]
    assert usage.skipped_records == 0


def test_a_partial_read_cut_short_by_a_truncated_file_is_counted() -> None:
    buf = _state()
    _slot(buf, 0, 51)
    _slot(buf, 3, 52)
    _mark(buf, 4)
    short = bytes(buf[: layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE + 100])
    usage = layout.decode_state(short, 1, slots_read=4)
    assert [p.pid for p in usage.processes] == [51]
    assert usage.skipped_records == 1


def test_a_partial_read_still_counts_a_nonsense_mark() -> None:
    buf = _state()
    _slot(buf, 0, 61)
    _mark(buf, layout.U64_MAX)
    usage = layout.decode_state(_partial(buf, 1), 1, slots_read=1)
    assert [p.pid for p in usage.processes] == [61]
    assert usage.skipped_records == 1


@pytest.mark.parametrize("slots_read", [-1, layout.MAX_PROCS + 1])
def test_slots_read_out_of_range_is_refused_by_name(slots_read: int) -> None:
    with pytest.raises(ValueError, match=rf"slots_read={slots_read} is not allowed: 0\.\.1024"):
        layout.decode_state(bytes(_state()), 1, slots_read=slots_read)


def test_slots_to_read_of_a_short_header_is_zero() -> None:
    assert layout.state_slots_to_read(b"") == 0
    assert layout.state_slots_to_read(bytes(_state())[: MARK + 7]) == 0


U64 = st.one_of(
    st.integers(0, 1 << 20),
    st.sampled_from([0, 1, layout.PID_MAX, layout.PLAUSIBLE_BYTES + 1, layout.U64_MAX]),
)


@settings(max_examples=60, deadline=None)
@given(
    device_count=st.integers(1, 3),
    slots=st.dictionaries(
        st.integers(0, layout.MAX_PROCS - 1),
        st.tuples(
            st.one_of(U64, st.just(layout.PID_RECLAIMING | 7)), U64, st.lists(U64, max_size=15)
        ),
        max_size=12,
    ),
    mark=st.one_of(st.integers(0, layout.MAX_PROCS + 2), st.just(layout.U64_MAX)),
    totals=st.lists(U64, min_size=3, max_size=3),
)
def test_reading_up_to_the_mark_decodes_as_the_whole_file(device_count, slots, mark, totals):
    buf = _state(device_count)
    for index, (pid, host_pid, counters) in slots.items():
        base = SLOTS + index * layout.SLOT_SIZE
        struct.pack_into("<QQ", buf, base, pid, host_pid)
        for n, value in enumerate(counters):
            struct.pack_into("<Q", buf, base + layout.SLOT_OFFSETS["devices"] + 8 * n, value)
    for d, value in enumerate(totals[:device_count]):
        offset = layout.STATE_OFFSETS["devices"] + d * layout.STATE_DEVICE_SIZE
        struct.pack_into("<Q", buf, offset + layout.STATE_DEVICE_OFFSETS["memory_used"], value)
    _mark(buf, mark)
    whole = layout.decode_state(bytes(buf), device_count)
    seen = layout.state_slots_to_read(buf)
    assert layout.decode_state(_partial(buf, seen), device_count, slots_read=seen) == whole
    below = [i for i, (pid, _, _) in slots.items() if pid and i < min(mark, layout.MAX_PROCS)]
    assert {p.pid for p in whole.processes} <= {slots[i][0] for i in below}

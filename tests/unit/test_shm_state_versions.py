"""`state` of ABI 1.0 and 1.1 side by side: sizes, the extension, and what each reader accepts."""

from __future__ import annotations

import struct

import pytest

from vgpu_agent.shm import layout


def _ext_offset(dev: int, field: str) -> int:
    return (layout.STATE_OFFSETS["ext"] + dev * layout.STATE_EXT_DEVICE_SIZE
            + layout.STATE_EXT_DEVICE_OFFSETS[field])


def _put_total(buf: bytearray, dev: int, memory: int) -> None:
    base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
    layout.store_u64(buf, base + layout.STATE_DEVICE_OFFSETS["memory_used"], memory)


def _set_version(buf: bytearray, minor: int, total: int) -> None:
    struct.pack_into("<I", buf, layout.STATE_OFFSETS["abi_minor"], minor)
    layout.store_u64(buf, layout.STATE_OFFSETS["total_size"], total)


def test_a_fresh_state_is_1_1_and_the_1_0_file_is_its_prefix() -> None:
    new = layout.encode_state(2)
    old = layout.encode_state(2, abi_minor=0)
    assert len(new) == layout.STATE_SIZE and len(old) == layout.STATE_SIZE_1_0
    # the same 1.0 part, but for the minor and the total size in the header
    assert new[:12] == old[:12] and new[16:24] == old[16:24]
    assert new[32 : layout.STATE_SIZE_1_0] == old[32:]
    assert struct.unpack_from("<II", new, 8) == (1, 1)
    assert struct.unpack_from("<II", old, 8) == (1, 0)
    with pytest.raises(layout.RegionFormatError, match="abi_minor=7"):
        layout.encode_state(1, abi_minor=7)


def test_memory_by_kind_is_read_and_data_is_the_rest() -> None:
    buf = bytearray(layout.encode_state(2))
    _put_total(buf, 0, 1000 * layout.KIND_UNIT)
    _put_total(buf, 1, 5)
    layout.store_u64(buf, _ext_offset(0, "memory_context"), 300 * layout.KIND_UNIT)
    layout.store_u64(buf, _ext_offset(0, "memory_module"), 20 * layout.KIND_UNIT)
    layout.store_u64(buf, _ext_offset(0, "memory_pool"), 100 * layout.KIND_UNIT)
    layout.store_u64(buf, _ext_offset(0, "graphs_unpriced"), 3)
    layout.store_u64(buf, _ext_offset(1, "memory_pool"), layout.KIND_UNIT)  # more than the total
    usage = layout.decode_state(bytes(buf), 2)
    assert usage.extension and usage.skipped_records == 0
    assert usage.memory_context == (300 * layout.KIND_UNIT, 0)
    assert usage.memory_module == (20 * layout.KIND_UNIT, 0)
    assert usage.memory_pool == (100 * layout.KIND_UNIT, layout.KIND_UNIT)
    assert usage.graphs_unpriced == (3, 0)
    assert usage.memory_data(0) == 580 * layout.KIND_UNIT
    assert usage.memory_data(1) == 0  # a kind counted before its total: never negative


def test_the_extension_read_apart_is_the_same_as_read_whole() -> None:
    buf = bytearray(layout.encode_state(1))
    layout.store_u64(buf, _ext_offset(0, "memory_module"), 8 * layout.KIND_UNIT)
    whole = layout.decode_state(bytes(buf), 1)
    ext = bytes(buf[layout.STATE_OFFSETS["ext"]:][: layout.STATE_EXT_SIZE])
    apart = layout.decode_state(bytes(buf[: layout.STATE_HEADER_SIZE]), 1, slots_read=0,
                                extension=ext)
    assert apart == whole and apart.memory_module == (8 * layout.KIND_UNIT,)
    assert layout.state_has_extension(bytes(buf[: layout.STATE_HEADER_SIZE]))
    # a reader that did not fetch it gets zeros, not garbage
    header_only = layout.decode_state(bytes(buf[: layout.STATE_HEADER_SIZE]), 1, slots_read=0)
    assert header_only.memory_module == (0,) and header_only.skipped_records == 0


def test_a_1_0_state_reads_with_every_kind_zero() -> None:
    buf = bytearray(layout.encode_state(1, abi_minor=0))
    _put_total(buf, 0, 42 << 20)
    usage = layout.decode_state(bytes(buf), 1)
    assert not usage.corrupt and not usage.extension and usage.skipped_records == 0
    assert usage.memory_used == (42 << 20,)
    assert usage.memory_context == usage.memory_module == usage.memory_pool == (0,)
    assert usage.memory_data(0) == 42 << 20
    assert not layout.state_has_extension(bytes(buf[: layout.STATE_HEADER_SIZE]))


def test_a_later_minor_that_appends_is_read_for_what_this_reader_knows() -> None:
    buf = bytearray(layout.encode_state(1)) + bytes(4096)
    _set_version(buf, 5, layout.STATE_SIZE + 4096)
    layout.store_u64(buf, _ext_offset(0, "memory_context"), layout.KIND_UNIT)
    usage = layout.decode_state(bytes(buf), 1)
    assert usage.skipped_records == 0 and usage.extension
    assert usage.memory_context == (layout.KIND_UNIT,)


@pytest.mark.parametrize(
    ("minor", "total"),
    [
        (0, layout.STATE_SIZE),  # a 1.0 file is exactly the 1.0 size
        (1, layout.STATE_SIZE_1_0),  # a 1.1 file claims the extension it does not have room for
        (1, layout.STATE_SIZE - 8),
        (0, 0),
    ],
)
def test_sizes_that_do_not_fit_the_minor_are_counted_and_the_extension_not_read(
    minor: int, total: int
) -> None:
    buf = bytearray(layout.encode_state(1))
    layout.store_u64(buf, _ext_offset(0, "memory_pool"), layout.KIND_UNIT)
    _set_version(buf, minor, total)
    usage = layout.decode_state(bytes(buf), 1)
    assert not usage.corrupt
    assert usage.skipped_records == 1
    assert usage.memory_pool == (0,) and not usage.extension
    assert layout.state_size_is_known(minor, total) is False


@pytest.mark.parametrize("field", ["memory_context", "memory_module", "memory_pool",
                                   "graphs_unpriced"])
def test_nonsense_in_the_extension_is_skipped_and_counted(field: str) -> None:
    buf = bytearray(layout.encode_state(1))
    layout.store_u64(buf, _ext_offset(0, field), layout.U64_MAX)
    usage = layout.decode_state(bytes(buf), 1)
    assert usage.skipped_records == 1
    assert getattr(usage, field) == (0,)


def test_an_extension_shorter_than_the_devices_is_counted() -> None:
    buf = bytearray(layout.encode_state(2))
    usage = layout.decode_state(bytes(buf[: layout.STATE_HEADER_SIZE]), 2, slots_read=0,
                                extension=b"\0" * 100)
    assert usage.skipped_records == 1 and usage.memory_pool == (0, 0)

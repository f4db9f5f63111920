"""control.flags (ABI 1.1): carved from reserved space, so every 1.0 field stays where it was;
all bits clear is the default, and a 1.0 file's reserved word never reads as a permission."""

from __future__ import annotations

import struct

import pytest

from vgpu_agent.shm import layout


def control(**kwargs: object) -> layout.Control:
    return layout.Control(devices=(layout.ControlDevice(uuid="GPU-1"),), device_ids=("GPU-1::0",),
                          **kwargs)  # type: ignore[arg-type]


def test_flags_sit_in_former_reserved_space_and_nothing_else_moved():
    assert layout.CONTROL_OFFSETS["flags"] == 80
    assert layout.CONTROL_OFFSETS["reserved"] == 88
    assert layout.CONTROL_HEADER_SIZE == 128 and layout.CONTROL_SIZE == 128 + 64 * 64 + 16 * 192
    for name, offset in (("generation", 32), ("heartbeat_ns", 40), ("seq", 56),
                         ("priority", 64), ("device_id_count", 72)):
        assert layout.CONTROL_OFFSETS[name] == offset


def test_flags_round_trip_and_default_to_nothing_allowed():
    assert layout.decode_control(layout.encode_control(control())).flags == 0
    both = layout.CONTROL_ALLOW_DISABLE | layout.CONTROL_ALLOW_REGION_DIR
    decoded = layout.decode_control(layout.encode_control(control(flags=both)))
    assert decoded.flags == both and decoded.abi_minor == 1


def test_a_1_0_files_reserved_word_is_no_permission():
    raw = bytearray(layout.encode_control(control(abi_minor=0)))
    struct.pack_into("<Q", raw, 80, layout.CONTROL_ALLOW_DISABLE)  # junk where 1.0 had reserved
    assert layout.decode_control(raw).flags == 0


def test_unknown_bits_are_refused_by_name():
    with pytest.raises(layout.RegionFormatError, match="flags=0x4 is not allowed"):
        layout.encode_control(control(flags=4))

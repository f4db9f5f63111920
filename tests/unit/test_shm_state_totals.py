"""The shim's device totals of launches and waiting are read from the `state` header, so the
control law needs no slot at all; nonsense there is read as nothing and counted."""

from __future__ import annotations

import struct

from vgpu_agent.shm import layout


def state_with_totals(launches: int, wait_ns: int) -> bytearray:
    buf = bytearray(layout.encode_state(2))
    base = layout.STATE_OFFSETS["devices"] + layout.STATE_DEVICE_SIZE  # device 1
    struct.pack_into("<Q", buf, base + layout.STATE_DEVICE_OFFSETS["launches"], launches)
    struct.pack_into("<Q", buf, base + layout.STATE_DEVICE_OFFSETS["wait_ns"], wait_ns)
    return buf


def test_totals_are_decoded_per_device_without_any_slot():
    usage = layout.decode_state(state_with_totals(12, 3_000_000), 2, slots_read=0)
    assert usage.launches == (0, 12) and usage.wait_ns == (0, 3_000_000)
    assert usage.processes == () and usage.skipped_records == 0


def test_implausible_totals_are_zero_and_counted():
    usage = layout.decode_state(state_with_totals(layout.U64_MAX, 1 << 63), 2, slots_read=0)
    assert usage.launches == (0, 0) and usage.wait_ns == (0, 0)
    assert usage.skipped_records == 2

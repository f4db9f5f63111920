"""The controller's lean read of a `state` header (`layout.state_counters`, and its C twin
`_statec.decode` where it was built): exactly the device totals a field-by-field reading gives,
and nothing from a header that is not one, whatever the container wrote into it."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm import headerread, layout

DECODERS = [pytest.param(layout.state_counters, id="python")]
if headerread._statec is not None:
    DECODERS.append(pytest.param(headerread._statec.decode, id="c"))

PLAUSIBLE = layout.PLAUSIBLE_COUNTER
COUNTERS = ("tokens_spent", "launches", "wait_ns")
PREFIX = ("magic", "abi_major", "abi_minor", "header_size", "device_count", "total_size")
WIDTH = {"magic": "Q", "total_size": "Q"}  # the rest of the prefix are 32-bit words


def field_by_field(header: bytes, device_count: int) -> tuple[int, ...] | None:
    """What the header says, read one named field at a time (the slow, obvious way)."""
    if len(header) < layout.STATE_HEADER_SIZE or not 1 <= device_count <= layout.MAX_DEVICES:
        return None
    prefix = {name: struct.unpack_from("<" + WIDTH.get(name, "I"), header,
                                       layout.STATE_OFFSETS[name])[0] for name in PREFIX}
    if (prefix["magic"] != layout.STATE_MAGIC or prefix["abi_major"] != layout.ABI_MAJOR
            or prefix["device_count"] != device_count
            or prefix["header_size"] < layout.STATE_HEADER_SIZE
            or prefix["total_size"] < prefix["header_size"]):
        return None
    out: list[int] = []
    for dev in range(device_count):
        base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for name in COUNTERS:
            value = struct.unpack_from("<Q", header, base + layout.STATE_DEVICE_OFFSETS[name])[0]
            if value > PLAUSIBLE:
                return None
            out.append(value)
    return tuple(out)


def header(device_count: int) -> bytearray:
    return bytearray(layout.encode_state(max(1, min(device_count, layout.MAX_DEVICES)))
                     [: layout.STATE_HEADER_SIZE])


def put(buf: bytearray, name: str, value: int) -> None:
    struct.pack_into("<" + WIDTH.get(name, "I"), buf, layout.STATE_OFFSETS[name], value)


def put_device(buf: bytearray, dev: int, name: str, value: int) -> None:
    base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
    struct.pack_into("<Q", buf, base + layout.STATE_DEVICE_OFFSETS[name], value)


@pytest.mark.parametrize("decode", DECODERS)
def test_each_devices_three_totals_in_order_and_nothing_else(decode):
    buf = header(3)
    for dev in range(3):
        for n, name in enumerate(COUNTERS):
            put_device(buf, dev, name, 100 * dev + n + 1)
        # the words around them, whatever they hold, are not the controller's business
        for other in ("balance", "last_refill_ns", "memory_used", "reserved"):
            put_device(buf, dev, other, layout.U64_MAX if other != "balance" else 0)
    assert decode(buf, 3) == (1, 2, 3, 101, 102, 103, 201, 202, 203)


@pytest.mark.parametrize("decode", DECODERS)
def test_a_counter_at_the_bound_is_read_and_one_past_it_is_not(decode):
    buf = header(2)
    put_device(buf, 1, "wait_ns", PLAUSIBLE)
    assert decode(buf, 2) == (0, 0, 0, 0, 0, PLAUSIBLE)
    put_device(buf, 1, "wait_ns", PLAUSIBLE + 1)
    assert decode(buf, 2) is None


@pytest.mark.parametrize("decode", DECODERS)
def test_what_is_not_a_header_for_these_devices_is_none(decode):
    buf = header(2)
    assert decode(buf, 1) is None  # another device count
    assert decode(buf, 0) is None and decode(buf, 17) is None
    assert decode(buf[:-1], 2) is None  # short
    for name, value in (("magic", 0), ("abi_major", 2), ("header_size", 64)):
        bad = bytearray(buf)
        put(bad, name, value)
        assert decode(bad, 2) is None, name
    bad = bytearray(buf)
    put(bad, "total_size", layout.STATE_HEADER_SIZE - 1)
    assert decode(bad, 2) is None


PREFIX_VALUES = {
    "magic": st.sampled_from([layout.STATE_MAGIC, 0, layout.STATE_MAGIC ^ 1]),
    "abi_major": st.sampled_from([layout.ABI_MAJOR, 0, 2, 2**32 - 1]),
    "abi_minor": st.integers(0, 2**32 - 1),
    "header_size": st.sampled_from([layout.STATE_HEADER_SIZE, layout.STATE_HEADER_SIZE - 8,
                                    layout.STATE_HEADER_SIZE + 256, 0, 2**32 - 1]),
    "device_count": st.integers(0, layout.MAX_DEVICES + 1),
    "total_size": st.sampled_from([layout.STATE_SIZE, layout.STATE_HEADER_SIZE - 1, 0,
                                   layout.STATE_HEADER_SIZE, 2**64 - 1]),
}
# mostly plausible counters, so that whole headers of them are read as often as refused
COUNTER_VALUES = st.one_of(st.integers(0, 10**12), st.integers(0, PLAUSIBLE), st.integers(0, 99),
                           st.sampled_from([PLAUSIBLE, PLAUSIBLE + 1, 2**63, 2**64 - 1]))


@pytest.mark.parametrize("decode", DECODERS)
@settings(max_examples=400, deadline=None)
@given(
    asked=st.integers(1, 3) | st.integers(-1, layout.MAX_DEVICES + 1),
    prefix=st.fixed_dictionaries({name: st.none() | values
                                  for name, values in PREFIX_VALUES.items()}),
    counters=st.lists(COUNTER_VALUES, min_size=3 * layout.MAX_DEVICES,
                      max_size=3 * layout.MAX_DEVICES),
    noise=st.just(b"") | st.binary(min_size=0, max_size=layout.STATE_HEADER_SIZE),
    cut=st.just(0) | st.integers(0, 16),
)
def test_the_lean_read_agrees_with_a_field_by_field_reading(
        decode, asked, prefix, counters, noise, cut):
    buf = header(asked)
    # whatever a container writes: random bytes over the header first, then fields on top
    buf[: len(noise)] = noise
    for name, value in prefix.items():
        if value is not None:
            put(buf, name, value)
    for dev in range(layout.MAX_DEVICES):
        for n, name in enumerate(COUNTERS):
            put_device(buf, dev, name, counters[3 * dev + n])
    data = bytes(buf[: len(buf) - cut])
    assert decode(data, asked) == field_by_field(data, asked)


@pytest.mark.parametrize("decode", DECODERS)
@settings(max_examples=200, deadline=None)
@given(data=st.data(), device_count=st.integers(1, layout.MAX_DEVICES),
       minor=st.integers(0, 9), grown=st.integers(0, 4096))
def test_every_well_formed_header_is_read_as_a_field_by_field_reading(
        decode, data, device_count, minor, grown):
    buf = header(device_count)
    put(buf, "abi_minor", minor)  # a later minor may grow the header; the totals stay put
    put(buf, "header_size", layout.STATE_HEADER_SIZE + grown)
    put(buf, "total_size", layout.STATE_SIZE + grown)
    for dev in range(layout.MAX_DEVICES):
        for name in COUNTERS:
            put_device(buf, dev, name, data.draw(st.integers(0, PLAUSIBLE)))
    expected = field_by_field(bytes(buf), device_count)
    assert expected is not None and len(expected) == 3 * device_count
    assert decode(bytes(buf), device_count) == expected

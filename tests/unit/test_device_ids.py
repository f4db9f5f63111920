"""Device IDs `<GPU-UUID>::<n>`: formatting and parsing round-trip; malformed IDs are named."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_agent.deviceplugin.ids import DeviceIdError, SliceId, format_device_id, parse_device_id

UUIDS = st.from_regex(
    r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fullmatch=True
)


@given(UUIDS, st.integers(min_value=0, max_value=999))
def test_format_then_parse_round_trips(uuid, n):
    device_id = format_device_id(uuid, n)
    assert len(device_id) <= 63
    assert parse_device_id(device_id) == SliceId(uuid, n)
    assert str(parse_device_id(device_id)) == device_id


@given(st.text(max_size=80))
def test_parse_never_raises_anything_but_device_id_error(text):
    try:
        uuid, n = parse_device_id(text)
    except DeviceIdError as err:
        assert repr(text) in str(err)
    else:
        assert format_device_id(uuid, n) == text


@pytest.mark.parametrize(
    "bad",
    [
        "GPU-abc",
        "GPU-abc::",
        "::3",
        "GPU-abc::-1",
        "GPU-abc::01",
        "GPU-abc::1.5",
        "GPU abc::1",
        "GPU-abc::1::2",
        "GPU-" + "a" * 60 + "::1",
    ],
)
def test_malformed_ids_are_rejected(bad):
    with pytest.raises(DeviceIdError):
        parse_device_id(bad)

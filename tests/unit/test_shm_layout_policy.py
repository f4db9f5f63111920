"""Storing a pod's policy and priority in `control`: framed by the generation, checked first."""

from __future__ import annotations

import pytest

from vgpu_agent.shm import layout


def control_bytes() -> bytearray:
    devices = tuple(
        layout.ControlDevice(f"GPU-{n}", core_limit=250_000, rate=5, burst=9,
                             policy=layout.POLICY_STRICT)
        for n in range(2)
    )
    return bytearray(layout.encode_control(layout.Control(devices, ("GPU-0::0",), seq=3)))


def test_policies_and_a_negative_priority_round_trip_and_close_the_generation():
    buf = control_bytes()
    generation = layout.set_policy(
        buf, [layout.POLICY_WORK_CONSERVING, layout.POLICY_OFF], -42
    )
    decoded = layout.decode_control(buf)
    assert [d.policy for d in decoded.devices] == [
        layout.POLICY_WORK_CONSERVING, layout.POLICY_OFF
    ]
    assert decoded.priority == -42
    assert generation == decoded.generation == 2
    # nothing else moved
    assert [(d.rate, d.burst, d.core_limit) for d in decoded.devices] == [(5, 9, 250_000)] * 2
    assert decoded.seq == 3 and decoded.device_ids == ("GPU-0::0",)


@pytest.mark.parametrize(
    ("policies", "priority", "match"),
    [
        ([7], 0, r"devices\[0\].policy=7"),
        ([layout.POLICY_STRICT], 1 << 63, "signed 64-bit"),
        ([layout.POLICY_STRICT], True, "signed 64-bit"),
    ],
)
def test_bad_values_are_refused_before_anything_is_stored(policies, priority, match):
    buf = control_bytes()
    before = bytes(buf)
    with pytest.raises(layout.RegionFormatError, match=match):
        layout.set_policy(buf, policies, priority)
    assert bytes(buf) == before

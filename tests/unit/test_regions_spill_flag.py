"""The spill policy reaches `control` per device, as VGPU_CONTROL_FLAG_SPILL."""

from pathlib import Path

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import RegionStore

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"


def test_each_device_gets_the_flag_its_grant_says(tmp_path: Path) -> None:
    store = RegionStore(tmp_path / "state", default_policy="strict")
    try:
        grant = Grant(
            (f"{U0}::0", f"{U1}::0"),
            (GrantedDevice(U0, 0, 1, 40 << 30, 25.0, spill=True),
             GrantedDevice(U1, 1, 1, 10 << 30, 25.0)),
        )
        region = store.create(grant)
        control = layout.decode_control((region.path / "control").read_bytes())
        assert control.devices[0].flags == layout.CONTROL_FLAG_SPILL
        assert control.devices[1].flags == 0
        assert control.abi_minor == 1  # the bit is part of 1.1: no version change
    finally:
        store.close()


def test_a_control_with_flag_bits_decodes_and_keeps_them() -> None:
    # a reader (agent or shim) keeps bits it does not know and acts on none of them
    bits = layout.CONTROL_FLAG_SPILL | 1 << 63
    data = layout.encode_control(
        layout.Control(devices=(layout.ControlDevice(U0, 1 << 30, flags=bits),))
    )
    assert layout.decode_control(data).devices[0].flags == bits

"""The Python region layout matches shim/include/vgpu_shm.h, field by field (compiled with gcc)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vgpu_agent.shm import layout

HEADER_DIR = Path(__file__).resolve().parents[2] / "shim" / "include"

STRUCTS = {
    "vgpu_control": (layout.CONTROL_OFFSETS, layout.CONTROL_SIZE),
    "vgpu_control_device": (layout.CONTROL_DEVICE_OFFSETS, layout.CONTROL_DEVICE_SIZE),
    "vgpu_state": (layout.STATE_OFFSETS, layout.STATE_SIZE),
    "vgpu_state_device": (layout.STATE_DEVICE_OFFSETS, layout.STATE_DEVICE_SIZE),
    "vgpu_proc_slot": (layout.SLOT_OFFSETS, layout.SLOT_SIZE),
    "vgpu_proc_device": (layout.PROC_DEVICE_OFFSETS, layout.PROC_DEVICE_SIZE),
    "vgpu_state_ext_device": (layout.STATE_EXT_DEVICE_OFFSETS, layout.STATE_EXT_DEVICE_SIZE),
    "vgpu_proc_kinds": (layout.PROC_KINDS_OFFSETS, layout.PROC_KINDS_SIZE),
}

CONSTANTS = {
    "VGPU_CONTROL_MAGIC": layout.CONTROL_MAGIC,
    "VGPU_STATE_MAGIC": layout.STATE_MAGIC,
    "VGPU_ABI_MAJOR": layout.ABI_MAJOR,
    "VGPU_ABI_MINOR": layout.ABI_MINOR,
    "VGPU_MAX_DEVICES": layout.MAX_DEVICES,
    "VGPU_MAX_DEVICE_IDS": layout.MAX_DEVICE_IDS,
    "VGPU_DEVICE_ID_LEN": layout.DEVICE_ID_LEN,
    "VGPU_UUID_LEN": layout.UUID_LEN,
    "VGPU_MAX_PROCS": layout.MAX_PROCS,
    "VGPU_POLICY_OFF": layout.POLICY_OFF,
    "VGPU_POLICY_STRICT": layout.POLICY_STRICT,
    "VGPU_POLICY_WORK_CONSERVING": layout.POLICY_WORK_CONSERVING,
    "VGPU_CORE_LIMIT_FULL": layout.CORE_LIMIT_FULL,
    "VGPU_DEFAULT_GRAPH_COST": layout.DEFAULT_GRAPH_COST,
    "VGPU_MAX_SLEEP_NS": layout.MAX_SLEEP_NS,
    "VGPU_MAX_WAIT_NS": layout.MAX_WAIT_NS,
    "VGPU_PID_RECLAIMING": layout.PID_RECLAIMING,
    "VGPU_KIND_UNIT": layout.KIND_UNIT,
    "VGPU_CONTROL_FLAG_SPILL": layout.CONTROL_FLAG_SPILL,
    "VGPU_STATE_SIZE_1_0": layout.STATE_SIZE_1_0,
}


def _program() -> str:
    lines = ['#include "vgpu_shm.h"', "#include <stdio.h>", "int main(void) {"]
    for struct_name, (offsets, _) in STRUCTS.items():
        lines.append(f'printf("{struct_name} sizeof %zu\\n", sizeof(struct {struct_name}));')
        for field in offsets:
            lines.append(
                f'printf("{struct_name} {field} %zu\\n", offsetof(struct {struct_name}, {field}));'
            )
    for name in CONSTANTS:
        lines.append(f'printf("const {name} %llu\\n", (unsigned long long)({name}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], int]:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required to check the region ABI against its header")
    work = tmp_path_factory.mktemp("abi")
    source = work / "abi.c"
    source.write_text(_program())
    binary = work / "abi"
    subprocess.run(
        ["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", f"-I{HEADER_DIR}", str(source),
         "-o", str(binary)],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    result = {}
    for line in out.splitlines():
        scope, name, value = line.split()
        result[(scope, name)] = int(value)
    return result


@pytest.mark.parametrize("struct_name", sorted(STRUCTS))
def test_struct_offsets_and_size_match_header(
    c_layout: dict[tuple[str, str], int], struct_name: str
) -> None:
    offsets, size = STRUCTS[struct_name]
    assert c_layout[(struct_name, "sizeof")] == size
    for field, offset in offsets.items():
        assert c_layout[(struct_name, field)] == offset, field


def test_constants_match_header(c_layout: dict[tuple[str, str], int]) -> None:
    for name, value in CONSTANTS.items():
        assert c_layout[("const", name)] == value, name


def test_header_sizes_are_the_documented_ones() -> None:
    assert layout.CONTROL_OFFSETS["device_ids"] == layout.CONTROL_HEADER_SIZE
    assert layout.STATE_OFFSETS["slots"] == layout.STATE_HEADER_SIZE
    # every 64-bit field the agent stores must be naturally aligned in the file
    for field in ("generation", "heartbeat_ns"):
        assert layout.CONTROL_OFFSETS[field] % 8 == 0
    for dev in range(layout.MAX_DEVICES):
        for field in ("rate", "burst", "memory_limit", "core_limit", "policy", "graph_cost"):
            assert layout.control_device_offset(dev, field) % 8 == 0
    assert layout.STATE_SIZE < 1 << 20  # the header promises a state file under 1 MiB
    # the high-water mark took the first reserved word: nothing after it moved
    assert layout.STATE_OFFSETS["slot_high_water"] == 40
    assert layout.STATE_OFFSETS["reserved"] == 48
    assert layout.STATE_OFFSETS["devices"] == 64
    # 1.1 appends: everything of 1.0 stays where it was, the extension starts at its end
    assert layout.STATE_OFFSETS["ext"] == layout.STATE_SIZE_1_0 == 689_216
    assert layout.STATE_SIZE > layout.STATE_SIZE_1_0

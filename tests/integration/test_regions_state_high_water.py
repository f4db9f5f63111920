"""`Region.usage()` reads a `state` file's header and only the slots below its high-water mark."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, RegionStore

GIB = 1 << 30
UUID = "GPU-11111111-2222-3333-4444-555555555555"
MARK = layout.STATE_OFFSETS["slot_high_water"]


@pytest.fixture
def region(tmp_path: Path) -> Iterator[Region]:
    store = RegionStore(tmp_path / "state")
    store.adopt()
    region = store.create(Grant((f"{UUID}::0",), (GrantedDevice(UUID, 0, 1, 20 * GIB, 25.0),)))
    # about the mark, not the budget: as if the host had proven a process per slot
    region.limit_slots(layout.MAX_PROCS)
    yield region
    store.close()


def _write(path: Path, offset: int, fmt: str, *values: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def _process(state: Path, index: int, pid: int, memory: int = 0) -> None:
    """A slot written by hand; the mark is left alone (each test sets the one it means)."""
    base = layout.STATE_OFFSETS["slots"] + index * layout.SLOT_SIZE
    _write(state, base, "<QQ", pid, 50000 + pid)
    _write(state, base + layout.SLOT_OFFSETS["devices"], "<Q", memory)


def test_a_new_region_reads_empty_with_mark_zero(region: Region) -> None:
    usage = region.usage()
    assert not usage.corrupt and usage.processes == () and usage.skipped_records == 0
    with open(region.path / "state", "rb") as f:
        assert layout.load_u64(f.read(layout.STATE_HEADER_SIZE), MARK) == 0


def test_only_slots_below_the_mark_are_read(region: Region) -> None:
    state = region.path / "state"
    _process(state, 0, 10, memory=GIB)
    _process(state, 4, 11)
    _write(state, MARK, "<Q", 1)
    assert [p.pid for p in region.usage().processes] == [10]
    _write(state, MARK, "<Q", 5)  # the shim raised it for slot 4
    usage = region.usage()
    assert [(p.pid, p.host_pid) for p in usage.processes] == [(10, 50010), (11, 50011)]
    assert usage.processes[0].memory_used == (GIB,) and usage.skipped_records == 0


def test_nothing_past_the_marks_slots_is_read(region: Region) -> None:
    # every slot past the mark holds nonsense (a pid no kernel hands out): a reader that looked
    # there would count it. (The file is not cut short: since ABI 1.1 its end holds the per-device
    # extension, which the reader fetches apart.)
    state = region.path / "state"
    _process(state, 1, 12)
    _write(state, MARK, "<Q", 2)
    with open(state, "r+b") as f:
        f.seek(layout.STATE_HEADER_SIZE + 2 * layout.SLOT_SIZE)
        f.write(b"\xff" * ((layout.MAX_PROCS - 2) * layout.SLOT_SIZE))
    usage = region.usage()
    assert [p.pid for p in usage.processes] == [12]
    assert not usage.corrupt and usage.skipped_records == 0


def test_a_mark_past_the_end_of_a_truncated_file_is_counted(region: Region) -> None:
    state = region.path / "state"
    _process(state, 0, 13)
    _process(state, 2, 14)
    _write(state, MARK, "<Q", 900)
    os.truncate(state, layout.STATE_HEADER_SIZE + 3 * layout.SLOT_SIZE - 1)
    usage = region.usage()  # never raises, never reads what is not there
    assert not usage.corrupt
    assert [p.pid for p in usage.processes] == [13]  # slot 2 is cut short
    # the slots cut short, and the 1.1 extension that should follow them
    assert usage.skipped_records == 2 and region.skipped_records == 2


@pytest.mark.parametrize("mark", [layout.MAX_PROCS + 1, layout.U64_MAX])
def test_a_nonsense_mark_is_clamped_and_counted(region: Region, mark: int) -> None:
    state = region.path / "state"
    _process(state, 0, 15)
    _process(state, layout.MAX_PROCS - 1, 16)
    _write(state, MARK, "<Q", mark)
    usage = region.usage()
    assert [p.pid for p in usage.processes] == [15, 16]
    assert usage.skipped_records == 1


def test_a_header_cut_before_the_mark_is_corrupt(region: Region) -> None:
    state = region.path / "state"
    _write(state, MARK, "<Q", 3)
    os.truncate(state, MARK + 4)
    assert region.usage().corrupt
    assert region.corrupt_reads == 1


def test_the_reader_follows_the_mark_as_it_rises_and_slots_come_and_go(region: Region) -> None:
    state = region.path / "state"
    seen = []
    for step, (index, pid) in enumerate([(0, 20), (1, 21), (2, 22)]):
        _write(state, MARK, "<Q", index + 1)
        _process(state, index, pid)
        seen.append([p.pid for p in region.usage().processes])
        if step == 1:
            _process(state, 0, 0)  # the first process ended; its slot is free, the mark stays
    assert seen == [[20], [20, 21], [21, 22]]

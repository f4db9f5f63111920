"""Agent restarts and damaged region files: adoption as-is, quarantine, defensive reads."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import QUARANTINE_KEEP, Region, RegionError, RegionStore

GIB = 1 << 30
UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-66666666-7777-8888-9999-000000000000"


def grant(*slices: tuple[str, int]) -> Grant:
    ids = tuple(f"{uuid}::{n}" for uuid, n in slices)
    per_gpu: dict[str, int] = {}
    for uuid, _ in slices:
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    devices = tuple(
        GrantedDevice(uuid, i, count, count * 20 * GIB, count * 25.0)
        for i, (uuid, count) in enumerate(per_gpu.items())
    )
    return Grant(ids, devices)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def new_store(state_dir: Path, **kwargs: object) -> RegionStore:
    store = RegionStore(state_dir, **kwargs)  # type: ignore[arg-type]
    store.adopt()
    return store


# ---- restart -----------------------------------------------------------------------------


def test_restart_adopts_regions_without_rewriting_their_limits(state_dir: Path) -> None:
    before = new_store(state_dir, default_policy="work-conserving")
    two_gpus = before.create(grant((UUID0, 0), (UUID1, 2)))
    one_gpu = before.create(grant((UUID0, 1)))
    two_gpus.set_rate(0, 123_456, 7_890)
    two_gpus.set_rate(1, 42, 4)
    two_gpus.beat(555)
    files_before = {
        r.alloc_id: (r.path / "control").read_bytes() for r in (two_gpus, one_gpu)
    }
    before.close()

    after = RegionStore(state_dir, default_policy="off")  # another default must not leak in
    adopted = after.adopt()
    assert [r.alloc_id for r in adopted] == [two_gpus.alloc_id, one_gpu.alloc_id]
    assert after.counters.adopted == 2 and after.counters.created == 0
    again = after.get(two_gpus.alloc_id)
    assert again is not None
    assert again.rate(0) == (123_456, 7_890) and again.rate(1) == (42, 4)
    assert again.policy(0) == "work-conserving"
    assert again.heartbeat_ns == 555
    assert again.device_ids == (f"{UUID0}::0", f"{UUID1}::2")
    assert again.memory_limit(1) == 20 * GIB and again.core_limit(1) == 25.0
    for region in after.regions():
        assert (region.path / "control").read_bytes() == files_before[region.alloc_id]

    # and the sequence continues after the adopted ones
    third = after.create(grant((UUID1, 0)))
    assert third.seq == 3 and third.alloc_id > one_gpu.alloc_id
    after.close()


def test_sequence_continues_without_adopt_and_after_quarantine(state_dir: Path) -> None:
    first = RegionStore(state_dir)
    for _ in range(3):
        first.create(grant((UUID0, 0)))
    first.close()
    newest = max(os.listdir(state_dir / "regions"))
    (state_dir / "regions" / newest / "control").write_bytes(b"junk")  # will be moved aside

    second = RegionStore(state_dir)
    assert second.create(grant((UUID0, 1))).seq == 4  # no adopt(): read from the names
    second.close()
    third = new_store(state_dir)
    assert third.counters.corrupt == 1
    assert third.create(grant((UUID0, 1))).seq == 5
    third.close()


def test_leftovers_of_interrupted_work_are_cleaned_and_unknown_entries_kept(
    state_dir: Path,
) -> None:
    store = new_store(state_dir)
    kept = store.create(grant((UUID0, 0)))
    store.close()
    regions = state_dir / "regions"
    (regions / ".new-000000000009-abcdef01").mkdir()
    (regions / ".new-000000000009-abcdef01" / "control").write_bytes(b"half")
    (regions / ".gc-000000000002-abcdef01").mkdir()
    (regions / "lost+found").mkdir()
    (regions / "README").write_text("notes")

    again = RegionStore(state_dir)
    assert [r.alloc_id for r in again.adopt()] == [kept.alloc_id]
    assert sorted(os.listdir(regions)) == sorted([kept.alloc_id, "lost+found", "README"])
    assert again.counters.corrupt == 0
    again.close()


def test_adopting_twice_does_not_open_regions_twice(state_dir: Path) -> None:
    store = new_store(state_dir)
    store.create(grant((UUID0, 0)))
    assert store.adopt() == []
    assert len(store.regions()) == 1
    store.close()


# ---- damaged control files ----------------------------------------------------------------


def _control_damage(path: Path) -> dict[str, object]:
    good = (path / "control").read_bytes()

    def patched(offset: int, fmt: str, value: int) -> bytes:
        data = bytearray(good)
        struct.pack_into(fmt, data, offset, value)
        return bytes(data)

    dev0 = layout.CONTROL_OFFSETS["devices"]
    return {
        "truncated": good[:100],
        "empty": b"",
        "wrong magic": patched(0, "<Q", 0x1234),
        "newer major": patched(8, "<I", layout.ABI_MAJOR + 1),
        "garbage": os.urandom(len(good)),
        "huge device count": patched(20, "<I", 0xFFFFFFFF),
        "huge device ID count": patched(layout.CONTROL_OFFSETS["device_id_count"], "<I", 10**9),
        "unknown policy": patched(dev0 + layout.CONTROL_DEVICE_OFFSETS["policy"], "<Q", 77),
        "zero core limit": patched(dev0 + layout.CONTROL_DEVICE_OFFSETS["core_limit"], "<Q", 0),
        "seq of another region": patched(layout.CONTROL_OFFSETS["seq"], "<Q", 999),
        "longer than the ABI": good + b"\0" * 8,
    }


def test_damaged_control_files_are_quarantined_and_the_rest_adopted(state_dir: Path) -> None:
    store = new_store(state_dir)
    healthy = store.create(grant((UUID1, 3)))
    sample = store.create(grant((UUID0, 0)))
    damage = _control_damage(sample.path)
    store.close()
    shutil.rmtree(sample.path)
    names = {}
    for seq, (what, data) in enumerate(damage.items(), start=10):
        path = state_dir / "regions" / f"{seq:012d}-0000beef"
        path.mkdir()
        (path / "control").write_bytes(data)  # type: ignore[arg-type]
        (path / "state").write_bytes(layout.encode_state(1))
        names[path.name] = what
    # and a few that are not even files
    odd = state_dir / "regions"
    (odd / "000000000030-0000beef").mkdir()  # no control at all
    (odd / "000000000031-0000beef").mkdir()
    (odd / "000000000031-0000beef" / "control").symlink_to(healthy.path / "control")
    (odd / "000000000032-0000beef").mkdir()
    os.mkfifo(odd / "000000000032-0000beef" / "control")

    after = RegionStore(state_dir)
    adopted = after.adopt()
    assert [r.alloc_id for r in adopted] == [healthy.alloc_id]
    assert after.counters.corrupt == len(damage) + 3
    assert os.listdir(state_dir / "regions") == [healthy.alloc_id]
    quarantined = os.listdir(state_dir / "regions.corrupt")
    assert len(quarantined) == min(QUARANTINE_KEEP, len(damage) + 3)
    assert after.create(grant((UUID0, 0))).seq == 33  # numbers of quarantined regions not reused
    after.close()


def test_quarantine_keeps_only_the_newest(state_dir: Path) -> None:
    regions = state_dir / "regions"
    regions.mkdir(parents=True)
    for seq in range(1, QUARANTINE_KEEP + 6):
        (regions / f"{seq:012d}-0000beef").mkdir()
    store = new_store(state_dir)
    assert store.counters.corrupt == QUARANTINE_KEEP + 5
    kept = sorted(os.listdir(state_dir / "regions.corrupt"))
    assert len(kept) == QUARANTINE_KEEP
    assert kept[0].startswith("000000000006-")


# ---- damaged state files ------------------------------------------------------------------


def _slot_offset(index: int, field: str = "pid") -> int:
    return layout.STATE_OFFSETS["slots"] + index * layout.SLOT_SIZE + layout.SLOT_OFFSETS[field]


def _write(path: Path, offset: int, fmt: str, *values: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def _claim(path: Path, index: int, pid: int, host_pid: int) -> None:
    """Take slot `index` as the shim does: raise the high-water mark above it, then the pid."""
    mark = layout.STATE_OFFSETS["slot_high_water"]
    with open(path, "rb") as f:
        f.seek(mark)
        current = struct.unpack("<Q", f.read(8))[0]
    _write(path, mark, "<Q", max(current, index + 1))
    _write(path, _slot_offset(index), "<QQ", pid, host_pid)


@pytest.fixture
def region(state_dir: Path):
    store = new_store(state_dir)
    region = store.create(grant((UUID0, 0), (UUID1, 1)))
    yield region
    store.close()


def test_a_live_process_is_read(region: Region) -> None:
    state = region.path / "state"
    _claim(state, 5, 17, 40017)
    devices = _slot_offset(5, "devices")
    _write(state, devices, "<5Q", 3 * GIB, 10, 1000, 99, 12345)  # device 0
    _write(state, layout.STATE_OFFSETS["devices"] + 16, "<QQ", 3 * GIB, 1000)
    region.limit_slots(4)  # four processes proven on its GPUs: slots up to 5 are read
    usage = region.usage()
    assert not usage.corrupt and usage.skipped_records == 0
    (proc,) = usage.processes
    assert (proc.pid, proc.host_pid) == (17, 40017)
    assert proc.memory_used == (3 * GIB, 0) and proc.tokens_spent == (1000, 0)
    assert usage.memory_used == (3 * GIB, 0)


@pytest.mark.parametrize(
    "damage",
    [
        "truncated to nothing",
        "truncated inside the header",
        "truncated inside the slots",
        "wrong magic",
        "garbage",
        "huge slot count",
        "huge slot high-water mark",
        "huge device count",
        "device count unlike control",
        "huge counters",
        "pid beyond pid_max",
    ],
)
def test_damaged_state_is_survived(region: Region, damage: str) -> None:
    state = region.path / "state"
    _claim(state, 0, 7, 0)  # one sane process, to see what survives
    if damage == "truncated to nothing":
        os.truncate(state, 0)
    elif damage == "truncated inside the header":
        os.truncate(state, 40)
    elif damage == "truncated inside the slots":
        os.truncate(state, _slot_offset(3) + 100)
    elif damage == "wrong magic":
        _write(state, 0, "<Q", 0xDEADBEEF)
    elif damage == "garbage":
        state.write_bytes(os.urandom(layout.STATE_SIZE))
    elif damage == "huge slot count":
        _write(state, layout.STATE_OFFSETS["slot_count"], "<I", 0xFFFFFFFF)
    elif damage == "huge slot high-water mark":
        _write(state, layout.STATE_OFFSETS["slot_high_water"], "<Q", 1 << 63)
    elif damage == "huge device count":
        _write(state, 20, "<I", 0xFFFFFFFF)
    elif damage == "device count unlike control":
        _write(state, 20, "<I", 1)
    elif damage == "huge counters":
        _claim(state, 1, 8, 0)
        _write(state, _slot_offset(1, "devices"), "<5Q", 1 << 63, 1 << 63, 1 << 63, 0, 0)
        _write(state, layout.STATE_OFFSETS["devices"], "<qQQQ", -(1 << 63), 0, 1 << 63, 1 << 63)
    elif damage == "pid beyond pid_max":
        _claim(state, 1, 1 << 40, 1 << 40)

    usage = region.usage()  # never raises
    corrupt_expected = damage in {
        "truncated to nothing",
        "truncated inside the header",
        "wrong magic",
        "garbage",
        "huge device count",
        "device count unlike control",
    }
    if damage == "garbage":
        assert usage.corrupt  # random bytes have the magic with probability 2**-64
    assert usage.corrupt == corrupt_expected
    if usage.corrupt:
        assert usage.processes == () and region.corrupt_reads == 1
    else:
        assert [p.pid for p in usage.processes] == [7]  # the sane process is still there
        assert region.corrupt_reads == 0
        if damage in {
            "huge slot count",
            "huge slot high-water mark",
            "huge counters",
            "pid beyond pid_max",
        }:
            assert usage.skipped_records >= 1
    # The limits are untouched and the region still takes rates.
    region.set_rate(1, 1000, 10)
    assert region.rate(1) == (1000, 10) and region.memory_limit(0) == 20 * GIB


def test_state_replaced_by_something_else_is_survived(state_dir: Path) -> None:
    store = new_store(state_dir)
    fifo = store.create(grant((UUID0, 0)))
    link = store.create(grant((UUID0, 1)))
    gone = store.create(grant((UUID0, 2)))
    store.close()
    os.unlink(fifo.path / "state")
    os.mkfifo(fifo.path / "state")  # opening it for reading must not hang the agent
    os.unlink(link.path / "state")
    secret = state_dir / "secret"
    secret.write_bytes(layout.encode_state(1))
    (link.path / "state").symlink_to(secret)  # must not be followed out of the region
    os.unlink(gone.path / "state")

    after = RegionStore(state_dir)
    assert len(after.adopt()) == 3  # control is fine: the limits still apply
    for region in after.regions():
        usage = region.usage()
        assert usage.corrupt and region.corrupt_reads == 1
    # A state file that comes back is picked up.
    (gone.path / "state").write_bytes(layout.encode_state(1))
    region = after.get(gone.alloc_id)
    assert region is not None and not region.usage().corrupt
    after.close()


def test_state_truncated_while_open_does_not_crash_the_reader(region: Region) -> None:
    state = region.path / "state"
    assert not region.usage().corrupt
    with open(state, "r+b") as f:  # the same inode the region holds open
        f.truncate(50)
    assert region.usage().corrupt
    with open(state, "r+b") as f:
        f.write(layout.encode_state(2))
    assert not region.usage().corrupt


# ---- the handle ---------------------------------------------------------------------------


def test_rates_are_framed_by_the_generation_and_visible_to_a_reader(region: Region) -> None:
    assert region.generation == 0
    region.set_rate(0, 5_000, 100)
    assert region.generation == 2
    seen = layout.decode_control((region.path / "control").read_bytes())
    assert (seen.devices[0].rate, seen.devices[0].burst) == (5_000, 100)
    assert (seen.devices[1].rate, seen.devices[1].burst) == (0, 0)
    region.beat(987_654_321)
    assert layout.decode_control((region.path / "control").read_bytes()).heartbeat_ns == 987_654_321


def test_bad_arguments_name_the_problem(region: Region) -> None:
    with pytest.raises(IndexError, match="device index 2 out of range"):
        region.rate(2)
    with pytest.raises(IndexError, match=r"allowed 0\.\.1"):
        region.set_rate(-1, 1, 1)
    with pytest.raises(layout.RegionFormatError, match="rate="):
        region.set_rate(0, -5, 1)
    region.close()
    with pytest.raises(RegionError, match="is closed"):
        region.set_rate(0, 1, 1)
    assert region.usage().corrupt  # a closed region reads as unreadable, without raising
    assert region.corrupt_reads == 0


def test_store_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="default core policy 'fair'"):
        RegionStore(tmp_path, default_policy="fair")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace"):
        RegionStore(tmp_path, gc_grace_s=-1)
    with pytest.raises(ValueError, match="container_region_dir='run/vgpu'"):
        RegionStore(tmp_path, container_region_dir="run/vgpu")


def test_grant_the_abi_cannot_hold_is_refused(state_dir: Path) -> None:
    store = new_store(state_dir)
    too_many = grant(*[(f"GPU-{i:04d}", 0) for i in range(layout.MAX_DEVICES + 1)])
    with pytest.raises(RegionError, match="17 devices"):
        store.create(too_many)
    assert store.counters.create_failures == 1
    assert os.listdir(state_dir / "regions") == []  # no half region left behind
    store.close()

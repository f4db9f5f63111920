"""Many regions' `state` headers and rates in force in one native call
(`Region.readings_together`), as the controller reads them each tick on the monotonic clock: the
same counters as each region's own `counters` and the same controls as its `controls`, each
header between its own stamps; a region whose file checks are due is checked there when they
find nothing; the regions it cannot take (another reader holding the lock, file checks that find
something, the directory's sweep due, a fake, a closed region, no native read) are left to be
read one by one, and a corrupt header is counted and told once, as by `counters`."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.integration.test_controller_region_files import UUID, make_region_dir
from vgpu_agent.shm import layout, regions
from vgpu_agent.shm.regions import STATE_FILE, Region
from vgpu_agent.throttle.controller import ThrottleController


def _spend(path: Path, tokens: int, launches: int, waited: int) -> None:
    with open(path / STATE_FILE, "r+b") as f:
        buf = bytearray(f.read())
        dev = layout.STATE_OFFSETS["devices"]
        for name, value in (("tokens_spent", tokens), ("launches", launches),
                            ("wait_ns", waited)):
            struct.pack_into("<Q", buf, dev + layout.STATE_DEVICE_OFFSETS[name], value)
        f.seek(0)
        f.write(buf)


def _regions(tmp_path: Path, count: int) -> list[Region]:
    out = []
    for n in range(count):
        root = tmp_path / f"r{n}"
        root.mkdir()
        path = make_region_dir(root, 30.0, layout.POLICY_STRICT)
        _spend(path, 1000 * (n + 1), 10 * (n + 1), n)
        region = Region.open(path)
        assert region.counters() == (1000 * (n + 1), 10 * (n + 1), n)  # (its files checked)
        out.append(region)
    return out


@pytest.fixture(params=["loop in C", "loop in Python"])
def native(request, monkeypatch) -> None:
    """The batch read, its loop over the regions in C (`readings_of`) and in Python (the
    reference): every test that takes it holds both to the same behaviour."""
    if regions.readings_many is None:
        pytest.skip("the C read was not built")
    if request.param == "loop in C":
        if regions.readings_of is None:
            pytest.skip("the C read was built without its loop")
    else:
        monkeypatch.setattr(regions, "readings_of", None)


def test_the_same_counters_and_controls_as_each_regions_own_each_between_its_stamps(
        tmp_path, native):
    rs = _regions(tmp_path, 4)
    rs[3].close()
    rs[0].set_rate(0, 1234, 99)
    rs[2].set_rate(0, 2**40, 2**33)
    rs[1].set_policy("work-conserving", 7)

    class Fake:  # a region of another kind: read the usual way
        closed = False

    before = time.monotonic_ns()
    got = Region.readings_together([rs[0], Fake(), rs[1], rs[2], rs[3]])
    after = time.monotonic_ns()
    # every lock given back (a lock kept would hang the reads below, not fail them)
    assert not any(region._fd_lock.locked() for region in rs)
    assert got[1] is None and got[4] is None
    read = [got[0], got[2], got[3]]
    assert [r[0] for r in read] == [rs[n].counters() for n in range(3)]  # type: ignore[index]
    assert [r[1:4] for r in read] == [rs[n].controls() for n in range(3)]  # type: ignore[index]
    assert read[0][1] == (1234, 99) and read[2][1] == (2**40, 2**33)  # type: ignore[index]
    assert read[1][2:4] == (("work-conserving",), 7)  # type: ignore[index]
    stamps = [stamp for r in read for stamp in r[4:]]  # type: ignore[index]
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
    for region in rs:
        region.close()


def test_regions_it_cannot_take_are_left_to_their_own_read(tmp_path, native):
    rs = _regions(tmp_path, 3)
    # another reader (the metrics' thread) holds one's lock: it may be reopening the file
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with rs[0]._fd_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        # its files due for their checks, the directory's sweep among them
        rs[1]._policed_ns = time.monotonic_ns() - 10**9
        rs[1]._reads = regions._POLICE_EVERY
        got = Region.readings_together(rs)
        assert got[0] is None and got[1] is None and got[2] is not None
    finally:
        release.set()
        holder.join()
    # its own read checked its files: the next batch takes it
    assert rs[1].counters() is not None
    got = Region.readings_together(rs)
    assert all(g is not None for g in got)
    assert not any(region._fd_lock.locked() for region in rs)  # every lock given back
    for region in rs:
        region.close()


def test_file_checks_due_are_made_in_the_batch_where_they_find_nothing(tmp_path, native):
    rs = _regions(tmp_path, 5)  # each region's files checked once, the sweep with them
    long_ago = time.monotonic_ns() - 10**9
    for region in rs:
        region._policed_ns = long_ago  # every region's checks due
    # 1: its `state` replaced by a file of the container's; 2: grown past its size; 3: gone
    # from its path; 4: the directory's sweep due, with a file the container put there
    replacement = rs[1].path / "elsewhere"
    replacement.write_bytes((rs[1].path / STATE_FILE).read_bytes())
    replacement.rename(rs[1].path / STATE_FILE)
    _spend(rs[1].path, 10**6, 1, 0)  # into the new file: the agent still holds the old one
    with open(rs[2].path / STATE_FILE, "ab") as f:
        f.write(b"\0" * 4096)
    (rs[3].path / STATE_FILE).rename(rs[3].path / "moved")
    rs[4]._reads = regions._POLICE_EVERY
    (rs[4].path / "planted").write_bytes(b"x")
    reads = [region._reads for region in rs]

    got = Region.readings_together(rs)
    # the one whose checks find nothing is read here, its checks counted as made
    assert got[0] is not None and got[0][0] == rs[0].counters()
    assert rs[0]._policed_ns > long_ago and rs[0]._reads == reads[0] + 1  # (the sweep's count)
    # the others are left to their own read, nothing counted, and that read acts
    assert got[1:] == [None] * 4
    assert [region._reads for region in rs[1:]] == reads[1:]
    assert all(region._policed_ns == long_ago for region in rs[1:])
    with capture_logs() as logs:
        assert rs[1].counters() is not None
        assert rs[2].counters() is not None
        assert rs[3].counters() is not None
        assert rs[4].counters() is not None
    assert rs[1].state_replaced == 1
    assert (rs[2].path / STATE_FILE).stat().st_size == layout.STATE_SIZE
    assert not (rs[4].path / "planted").exists()
    assert "region_state_replaced" in [e["event"] for e in logs]
    # checked: the next batch takes the four whose files are in order again (3's path is
    # still empty: left to its own read each time its checks come due)
    for region in rs:
        region._policed_ns = long_ago
    got = Region.readings_together(rs)
    assert [g is not None for g in got] == [True, True, True, False, True]
    assert got[1][0] == (10**6, 1, 0)  # type: ignore[index]
    assert not any(region._fd_lock.locked() for region in rs)
    for region in rs:
        region.close()


def test_a_corrupt_header_is_counted_and_told_once(tmp_path, native):
    rs = _regions(tmp_path, 2)
    with open(rs[1].path / STATE_FILE, "r+b") as f:
        f.write(b"\0" * 8)  # its magic gone
    with capture_logs() as logs:
        for _ in range(3):
            got = Region.readings_together(rs)
            assert got[0] is not None and got[0][0] is not None
            assert got[1] is not None and got[1][0] is None
    assert rs[1].corrupt_reads == 3 and rs[0].corrupt_reads == 0
    assert [e["event"] for e in logs] == ["region_state_corrupt"]
    for region in rs:
        region.close()


def test_without_the_native_read_every_region_is_read_its_own_way(tmp_path, monkeypatch):
    rs = _regions(tmp_path, 2)
    monkeypatch.setattr(regions, "readings_many", None)
    assert Region.readings_together(rs) == [None, None]
    for region in rs:
        region.close()


def test_the_controller_reads_real_regions_together_on_the_monotonic_clock(tmp_path, native,
                                                                         monkeypatch):
    rs = _regions(tmp_path, 3)
    rs[1].set_rate(0, 500, 40)
    one_by_one: list[Region] = []
    controls_alone: list[Region] = []
    own, own_controls = Region.counters, Region.controls

    def counted(self: Region) -> tuple[int, ...] | None:
        one_by_one.append(self)
        return own(self)

    def controls_counted(self: Region) -> tuple:
        controls_alone.append(self)
        return own_controls(self)

    monkeypatch.setattr(Region, "counters", counted)
    monkeypatch.setattr(Region, "controls", controls_counted)
    by_gpu: dict = {UUID: []}
    controller = ThrottleController(backend=None, regions=lambda: rs)  # type: ignore[arg-type]
    before = time.monotonic_ns()
    controller._gather(rs, by_gpu, {UUID})
    assert one_by_one == [] and controls_alone == []  # all three in the batch
    readings = [reading for _, reading in by_gpu[UUID]]
    assert [r[0] for r in readings] == [(1000, 10, 0), (2000, 20, 1), (3000, 30, 2)]
    assert [r[1:4] for r in readings] == [own_controls(region) for region in rs]
    assert readings[1][1] == (500, 40)
    assert all(before <= r[4] <= r[5] for r in readings)
    readings_batch = [r[:4] for r in readings]
    # on another clock (a simulator's), one by one, as before
    fake = ThrottleController(backend=None, regions=lambda: rs,  # type: ignore[arg-type]
                              clock=lambda: 5)
    by_gpu = {UUID: []}
    fake._gather(rs, by_gpu, {UUID})
    assert one_by_one == rs and controls_alone == rs
    assert [reading[:4] for _, reading in by_gpu[UUID]] == readings_batch
    assert [reading[4:] for _, reading in by_gpu[UUID]] == [(5, 5)] * 3
    for region in rs:
        region.close()


def test_a_batch_that_fails_leaves_every_region_to_its_own_read(tmp_path, native, monkeypatch):
    rs = _regions(tmp_path, 2)

    def broken(regions: object) -> list:
        raise RuntimeError("the batch read failed")

    monkeypatch.setattr(Region, "readings_together", staticmethod(broken))
    controller = ThrottleController(backend=None, regions=lambda: rs)  # type: ignore[arg-type]
    by_gpu: dict = {UUID: []}
    with capture_logs() as logs:
        controller._gather(rs, by_gpu, {UUID})
    assert [reading[0] for _, reading in by_gpu[UUID]] == [(1000, 10, 0), (2000, 20, 1)]
    assert controller.errors["region_usage"] == 1
    assert [e["event"] for e in logs] == ["throttle_region_batch_read_failed"]
    for region in rs:
        region.close()


def test_the_loop_in_c_reads_what_the_loop_in_python_reads(tmp_path, monkeypatch):
    if regions.readings_of is None:
        pytest.skip("the C read was built without its loop")
    rs = _regions(tmp_path, 5)
    rs[4].close()
    rs[1].set_rate(0, 777, 55)
    rs[2].set_policy("work-conserving", 3)
    with open(rs[3].path / STATE_FILE, "r+b") as f:
        f.write(b"\0" * 8)  # corrupt
    rs[0]._policed_ns = time.monotonic_ns() - 10**9  # checks due, finding nothing

    class Fake:
        closed = False

    mixed = [rs[0], Fake(), rs[1], rs[2], rs[3], rs[4]]
    in_c = Region.readings_together(mixed)
    monkeypatch.setattr(regions, "readings_of", None)
    in_python = Region.readings_together(mixed)
    assert [None if r is None else r[:4] for r in in_c] == \
        [None if r is None else r[:4] for r in in_python]
    assert [r is None for r in in_c] == [False, True, False, False, False, True]
    assert in_c[4][0] is None and rs[3].corrupt_reads == 2  # type: ignore[index]
    assert not any(region._fd_lock.locked() for region in rs)
    for region in rs:
        region.close()


def test_an_error_within_the_loop_gives_every_lock_back(tmp_path, native, monkeypatch):
    rs = _regions(tmp_path, 3)
    long_ago = time.monotonic_ns() - 10**9
    rs[1]._policed_ns = long_ago

    def broken(now_ns: int) -> bool:
        raise OSError("the checks failed")

    monkeypatch.setattr(rs[1], "_checks_find_nothing", broken)
    with pytest.raises(OSError, match="the checks failed"):
        Region.readings_together(rs)
    assert not any(region._fd_lock.locked() for region in rs)
    monkeypatch.undo()
    rs[1]._policed_ns = time.monotonic_ns()
    assert all(r is not None for r in Region.readings_together(rs))
    for region in rs:
        region.close()

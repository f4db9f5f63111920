"""What a container gets of its region: three files, not the directory. It can write `state` and
HAMi-core's cache whatever its uid, create nothing in the state dir, not grow its files for good,
and a `state` replaced behind the agent's back is noticed and read."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog.testing

from tests.fakes.shimstate import ShimWriter
from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.shm import layout
from vgpu_agent.shm import regions as regions_module
from vgpu_agent.shm.regions import HAMI_CACHE_MAX_BYTES, Region, RegionStore

GIB = 1 << 30
UUID = "GPU-dddddddd-0000-0000-0000-000000000004"
NOBODY = 65534


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RegionStore]:
    s = RegionStore(tmp_path / "state")
    s.adopt()
    yield s
    s.close()


def grant(n: int = 0) -> Grant:
    return Grant((f"{UUID}::{n}",), (GrantedDevice(UUID, 0, 1, 4 * GIB, 25.0),))


def test_the_container_is_given_files_with_fixed_sizes_and_modes(store: RegionStore) -> None:
    region = store.create(grant())
    extras = store.extras_for(region)
    mounts = {inside: (host, ro) for inside, host, ro in extras.mounts}
    for inside, (host, _) in mounts.items():
        assert Path(host).is_file(), f"{inside} mounts {host}, which is not a file"
    assert mounts["/run/vgpu/control"][1] is True
    assert mounts["/run/vgpu/state"][1] is False and mounts["/run/vgpu/hami.cache"][1] is False
    assert extras.envs["VGPU_REGION_DIR"] == "/run/vgpu"  # the shim's files, where they were
    assert extras.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/run/vgpu/hami.cache"
    files = {p.name: p.stat() for p in region.path.iterdir()}
    assert set(files) == {"control", "state", "hami.cache"}
    assert stat.S_IMODE(files["control"].st_mode) == 0o444
    assert stat.S_IMODE(files["state"].st_mode) == 0o666
    assert files["state"].st_size == layout.STATE_SIZE
    assert files["state"].st_blocks * 512 >= layout.STATE_SIZE  # reserved, not sparse
    assert stat.S_IMODE(files["hami.cache"].st_mode) == 0o666 and files["hami.cache"].st_size == 0


def test_spare_directories_carry_the_cache_file_too(store: RegionStore, tmp_path: Path) -> None:
    spare = store._make_spare(1)
    assert sorted(p.name for p in spare.iterdir()) == ["hami.cache", "state"]


_AS_NOBODY = """
import errno, os, sys
os.setgid({uid}); os.setuid({uid})
region = sys.argv[1]
for name in ("state", "hami.cache"):
    fd = os.open(os.path.join(region, name), os.O_RDWR)
    os.pwrite(fd, b"x", 0 if name == "hami.cache" else 4096)
    os.close(fd)
try:
    os.open(os.path.join(region, "junk"), os.O_WRONLY | os.O_CREAT, 0o644)
except OSError as err:
    sys.exit(0 if err.errno == errno.EACCES else 3)
sys.exit(4)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_a_non_root_container_writes_its_files_and_creates_nothing() -> None:
    # The container opens the mounted files directly; here the test's own directories must let
    # another uid pass through to them.
    root = Path(tempfile.mkdtemp(prefix="vgpu-files-"))
    try:
        os.chmod(root, 0o711)
        store = RegionStore(root / "state")
        store.adopt()
        region = store.create(grant())
        for p in (root / "state", root / "state" / "regions"):
            assert stat.S_IMODE(p.stat().st_mode) & 0o001  # what the agent makes is passable
        done = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY.format(uid=NOBODY), str(region.path)],
            capture_output=True, text=True, timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert (region.path / "hami.cache").read_bytes() == b"x"
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_state_file_grown_past_its_size_is_cut_back(store: RegionStore) -> None:
    region = store.create(grant())
    with open(region.path / "state", "r+b") as f:  # a tenant filling the disk through it
        f.seek(layout.STATE_SIZE + 8 * GIB)
        f.write(b"junk")
    usage = region.usage()
    assert not usage.corrupt
    assert (region.path / "state").stat().st_size == layout.STATE_SIZE
    assert region.files_truncated == 1 and store.tampering()["files_truncated"] == 1
    region.usage()
    assert region.files_truncated == 1  # nothing more to cut


def test_a_cache_file_grown_past_its_cap_is_cut_back(store: RegionStore) -> None:
    region = store.create(grant())
    os.truncate(region.path / "hami.cache", HAMI_CACHE_MAX_BYTES + 1)
    for _ in range(regions_module._POLICE_EVERY):
        region.usage()
    assert (region.path / "hami.cache").stat().st_size == HAMI_CACHE_MAX_BYTES
    assert region.files_truncated == 1


def test_a_replaced_state_file_is_opened_again_and_counted(store: RegionStore) -> None:
    # A region of an older agent had its directory mounted: the container could swap `state`.
    region = store.create(grant())
    region.limit_slots(4)
    state = region.path / "state"
    os.rename(state, region.path / "state.old")
    fd = os.open(state, os.O_WRONLY | os.O_CREAT, 0o666)
    os.write(fd, layout.encode_state(1))
    os.close(fd)
    writer = ShimWriter(region.path)
    try:
        writer.process(0, 77, 0, 0)
        usage = region.usage()
        assert [p.pid for p in usage.processes] == [77]  # the file at the path, not the old one
        assert region.state_replaced == 1 and store.tampering()["state_replaced"] == 1
        region.usage()
        assert region.state_replaced == 1
    finally:
        writer.close()


def test_the_lean_read_checks_the_files_at_most_every_half_second(
    store: RegionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller's `counters` read, ten a second while shares move, checks the files at
    most every `_LEAN_POLICE_NS`: a grown or replaced `state` is found within it."""
    now = [10**12]
    monkeypatch.setattr(regions_module.time, "monotonic_ns", lambda: now[0])
    region = store.create(grant())
    assert region.counters() is not None  # the first read checks
    with open(region.path / "state", "r+b") as f:  # a tenant filling the disk through it
        f.seek(layout.STATE_SIZE + GIB)
        f.write(b"junk")
    for _ in range(4):  # 100 ms ticks: not checked again yet
        now[0] += 100_000_000
        assert region.counters() is not None
    assert region.files_truncated == 0
    now[0] += 100_000_000  # half a second since the last check
    assert region.counters() is not None
    assert region.files_truncated == 1
    assert (region.path / "state").stat().st_size == layout.STATE_SIZE
    region.usage()  # a full read checks every time, whenever the last check was
    assert region.files_truncated == 1

    os.rename(region.path / "state", region.path / "state.old")
    fd = os.open(region.path / "state", os.O_WRONLY | os.O_CREAT, 0o666)
    os.write(fd, layout.encode_state(1))
    os.close(fd)
    now[0] += regions_module._LEAN_POLICE_NS
    region.counters()
    assert region.state_replaced == 1  # the file at the path is the one read from now on


def test_a_state_file_replaced_by_a_symlink_is_not_followed(store: RegionStore, tmp_path) -> None:
    region = store.create(grant())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(layout.encode_state(1))
    os.unlink(region.path / "state")
    os.symlink(elsewhere, region.path / "state")
    assert region.usage().corrupt
    assert region.state_replaced == 1
    with pytest.raises(OSError) as err:
        os.open(region.path / "state", os.O_RDONLY | os.O_NOFOLLOW)
    assert err.value.errno == errno.ELOOP


def test_a_removed_state_file_keeps_the_last_one_open(store: RegionStore) -> None:
    region = store.create(grant())
    os.unlink(region.path / "state")  # nothing at the path: nothing to switch to
    assert not region.usage().corrupt
    assert region.state_replaced == 0


def test_a_region_without_a_cache_file_is_still_answered(store: RegionStore) -> None:
    region = store.create(grant())
    os.unlink(region.path / "hami.cache")  # made by an agent before the file existed
    mounts = [inside for inside, _, _ in store.extras_for(region).mounts]
    assert "/run/vgpu/hami.cache" not in mounts and "/run/vgpu/state" in mounts
    assert isinstance(Region.open(region.path), Region)


def test_new_regions_carry_the_configured_shim_permissions(tmp_path: Path) -> None:
    default = RegionStore(tmp_path / "a")
    assert default.create(grant()).control().flags == 0  # nothing allowed unless configured
    default.close()
    allowing = RegionStore(tmp_path / "b", control_flags=layout.CONTROL_ALLOW_DISABLE)
    assert allowing.create(grant()).control().flags == layout.CONTROL_ALLOW_DISABLE
    allowing.close()
    with pytest.raises(ValueError, match="control flags 0x8"):
        RegionStore(tmp_path / "c", control_flags=8)


def test_readers_in_two_threads_and_a_swap_never_read_a_closed_descriptor(
    store: RegionStore, tmp_path: Path
) -> None:
    import threading

    region = store.create(grant())
    stop = threading.Event()
    seen: list[bool] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(region.usage().corrupt)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for n in range(30):  # the container swaps `state` over and over
            fresh = tmp_path / f"state.{n}"  # made aside: the region dir is swept
            fresh.write_bytes(layout.encode_state(1))
            os.rename(fresh, region.path / "state")
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert seen and not any(seen)  # every read found a whole file
    assert 1 <= region.state_replaced <= 30
    region.close()
    assert region.usage().corrupt  # closed: nothing reopened behind the store's back
    assert region._state_fd is None


def test_what_a_container_put_into_an_old_style_region_directory_is_removed(
    store: RegionStore, tmp_path: Path
) -> None:
    # Regions of older agents had their directory mounted read-write into the container.
    region = store.create(grant())
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    (region.path / "junk.bin").write_bytes(b"\0" * 4096)
    (region.path / "dir").mkdir()
    (region.path / "dir" / "more").write_bytes(b"\0" * 4096)
    os.symlink(outside, region.path / "link")
    os.mkfifo(region.path / "fifo")
    for _ in range(regions_module._POLICE_EVERY):
        assert not region.usage().corrupt
    assert sorted(p.name for p in region.path.iterdir()) == ["control", "hami.cache", "state"]
    assert (outside / "keep").exists()  # a link is removed, never followed
    assert region.foreign_removed == 4 and store.tampering()["foreign_removed"] == 4


def _count_entries(path: Path) -> int:
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


def test_a_tree_put_into_an_old_style_region_directory_goes_a_bounded_batch_a_pass(
    store: RegionStore,
) -> None:
    # Removed at once, a tree of a hundred thousand files held the event loop for half a
    # second; each pass now does at most about a batch of steps, and the tree still goes.
    region = store.create(grant())
    flood = region.path / "flood"
    for i in range(8):
        level = flood / f"d{i}" / "deeper" / "deepest"
        level.mkdir(parents=True)
        for j in range(60):
            (level / f"f{j}").touch()
    (region.path / "loose").touch()
    left = [_count_entries(flood)]
    passes = 0
    while flood.exists():
        region._sweep()
        passes += 1
        if flood.exists():
            left.append(_count_entries(flood))
            # a listing, an unlink or an rmdir per step; the batch bounds the steps
            assert left[-2] - left[-1] <= regions_module._SWEEP_BATCH
        assert passes < 100
    assert passes >= (8 * 63) // regions_module._SWEEP_BATCH
    assert sorted(p.name for p in region.path.iterdir()) == ["control", "hami.cache", "state"]
    assert region.foreign_removed == 2  # the tree and the file, each counted once, when gone


class _ListedAsDirectory:
    """A directory entry as listed before the container swapped it for a link."""

    def __init__(self, entry: os.DirEntry) -> None:
        self.name, self.path = entry.name, entry.path

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return True


def test_removing_a_tree_never_follows_a_link_swapped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "precious"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_bytes(b"x")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    for j in range(20):
        (tree / "a" / "b" / f"f{j}").touch()
    os.symlink(outside, tree / "a" / "link")  # a link inside the tree: removed, not followed
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        gone, used = regions_module.remove_tree_some(parent, "tree", 8)
        assert not gone and used <= 9
        # Between two passes the container swaps a directory for a link to elsewhere: the next
        # listing sees a link, which is removed, not followed.
        shutil.rmtree(tree / "a" / "b")
        os.symlink(outside, tree / "a" / "b")
        while not gone:
            gone, _ = regions_module.remove_tree_some(parent, "tree", 8)
        assert not tree.exists()
        # Swapped between the listing and the open: the open refuses the link.
        (tree / "c").mkdir(parents=True)
        os.symlink(outside, tree / "c" / "d")
        real_scandir = os.scandir

        def listed_before_the_swap(fd):
            class Listing:
                def __enter__(self):
                    self.inner = real_scandir(fd)
                    return (e if e.name != "d" else _ListedAsDirectory(e) for e in self.inner)

                def __exit__(self, *exc):
                    self.inner.close()

            return Listing()

        monkeypatch.setattr(regions_module.os, "scandir", listed_before_the_swap)
        with pytest.raises(OSError) as raised:
            regions_module.remove_tree_some(parent, "tree", 64)
        assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)
        monkeypatch.undo()
        # and a link in place of the tree itself is not followed either
        os.symlink(outside / "sub", tmp_path / "linked")
        with pytest.raises(OSError):
            regions_module.remove_tree_some(parent, "linked", 8)
    finally:
        os.close(parent)
    assert (outside / "sub" / "keep").read_bytes() == b"x"


def test_a_foreign_entry_that_cannot_be_removed_is_warned_of_once_and_retried(
    store: RegionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep runs every few seconds for as long as the region lives: an entry it cannot
    # remove (EPERM, EBUSY) was warned of at every pass.
    region = store.create(grant())
    (region.path / "stuck").touch()
    (region.path / "junk").touch()
    real_unlink = regions_module._unlink_at
    refusal = [errno.EPERM]

    def unlink(name: str, dir_fd: int) -> None:
        if name == "stuck" and refusal:
            raise OSError(refusal[0], os.strerror(refusal[0]), name)
        real_unlink(name, dir_fd)

    monkeypatch.setattr(regions_module, "_unlink_at", unlink)
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            region._sweep()
        refusal[0] = errno.EBUSY  # another error is news: warned of once more
        for _ in range(3):
            region._sweep()
    kept = [e for e in logs if e["event"] == "region_foreign_entry_kept"]
    assert [e["path"] for e in kept] == [str(region.path / "stuck")] * 2
    assert os.strerror(errno.EPERM) in kept[0]["error"]
    assert os.strerror(errno.EBUSY) in kept[1]["error"]
    assert not (region.path / "junk").exists() and (region.path / "stuck").exists()
    assert region.foreign_removed == 1
    refusal.clear()  # removable now: still retried, and removed
    region._sweep()
    assert not (region.path / "stuck").exists() and region.foreign_removed == 2


def test_the_entries_warned_of_as_kept_are_bounded(
    store: RegionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    region = store.create(grant())
    batch = regions_module._SWEEP_BATCH
    for i in range(batch + 10):
        (region.path / f"stuck{i}").touch()

    def refuse(name: str, dir_fd: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", name)

    monkeypatch.setattr(regions_module, "_unlink_at", refuse)
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            region._sweep()
    kept = [e for e in logs if e["event"] == "region_foreign_entry_kept"]
    assert len(kept) == batch  # one per name, for at most a batch of names
    assert len({e["path"] for e in kept}) == batch

"""Per-allocation regions on disk: created at Allocate, adopted, bound to containers, collected.

Layout under the state dir:

    regions/<alloc_id>/control   0444, written only by the agent (mmap'd read-write here)
    regions/<alloc_id>/state     0666, written by the shim in the container (read here by pread)
    regions/<alloc_id>/hami.cache  0666, empty: HAMi-core's cache, for containers that run it
    regions/.new-<alloc_id>/     a region being built; renamed into place when complete
    regions/.gc-<alloc_id>/      a region being deleted
    regions.corrupt/<alloc_id>.<ns>/  regions found unreadable at start, the newest 16 kept
    shim/libvgpu.so, shim/ld.so.preload   installed by `vgpu-agent install-shim`

`alloc_id` is `<seq:012d>-<8 hex>`: names sort by creation, and `seq` (also stored in `control`)
keeps growing across agent restarts because it continues from the largest one on disk.

Crash safety: a region is built in a `.new-` directory and renamed into place, so a crash leaves
either a complete region or a leftover that `adopt()` deletes. Files are not fsync'd: after a
power loss the containers that used the regions are gone too, and the next start collects them.

Why `state` is read with `pread` into a private buffer and not through an mmap: the container can
truncate the file, and touching an mmap'd page past the end of a file kills the reader with
SIGBUS. A short read is just a short buffer, which the decoder bounds-checks. Only the header
and the slots below its high-water mark are read (a few KiB for most containers, not the whole
673 KiB): the controller reads every region at every tick. And never more slots than the
container has processes on its GPUs, plus `SLOT_HEADROOM`: a container that marks every slot
used does not make the agent read them.

Why the container gets the three files and not the directory: `state` and `hami.cache` are
mounted read-write, `control` read-only, each at `<container_region_dir>/<name>`, so the shim
finds them where it always did. The container can create nothing in the state dir (a tenant
filling it would fail every other pod's Allocate), and a file that is a mount point cannot be
unlinked, renamed or replaced from inside the container. Its sizes are fixed by the agent: `state`
is reserved whole at creation and anything written past its end is cut off at the next read,
`hami.cache` (sized by HAMi-core itself) is cut back to `HAMI_CACHE_MAX_BYTES`. A region made
by an older agent (the directory mounted) can still have its `state` replaced: a new inode at
the path is noticed at the next read and opened instead, and counted (`state_replaced`); and
whatever such a container creates in the directory is removed (`foreign_removed`).

Identity and collection (`reconcile`, rules in `plan_regions`): PodResources says which container
holds which device IDs. A region belongs to the container whose device IDs are exactly the
region's. When the IDs of several regions match one container (IDs reused after an earlier
container ended, or a pod recreated under the same name), the newest region (highest seq) is the
container's: the kubelet allocates IDs again only after their previous holder has ended, so the
last Allocate of those IDs is the one the running container was started with. The older ones
are garbage. Garbage is removed at the next reconcile, a region nobody holds once it has not been
held for `gc_grace_s`; and a region younger than `gc_grace_s` is never removed, because
PodResources shows a container only some time after its Allocate. A region whose container is
gone keeps its last known labels until it is removed. Without a PodResources answer nothing is
ever removed, and neither with one that lists no container of our resource: that is what a
kubelet that restarts answers, and it says nothing about the regions (`gc_postponed`, and the
grace starts again). A grace period therefore only passes on answers that list containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import itertools
import math
import mmap
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.deviceplugin.server import Extras
from vgpu_agent.shm import layout
from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy, RegionHandle, RegionUsage
from vgpu_agent.shm.headerread import counters_at, readings_many, readings_of
from vgpu_agent.shm.usageread import usage_at, usage_of

log = structlog.get_logger(__name__)

# A region read in a batch, as the controller reads one: (counters or None, per device (rate,
# burst) flattened, the policies, the priority, monotonic ns before the header's read, after it)
Reading = tuple[tuple[int, ...] | None, tuple[int, ...], tuple[CorePolicy, ...], int, int, int]

REGIONS_DIR = "regions"
QUARANTINE_DIR = "regions.corrupt"
SHIM_DIR = "shim"
SHIM_FILE = "libvgpu.so"
PRELOAD_FILE = "ld.so.preload"
CONTROL_FILE = "control"
STATE_FILE = "state"
HAMI_CACHE_FILE = "hami.cache"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
REGION_DIR_ENV = "VGPU_REGION_DIR"
HAMI_CACHE_ENV = "CUDA_DEVICE_MEMORY_SHARED_CACHE"

CONTROL_MODE = 0o444
STATE_MODE = 0o666  # the container's processes write it, whatever their uid
HAMI_CACHE_MODE = 0o666  # HAMi-core opens it read-write, whatever the container's uid
# HAMi-core sizes its cache file itself (a few MiB); more than this is a tenant filling the disk.
HAMI_CACHE_MAX_BYTES = 64 << 20
_POLICE_EVERY = 16  # checks of `state` between checks of the cache file and the directory
# The controller's lean reads check the files at most this often (a path `stat` costs twice the
# read): a replaced or grown `state` is found at the first read after this (a settled node
# reads every 2 s, so there at that read). Full reads (`usage`) check every time.
_LEAN_POLICE_NS = 500_000_000
_SWEEP_BATCH = 64  # foreign entries removed from a region directory per check
_REGION_FILES = frozenset({"control", "state", "hami.cache"})
DIR_MODE = 0o755
QUARANTINE_KEEP = 16  # corrupt regions kept for inspection; older ones are deleted

_NEW_PREFIX = ".new-"
# Directories with a ready `state` file, made after an Allocate so the next one of the same shape
# skips the mkdir and the block reservation; leftovers carry _NEW_PREFIX and go at adoption.
SPARES_PER_SHAPE = 2
_GC_PREFIX = ".gc-"
_ALLOC_ID = re.compile(r"^(?P<seq>\d{12})-[0-9a-f]{8}$")
_POLICY_CODES: dict[CorePolicy, int] = {
    name: code for code, name in layout.POLICY_NAMES.items()  # type: ignore[misc]
}
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW


def _unlink_at(name: str, dir_fd: int) -> None:
    """Unlink `name` in the directory `dir_fd`; one already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def remove_tree_some(parent_fd: int, name: str, budget: int) -> tuple[bool, int]:
    """Remove the directory `name` in `parent_fd` and what is under it, doing at most about
    `budget` steps (a listing, an unlink, an rmdir: one each); (whether it is gone, the steps
    used). Deepest first, the rest left for the next call, so that a tree of a million files
    or a thousand levels never holds the caller for long.

    Links are never followed: each directory is opened relative to its parent's descriptor
    with O_NOFOLLOW, so a container that swaps a directory for a link to elsewhere half-way
    makes that open fail; it never makes the agent remove files outside the tree.
    """
    fds: list[int] = []
    names: list[str] = []
    used = 0
    try:
        fds.append(os.open(name, _DIR_FLAGS, dir_fd=parent_fd))
        names.append(name)
        while fds and used < budget:
            fd = fds[-1]
            with os.scandir(fd) as entries:
                batch = list(itertools.islice(entries, max(1, budget - used - 1)))
            used += 1
            if not batch:
                os.close(fds.pop())
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(names.pop(), dir_fd=fds[-1] if fds else parent_fd)
                used += 1
                continue
            for entry in batch:
                if entry.is_dir(follow_symlinks=False):
                    fds.append(os.open(entry.name, _DIR_FLAGS, dir_fd=fd))
                    names.append(entry.name)
                    used += 1
                    break
                _unlink_at(entry.name, fd)
                used += 1
        return not fds, used
    finally:
        for fd in fds:
            os.close(fd)


def _word_index(offset: int) -> int:
    if offset % 8:
        raise layout.RegionFormatError(f"control offset {offset} is not 8-byte aligned")
    return offset // 8


# The live words of `control`, as indexes of 64-bit words: the controller reads every rate and
# writes the heartbeat every tick, so these loads and stores skip the offset arithmetic.
_HEARTBEAT_WORD = _word_index(layout.CONTROL_OFFSETS["heartbeat_ns"])
_GENERATION_WORD = _word_index(layout.CONTROL_OFFSETS["generation"])
_RATE_WORD = _word_index(layout.control_device_offset(0, "rate"))
_BURST_WORD = _word_index(layout.control_device_offset(0, "burst"))
_DEVICE_WORDS = _word_index(layout.CONTROL_DEVICE_SIZE)
_CONTROL_WORDS = (_RATE_WORD, _BURST_WORD, _DEVICE_WORDS)  # as `readings_many` takes them
# `state` reads up to this size are kept to skip decoding an unchanged file (a few live slots;
# a region whose high-water mark is far up is decoded every time rather than held in memory)
_DECODE_CACHE_BYTES = layout.STATE_HEADER_SIZE + 16 * layout.SLOT_SIZE
# Slots read per `state` beyond the container's processes the host has seen on its GPUs: room
# for processes that have claimed a slot but not yet run a kernel. A container that marks all
# 1,024 slots used costs the agent no more than this (see `Region.limit_slots`).
SLOT_HEADROOM = 2

ContainerKey = tuple[str, str, str]  # namespace, pod, container
InitialRate = Callable[[GrantedDevice, CorePolicy], tuple[int, int]]


class RegionError(Exception):
    """A region cannot be created or opened; the message names the path and the reason."""


def unconfigured_rate(device: GrantedDevice, policy: CorePolicy) -> tuple[int, int]:
    """The (rate, burst) a new region starts with: (0, 0), "never configured".

    The shim spends no tokens until the controller writes the first rate (its first tick, long
    before a new container launches a kernel). A fixed limited start cannot be right: a token is
    one thread of one launch, and how many a GPU runs per second differs by orders of magnitude
    between workloads. The control law itself starts unthrottled for one tick and then derives a
    first rate that is at most the limit.
    """
    return 0, 0


def format_alloc_id(seq: int, device_ids: Sequence[str], created_ns: int) -> str:
    if not 0 <= seq < 10**12:
        raise RegionError(f"sequence number {seq} out of range 0..{10**12 - 1}")
    text = "\n".join((str(created_ns), *device_ids))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"{seq:012d}-{digest[:8]}"


def alloc_seq(name: str) -> int | None:
    """The sequence number in a region directory's name, None for anything else."""
    match = _ALLOC_ID.match(name)
    return int(match.group("seq")) if match else None


def core_limit_ppm(percent: float) -> int:
    """A core share in percent as the ABI stores it: parts per million, 1..CORE_LIMIT_FULL."""
    if not percent > 0 or math.isnan(percent):
        raise RegionError(f"core share {percent!r}% is not allowed: more than 0 and at most 100")
    return max(1, min(layout.CORE_LIMIT_FULL, round(percent * layout.CORE_LIMIT_FULL / 100)))


# ------------------------------------------------------------------ one region


class Region:
    """One allocation's region: `control` mmap'd read-write, `state` read with pread.

    Implements `vgpu_agent.shm.api.RegionHandle`. The identity and limits are read once when the
    region is opened (only this agent writes them, and it never changes them); rate, burst and
    heartbeat are read live. Policy and priority change only through `set_policy` (the pod's
    choice), which stores them in `control` and in this object alike.
    """

    def __init__(self, path: Path, alloc_id: str, control_map: mmap.mmap, control: layout.Control):
        self.path = path
        self._alloc_id = alloc_id
        self._map: mmap.mmap | None = control_map
        self._view: memoryview | None = memoryview(control_map)
        # the same bytes as aligned 64-bit words (each access one load or store)
        self._words: memoryview | None = self._view.cast("Q")
        self._control = control
        self._device_count = len(control.devices)  # fixed at creation, asked every tick
        self._policies: tuple[CorePolicy, ...] = tuple(
            layout.POLICY_NAMES[d.policy]  # type: ignore[misc]
            for d in control.devices
        )
        self._priority = control.priority  # changed only by set_policy
        # both at once, replaced whole, for `controls` (a reader in another thread sees a pair)
        self._in_force: tuple[tuple[CorePolicy, ...], int] = (self._policies, self._priority)
        self._state_fd: int | None = None
        self._state_path = str(path / STATE_FILE)  # stat'd at every read: built once
        self._state_inode: tuple[int, int] | None = None  # (st_dev, st_ino) of `_state_fd`
        # st_dev of `control`: a process proves it is the container's when its own mount table
        # shows this region's `control` from this device (`throttle.attribution`)
        self.control_dev: int | None = None
        self._slot_budget = SLOT_HEADROOM
        self._fd_lock = threading.Lock()
        self.state_replaced = 0  # a new inode found at `state`'s path, and opened instead
        self.files_truncated = 0  # `state` or `hami.cache` grown past its size, cut back
        self.foreign_removed = 0  # entries a container created in its region directory, removed
        # foreign entries that could not be removed, by name: warned of once, retried silently
        self._foreign_kept: dict[str, int] = {}
        self._reads = 0
        self._policed_ns: int | None = None  # when the files were last checked
        self.corrupt_reads = 0  # usage() calls that found `state` unreadable
        self.skipped_records = 0  # nonsense values skipped over all reads
        self._reported_corrupt = False
        # the bytes of the last `state` read and what they decoded to (one tuple, replaced whole,
        # so that readers in other threads see a matching pair)
        self._last_read: tuple[bytes, bytes | None, RegionUsage] | None = None

    @classmethod
    def open(cls, path: Path) -> Region:
        """Open an existing region directory; RegionError if `control` is not a valid region."""
        alloc_id = path.name
        control_path = path / CONTROL_FILE
        try:
            fd = _open_control(control_path)
        except OSError as err:
            raise RegionError(f"cannot open {control_path}: {err.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != layout.CONTROL_SIZE:
                raise RegionError(
                    f"{control_path} is {info.st_size} bytes (mode {info.st_mode:o}): "
                    f"a regular file of {layout.CONTROL_SIZE} bytes expected"
                )
            control_map = mmap.mmap(fd, layout.CONTROL_SIZE, access=mmap.ACCESS_WRITE)
            control_dev = info.st_dev
        finally:
            os.close(fd)
        try:
            control = _validated_control(control_map, control_path, alloc_id)
        except RegionError:
            control_map.close()
            raise
        region = cls(path, alloc_id, control_map, control)
        region.control_dev = control_dev
        region._open_state()
        return region

    # --- RegionHandle -------------------------------------------------------------------------

    @property
    def alloc_id(self) -> str:
        return self._alloc_id

    @property
    def seq(self) -> int:
        return self._control.seq

    @property
    def priority(self) -> int:
        return self._priority

    @property
    def device_ids(self) -> tuple[str, ...]:
        return self._control.device_ids

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self._control.devices)

    @property
    def created_ns(self) -> int:
        return self._control.created_ns

    def memory_limit(self, dev: int) -> int:
        return self._device(dev).memory_limit

    def core_limit(self, dev: int) -> float:
        return self._device(dev).core_limit * 100 / layout.CORE_LIMIT_FULL

    def policy(self, dev: int) -> CorePolicy:
        self._device(dev)
        return self._policies[dev]

    def rate(self, dev: int) -> tuple[int, int]:
        self._device(dev)
        words = self._words
        if words is None:
            raise RegionError(f"region {self._alloc_id} is closed")
        first = dev * _DEVICE_WORDS
        return words[_RATE_WORD + first], words[_BURST_WORD + first]

    def controls(self) -> tuple[tuple[int, ...], tuple[CorePolicy, ...], int]:
        """What the controller reads of `control` every tick, in one call: per device (rate,
        burst) flattened as (rate0, burst0, rate1, ...), live from the file, then the policies
        and the priority in force. The same values as `rate`, `policy` and `priority`."""
        words = self._words
        if words is None:
            raise RegionError(f"region {self._alloc_id} is closed")
        policies, priority = self._in_force
        if len(policies) == 1:
            return (words[_RATE_WORD], words[_BURST_WORD]), policies, priority
        rates: list[int] = []
        for first in range(0, len(policies) * _DEVICE_WORDS, _DEVICE_WORDS):
            rates += (words[_RATE_WORD + first], words[_BURST_WORD + first])
        return tuple(rates), policies, priority

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        """`layout.set_rate`'s stores, in its order, straight to the words of `control`: the
        controller writes dozens of rates a tick while shares move."""
        self._device(dev)
        words = self._words
        if (words is not None and type(rate) is int and type(burst) is int
                and 0 <= rate <= layout.TOKEN_MAX and 0 <= burst <= layout.TOKEN_MAX):
            generation = words[_GENERATION_WORD]
            opening = generation if generation % 2 else generation + 1  # closes a dead writer's
            words[_GENERATION_WORD] = opening & layout.U64_MAX
            first = dev * _DEVICE_WORDS
            words[_RATE_WORD + first] = rate
            words[_BURST_WORD + first] = burst
            words[_GENERATION_WORD] = (opening + 1) & layout.U64_MAX
        else:  # closed, or a value the layout refuses: its error says which
            layout.set_rate(self._live(), dev, rate, burst)

    def set_policy(self, policy: CorePolicy, priority: int) -> bool:
        """Store `policy` for every device and the region's `priority` in `control` (one
        generation-framed update); the shim sees the policy at its next launch, the controller
        both at its next tick. Returns False when both were already in force (nothing written)."""
        if policy not in _POLICY_CODES:
            raise RegionError(f"core policy {policy!r} is not allowed: one of {CORE_POLICIES}")
        count = len(self._policies)
        policies = (policy,) * count
        if policies == self._policies and priority == self._priority:
            return False
        layout.set_policy(self._live(), [_POLICY_CODES[policy]] * count, priority)
        self._policies = policies
        self._priority = priority
        self._in_force = (policies, priority)
        return True

    def beat(self, now_ns: int) -> None:
        words = self._words
        if words is not None and type(now_ns) is int and 0 <= now_ns <= layout.U64_MAX:
            words[_HEARTBEAT_WORD] = now_ns
        else:  # closed, or a value the layout refuses: its error says which
            layout.set_heartbeat(self._live(), now_ns)

    def usage(self) -> RegionUsage:
        """What the shim reports; never raises. An unreadable file gives `corrupt=True`."""
        if self._view is None:
            return RegionUsage(corrupt=True)  # closed (collected): nothing to read, not counted
        try:
            # One reader at a time (the controller's and the metrics' threads): a `state` found
            # replaced has its descriptor closed and reopened, which another reader's pread
            # must not meet half-way (a number closed and reused is another file).
            with self._fd_lock:
                if self._view is None:  # closed while this reader waited
                    return RegionUsage(corrupt=True)
                self._police_files()
                usage = self._read_usage()
        except Exception as err:  # whatever the container did to the file, the agent goes on
            if self._view is None:
                return RegionUsage(corrupt=True)  # collected while this read ran
            log.warning("region_state_read_failed", alloc_id=self._alloc_id, error=str(err))
            usage = RegionUsage(corrupt=True)
        if usage.corrupt:
            self.corrupt_reads += 1
            if not self._reported_corrupt:
                log.warning("region_state_corrupt", alloc_id=self._alloc_id, path=str(self.path))
                self._reported_corrupt = True
        else:
            self._reported_corrupt = False
            self.skipped_records += usage.skipped_records
        return usage

    def counters(self) -> tuple[int, ...] | None:
        """Per device (tokens spent, launches, ns waited), flattened, from the `state` header
        alone (one pread of about a kilobyte, no slot decoded); None when unreadable.

        The controller's lean read: what it needs every tick, and nothing it does not.
        """
        return self._lean_read(police=True)

    def peek_counters(self) -> tuple[int, ...] | None:
        """`counters` without the file checks: the controller's look at a calm GPU's devices
        between its slow ticks, up to every 0.4 s, reads many headers for one answer, and the checks
        (a path `stat`, and a sweep of the directory every 16th) cost more than the read. A
        `state` replaced meanwhile is found at the next tick's read; until then the file held
        is read."""
        return self._lean_read(police=False)

    def _lean_read(self, police: bool) -> tuple[int, ...] | None:
        if self._view is None:
            return None
        # under the readers' lock: the file checks may reopen the descriptor (see `usage`)
        with self._fd_lock:
            if self._view is None:
                return None
            policed = self._policed_ns
            if police and (policed is None
                           or time.monotonic_ns() - policed >= _LEAN_POLICE_NS):
                try:
                    self._police_files()
                except OSError as err:
                    log.warning("region_state_check_failed", alloc_id=self._alloc_id,
                                error=str(err))
            if self._state_fd is None and not self._open_state():
                return None
            counters = counters_at(self._state_fd, self._device_count)  # type: ignore[arg-type]
        if counters is None:
            self._lean_read_corrupt()
        return counters

    @staticmethod
    def readings_together(regions: Sequence[object]) -> list[Reading | None]:
        """`Region.counters` and `Region.controls` of many regions in one native call
        (`headerread.readings_many`), each header read between `time.monotonic_ns` stamps of its
        own: per region (counters or None, rates, policies, priority, before, after), or None
        for one to be read the usual way (not a `Region`, closed, its files due for checks that
        find something or for the directory's sweep, its `state` not open, its lock held by
        another reader, or no native read built). A region whose checks are due and find
        nothing is checked here (`_checks_find_nothing`). Each region is held under its
        readers' lock while its files are checked and read, as in `counters`.

        Where the C read has it, the loop over the regions is in C too (`readings_of`: the
        Python around each region's read cost the controller as much as the read); the loop
        below is the reference, and the tests run both."""
        if readings_many is None:
            return [None] * len(regions)
        if readings_of is not None:
            read_each, corrupt = readings_of(regions, Region, time.monotonic_ns(),
                                             _LEAN_POLICE_NS, _CONTROL_WORDS)
            for n in corrupt:
                regions[n]._lean_read_corrupt()  # type: ignore[attr-defined]
            return read_each  # type: ignore[no-any-return]
        return Region._readings_in_python(regions)

    @staticmethod
    def _readings_in_python(regions: Sequence[object]) -> list[Reading | None]:
        """`readings_together`'s loop in Python (the reference), the headers read in one
        `readings_many` call with every region taken held meanwhile."""
        assert readings_many is not None
        out: list[Reading | None] = [None] * len(regions)
        held: list[threading.Lock] = []
        fds: list[int] = []
        controls: list[tuple[memoryview, tuple[CorePolicy, ...], int]] = []
        where: list[int] = []
        now_ns = time.monotonic_ns()
        try:
            for n, region in enumerate(regions):
                if type(region) is not Region or region._view is None:
                    continue
                lock = region._fd_lock
                if not lock.acquire(blocking=False):
                    continue  # another reader may be reopening its file: read it the usual way
                held.append(lock)  # (before the checks: given back should they raise)
                policed, fd, words = region._policed_ns, region._state_fd, region._words
                if (region._view is None or fd is None or words is None or policed is None
                        or (now_ns - policed >= _LEAN_POLICE_NS
                            and not region._checks_find_nothing(now_ns))):
                    held.pop().release()
                    continue
                fds.append(fd)
                controls.append((words, *region._in_force))
                where.append(n)
            read = readings_many(fds, controls, _CONTROL_WORDS) if fds else []
        finally:
            for lock in held:
                lock.release()
        for n, one in zip(where, read, strict=True):
            if one[0] is None:
                regions[n]._lean_read_corrupt()  # type: ignore[attr-defined]
            out[n] = one
        return out

    def _lean_read_corrupt(self) -> None:
        self.corrupt_reads += 1
        if not self._reported_corrupt:
            log.warning("region_state_corrupt", alloc_id=self._alloc_id, path=str(self.path))
            self._reported_corrupt = True

    # --- the rest -----------------------------------------------------------------------------

    def limit_slots(self, processes: int) -> None:
        """Read at most `processes` + SLOT_HEADROOM slots from now on (`processes`: the
        container's processes the host has proven on its GPUs). Slots past that are the
        container's own business: what it writes there costs the agent nothing."""
        self._slot_budget = min(layout.MAX_PROCS, SLOT_HEADROOM + max(0, processes))

    @property
    def slot_budget(self) -> int:
        return self._slot_budget

    @property
    def device_count(self) -> int:
        return self._device_count

    @property
    def heartbeat_ns(self) -> int:
        return layout.load_u64(self._live(), layout.CONTROL_OFFSETS["heartbeat_ns"])

    @property
    def generation(self) -> int:
        return layout.load_u64(self._live(), layout.CONTROL_OFFSETS["generation"])

    @property
    def closed(self) -> bool:
        return self._view is None

    def control(self) -> layout.Control:
        """The whole `control` file as it is now."""
        return layout.decode_control(self._live())

    def close(self) -> None:
        words, self._words = self._words, None
        if words is not None:
            words.release()
        view, self._view = self._view, None
        if view is not None:
            view.release()
        control_map, self._map = self._map, None
        if control_map is not None:
            control_map.close()
        with self._fd_lock:
            fd, self._state_fd = self._state_fd, None
            if fd is not None:
                os.close(fd)

    def __repr__(self) -> str:
        return f"Region({self._alloc_id!r}, ids={list(self.device_ids)})"

    def _device(self, dev: int) -> layout.ControlDevice:
        devices = self._control.devices
        if not isinstance(dev, int) or not 0 <= dev < len(devices):
            raise IndexError(
                f"device index {dev!r} out of range for region {self._alloc_id}: "
                f"allowed 0..{len(devices) - 1}"
            )
        return devices[dev]

    def _live(self) -> memoryview:
        if self._view is None:
            raise RegionError(f"region {self._alloc_id} is closed")
        return self._view

    def _police_files(self) -> None:
        """Keep the container's files what the agent made them: the `state` at the path is the
        one read (a replaced file is opened instead), and neither file outgrows its size."""
        self._reads += 1
        self._policed_ns = time.monotonic_ns()
        fd = self._state_fd
        if fd is not None:
            # One stat a read: the file at the path is the one held (its inode was noted when it
            # was opened), and then its size is the held file's; fstat only when the path is gone.
            try:
                at_path = os.stat(self._state_path, follow_symlinks=False)
            except OSError:
                at_path = None
            if at_path is not None and (at_path.st_dev, at_path.st_ino) != self._state_inode:
                self._state_fd = self._state_inode = None
                os.close(fd)
                self.state_replaced += 1
                reopened = self._open_state()
                log.warning("region_state_replaced", alloc_id=self._alloc_id,
                            path=self._state_path, reopened=reopened)
            else:
                size = at_path.st_size if at_path is not None else os.fstat(fd).st_size
                if size > layout.STATE_SIZE:
                    self._cut(self.path / STATE_FILE, layout.STATE_SIZE, size)
        if self._reads % _POLICE_EVERY == 1:
            self._sweep()
            cache = self.path / HAMI_CACHE_FILE
            try:
                size = os.stat(cache, follow_symlinks=False).st_size
            except OSError:
                return
            if size > HAMI_CACHE_MAX_BYTES:
                self._cut(cache, HAMI_CACHE_MAX_BYTES, size)

    def _checks_find_nothing(self, now_ns: int) -> bool:
        """`_police_files` where it would only look (its caller holds the readers' lock): True
        when the `state` at the path is the one held and within its size, counted as checked
        then; False, with nothing counted, where the checks would act (a file replaced, grown,
        gone) or the directory's sweep is due: `_police_files` must run instead."""
        if (self._reads + 1) % _POLICE_EVERY == 1 or self._state_fd is None:
            return False
        try:
            at_path = os.stat(self._state_path, follow_symlinks=False)
        except OSError:
            return False
        if ((at_path.st_dev, at_path.st_ino) != self._state_inode
                or at_path.st_size > layout.STATE_SIZE):
            return False
        self._reads += 1
        self._policed_ns = now_ns
        return True

    def _sweep(self) -> None:
        """Remove what a container put into its region directory: only regions of older agents
        had the directory mounted, and there a tenant could fill the state dir's disk. At most
        `_SWEEP_BATCH` entries a pass, counted down into directories too (the sweep runs on
        the event loop: a tree of a hundred thousand files removed at once held it for half a
        second); the rest go at the next passes."""
        try:
            with os.scandir(self.path) as entries:
                found = [e for e in itertools.islice(entries, _SWEEP_BATCH + len(_REGION_FILES))
                         if e.name not in _REGION_FILES]
        except OSError:
            return
        if not found:
            return
        try:
            top = os.open(self.path, _DIR_FLAGS)
        except OSError:
            return
        budget = _SWEEP_BATCH
        try:
            for entry in found:
                if budget <= 0:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        gone, used = remove_tree_some(top, entry.name, budget)
                        budget -= used
                    else:
                        _unlink_at(entry.name, top)
                        gone, budget = True, budget - 1
                except OSError as err:
                    budget -= 1
                    self._kept(entry, err)
                    continue
                if not gone:
                    continue
                self._foreign_kept.pop(entry.name, None)
                self.foreign_removed += 1
                if self.foreign_removed == 1:
                    log.warning("region_foreign_entry_removed", alloc_id=self._alloc_id,
                                path=entry.path,
                                reason="only the region's own files belong there")
        finally:
            os.close(top)

    def _kept(self, entry: os.DirEntry[str], err: OSError) -> None:
        """Warn of a foreign entry that could not be removed once, not at every sweep (every
        few seconds, for as long as the region lives); it is retried at each sweep all the same.
        At most a batch of names is remembered: past that, further ones are not warned of."""
        code = err.errno or 0
        known = self._foreign_kept.get(entry.name)
        if known == code or (known is None and len(self._foreign_kept) >= _SWEEP_BATCH):
            return
        self._foreign_kept[entry.name] = code
        log.warning("region_foreign_entry_kept", alloc_id=self._alloc_id, path=entry.path,
                    error=str(err), repeats="not logged again for this entry and error")

    def _cut(self, path: Path, size: int, found: int) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | _NOFOLLOW)
        except OSError as err:
            log.warning("region_file_oversized", alloc_id=self._alloc_id, path=str(path),
                        size=found, allowed=size, truncated=False, error=str(err))
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.ftruncate(fd, size)
                self.files_truncated += 1
                log.warning("region_file_oversized", alloc_id=self._alloc_id, path=str(path),
                            size=found, allowed=size, truncated=True)
        finally:
            os.close(fd)

    def _open_state(self) -> bool:
        # O_NONBLOCK: a FIFO put in place of the file must not hang the agent in open().
        try:
            fd = os.open(self._state_path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except OSError:
            return False
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return False
        self._state_fd, self._state_inode = fd, (info.st_dev, info.st_ino)
        return True

    def _read_usage(self) -> RegionUsage:
        """Two preads: the header, then only the slots below its high-water mark; a third for
        the per-device words of the 1.1 extension when the header says the file has it (a
        region an agent of ABI 1.0 created has not).

        The mark is bounded by the ABI's slot count, and a file shorter than it says gives a
        short read, which the decoder counts; nothing past what was read is ever looked at.
        """
        if self._state_fd is None and not self._open_state():
            return RegionUsage(corrupt=True)
        assert self._state_fd is not None
        if usage_at is not None:  # the same reads and decode in C (`usageread`)
            return usage_of(usage_at(self._state_fd, self.device_count, self._slot_budget))
        return self._read_usage_in_python()

    def _read_usage_in_python(self) -> RegionUsage:
        """`_read_usage` in Python (the reference, and where the C read was not built)."""
        assert self._state_fd is not None
        buffer = _read_buffer()
        header = layout.STATE_HEADER_SIZE
        extension: bytes | None = None
        with memoryview(buffer) as whole:
            size = os.preadv(self._state_fd, [whole[:header]], 0)
            slots = layout.state_slots_to_read(whole[:size]) if size == header else 0
            slots = min(slots, self._slot_budget)
            if size == header and layout.state_has_extension(whole[:size]):
                extension = os.pread(
                    self._state_fd, layout.STATE_EXT_SIZE, layout.STATE_OFFSETS["ext"]
                )
            if slots:
                size += os.preadv(
                    self._state_fd, [whole[header : header + slots * layout.SLOT_SIZE]], header
                )
            with whole[:size] as view:
                if size > _DECODE_CACHE_BYTES:
                    return layout.decode_state(
                        view, self.device_count, slots_read=slots, extension=extension
                    )
                raw = bytes(view)
        # An idle container leaves `state` as it was: the same bytes decode the same way.
        last = self._last_read
        if last is not None and last[0] == raw and last[1] == extension:
            return last[2]
        usage = layout.decode_state(
            raw, self.device_count, slots_read=slots, extension=extension
        )
        self._last_read = (raw, extension, usage)
        return usage


def _open_control(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | _NOFOLLOW)
    except PermissionError:
        # Root writes a 0444 file anyway. An agent run as an ordinary user (a `simulate` on a
        # workstation) owns its files and lifts the mode just for the open.
        if os.geteuid() == 0 or os.lstat(path).st_uid != os.geteuid():
            raise
        os.chmod(path, CONTROL_MODE | 0o200)
        try:
            return os.open(path, os.O_RDWR | _NOFOLLOW)
        finally:
            os.chmod(path, CONTROL_MODE)


def _as_handle(region: Region) -> RegionHandle:
    return region  # lets mypy prove that Region implements the protocol


def _validated_control(buf: mmap.mmap, path: Path, alloc_id: str) -> layout.Control:
    try:
        with memoryview(buf) as view:
            control = layout.decode_control(view)
    except layout.RegionFormatError as err:
        raise RegionError(f"{path}: {err}") from None
    problems = []
    if not control.devices:
        problems.append("no devices")
    if not control.device_ids:
        problems.append("no device IDs")
    for i, d in enumerate(control.devices):
        if not d.uuid:
            problems.append(f"devices[{i}] has no UUID")
        if d.policy not in layout.POLICY_NAMES:
            problems.append(f"devices[{i}].policy={d.policy}, allowed {sorted(layout.POLICIES)}")
        if not 0 < d.core_limit <= layout.CORE_LIMIT_FULL:
            problems.append(f"devices[{i}].core_limit={d.core_limit} not in 1..1000000")
    if alloc_seq(alloc_id) != control.seq:
        problems.append(f"seq {control.seq} does not match the directory name {alloc_id}")
    if problems:
        raise RegionError(f"{path}: " + "; ".join(problems))
    return control


_buffers = threading.local()


def _read_buffer() -> bytearray:
    """A `state`-sized buffer per thread: one for all regions, not 700 KB for each."""
    buffer: bytearray | None = getattr(_buffers, "state", None)
    if buffer is None:
        buffer = _buffers.state = bytearray(layout.STATE_SIZE)
    return buffer


# ------------------------------------------------------------------ identity and collection


@dataclass(frozen=True)
class RegionFacts:
    """What the binding rules need to know of a region."""

    alloc_id: str
    seq: int
    device_ids: frozenset[str]
    created_ns: int


@dataclass(frozen=True)
class RegionPlan:
    bound: dict[str, ContainerKey]  # alloc_id -> the container it belongs to (or belonged to)
    unheld_since: dict[str, int]  # alloc_id -> when it was first seen not held
    remove: dict[str, str]  # alloc_id -> why


def plan_regions(
    regions: Sequence[RegionFacts],
    assignments: Mapping[str, ContainerKey],
    bound: Mapping[str, ContainerKey],
    unheld_since: Mapping[str, int],
    now_ns: int,
    grace_ns: int,
) -> RegionPlan:
    """Bind regions to containers and choose what to remove (the rules are in the module note).

    Pure: `bound` and `unheld_since` are the previous plan's, the result replaces them.
    """
    gathered: dict[ContainerKey, set[str]] = {}
    for device_id, ref in assignments.items():
        gathered.setdefault((ref[0], ref[1], ref[2]), set()).add(device_id)
    held = {key: frozenset(ids) for key, ids in gathered.items()}

    def holder(facts: RegionFacts) -> ContainerKey | None:
        if not facts.device_ids:
            return None
        ref = assignments.get(next(iter(facts.device_ids)))
        if ref is None:
            return None
        key: ContainerKey = (ref[0], ref[1], ref[2])
        return key if held.get(key) == facts.device_ids else None

    by_holder: dict[ContainerKey, list[RegionFacts]] = {}
    for facts in regions:
        key = holder(facts)
        if key is not None:
            by_holder.setdefault(key, []).append(facts)

    new_bound: dict[str, ContainerKey] = {}
    garbage: dict[str, str] = {}
    current: set[str] = set()
    for key, candidates in by_holder.items():
        owner = max(candidates, key=lambda f: f.seq)
        new_bound[owner.alloc_id] = key
        current.add(owner.alloc_id)
        for f in candidates:
            if f.alloc_id != owner.alloc_id:
                garbage[f.alloc_id] = "superseded by a newer region of the same device IDs"

    new_unheld: dict[str, int] = {}
    remove: dict[str, str] = {}
    for facts in regions:
        if facts.alloc_id not in new_bound and facts.alloc_id in bound:
            new_bound[facts.alloc_id] = bound[facts.alloc_id]  # keep its last known labels
        if facts.alloc_id in current:
            continue
        age = now_ns - facts.created_ns if facts.created_ns <= now_ns else math.inf
        if facts.alloc_id in garbage:
            if age >= grace_ns:
                remove[facts.alloc_id] = garbage[facts.alloc_id]
            else:
                new_unheld[facts.alloc_id] = unheld_since.get(facts.alloc_id, now_ns)
            continue
        since = unheld_since.get(facts.alloc_id, now_ns)
        if now_ns - since >= grace_ns and age >= grace_ns:
            remove[facts.alloc_id] = "no container holds its device IDs"
        else:
            new_unheld[facts.alloc_id] = since
    for alloc_id in remove:
        new_bound.pop(alloc_id, None)
    return RegionPlan(new_bound, new_unheld, remove)


# ------------------------------------------------------------------ the store


@dataclass
class RegionCounters:
    """Monotonic counts for the metrics."""

    created: int = 0
    adopted: int = 0
    removed: int = 0
    corrupt: int = 0  # regions found unreadable at start (moved to regions.corrupt/)
    create_failures: int = 0
    shim_missing: int = 0  # allocations answered without the shim mounts (shim not installed)
    rolled_back: int = 0  # regions removed because their Allocate failed part-way
    gc_postponed: int = 0  # PodResources answers listing no container of ours: no GC then


@dataclass
class _Binding:
    bound: dict[str, ContainerKey] = field(default_factory=dict)
    unheld_since: dict[str, int] = field(default_factory=dict)


class RegionStore:
    """All regions of this node: creates, adopts, binds to containers and collects them."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        default_policy: CorePolicy = "strict",
        container_region_dir: str = "/run/vgpu",
        container_shim_path: str = "/usr/local/vgpu/libvgpu.so",
        gc_grace_s: float = 30.0,
        initial_rate: InitialRate = unconfigured_rate,
        clock: Callable[[], int] = time.monotonic_ns,
        offload_io: bool = False,
        control_flags: int = 0,
    ):
        if default_policy not in CORE_POLICIES:
            raise ValueError(
                f"default core policy {default_policy!r} is not allowed: one of {CORE_POLICIES}"
            )
        if not gc_grace_s >= 0:
            raise ValueError(f"region GC grace must be >= 0 s, got {gc_grace_s!r}")
        for name, value in (
            ("container_region_dir", container_region_dir),
            ("container_shim_path", container_shim_path),
        ):
            if not value.startswith("/"):
                raise ValueError(f"{name}={value!r} is not allowed: an absolute path")
        self.state_dir = Path(state_dir)
        self.root = self.state_dir / REGIONS_DIR
        self.quarantine = self.state_dir / QUARANTINE_DIR
        self.shim_dir = self.state_dir / SHIM_DIR
        self.default_policy: CorePolicy = default_policy
        self.container_region_dir = container_region_dir.rstrip("/") or "/"
        self.container_shim_path = container_shim_path
        self.gc_grace_ns = round(gc_grace_s * 1e9)
        self.initial_rate = initial_rate
        self.clock = clock
        self.offload_io = offload_io
        if control_flags & ~layout.CONTROL_FLAGS_KNOWN or control_flags < 0:
            raise ValueError(f"control flags {control_flags:#x} are not allowed: bits of "
                             f"{layout.CONTROL_FLAGS_KNOWN:#x}")
        # what the containers of new regions may change about their shim (off: nothing)
        self.control_flags = control_flags
        self.counters = RegionCounters()
        # told of every region added (created or adopted), from whichever thread added it
        self.on_added: Callable[[], None] | None = None
        self._spares: dict[int, list[Path]] = {}
        self._spares_pending: dict[int, int] = {}
        self._spare_tasks: set[asyncio.Task[None]] = set()
        self._spare_names = itertools.count()
        # Spares made in a worker thread and not yet taken, and whether the store is closed:
        # `close` cannot wait for the threads, so it deletes what they handed in, and a thread
        # that finds the store closed deletes what it made.
        self._spares_made: set[Path] = set()
        self._spare_lock = threading.Lock()
        self._closed = False
        self._retired_corrupt_reads = 0
        self._retired_skipped_records = 0
        self._retired_tampering = {"state_replaced": 0, "files_truncated": 0, "foreign_removed": 0}
        self._regions: dict[str, Region] = {}
        # the open regions `regions()` last sorted, and their order, as one pair: it is asked
        # from worker threads too, and two fields set by two callers could pair apart
        self._sorted: tuple[tuple[Region, ...], list[Region]] = ((), [])
        self._binding = _Binding()
        self._next_seq: int | None = None
        self._seq_lock = threading.Lock()
        self._state_headers: dict[int, bytes] = {}
        self._shim_missing_logged = False
        self._pinned: set[str] = set()
        self._create_error = ""
        self._empty_answers = 0  # PodResources answers in a row that listed none of ours

    # --- queries ------------------------------------------------------------------------------

    def regions(self) -> list[Region]:
        """Open regions, oldest first.

        Sorted again only when the open regions changed: the controller asks every tick, and
        sorting 128 regions by a property cost the agent more than comparing them."""
        now = tuple(self._regions.values())
        known = self._sorted
        if now != known[0]:
            known = self._sorted = (now, sorted(now, key=lambda r: r.seq))
        return list(known[1])

    def get(self, alloc_id: str) -> Region | None:
        return self._regions.get(alloc_id)

    def identity(self, alloc_id: str) -> ContainerKey | None:
        """(namespace, pod, container) the region belongs (or last belonged) to; None if unknown."""
        return self._binding.bound.get(alloc_id)

    def corrupt_reads(self) -> int:
        """`state` reads that found the file unreadable, cumulative (collected regions too)."""
        return self._retired_corrupt_reads + sum(r.corrupt_reads for r in self._regions.values())

    def skipped_records(self) -> int:
        """Nonsense records (bad counts, pids, sizes) skipped while reading `state`, cumulative."""
        live = sum(r.skipped_records for r in self._regions.values())
        return self._retired_skipped_records + live

    def tampering(self) -> dict[str, int]:
        """Container files found replaced (`state_replaced`) or grown past their size and cut
        back (`files_truncated`), cumulative (collected regions too)."""
        out = dict(self._retired_tampering)
        for r in self._regions.values():
            out["state_replaced"] += r.state_replaced
            out["files_truncated"] += r.files_truncated
            out["foreign_removed"] += r.foreign_removed
        return out

    def check_usable(self) -> None:
        """Raise OSError naming the path if a region cannot be created under the state dir.

        Builds and removes a probe as big as a region's `state` file, so a read-only or full
        file system, a file in the path or missing permissions stop the agent at start, where
        they are seen, rather than failing every Allocate later.
        """
        probe = self.root / f"{_NEW_PREFIX}probe-{os.getpid()}"
        try:
            self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            shutil.rmtree(probe, ignore_errors=True)
            os.mkdir(probe, DIR_MODE)
            try:
                self._write_state(probe / STATE_FILE, 1)
            finally:
                shutil.rmtree(probe, ignore_errors=True)
        except OSError as err:
            where = err.filename or probe
            raise OSError(
                err.errno, f"state dir {self.state_dir} is unusable: {err.strerror} ({where})"
            ) from err

    @property
    def create_error(self) -> str:
        """Why the last region creation failed, "" once one succeeds again (for /readyz)."""
        return self._create_error

    # --- creation -----------------------------------------------------------------------------

    async def on_grant(self, grant: Grant) -> Extras:
        """The Allocate hook: create the grant's region, return its mounts and variables.

        The file work (about 0.6 ms p50 on the benchmark machine, mostly reserving the state
        file's blocks) runs on the loop unless `offload_io`: handing it to a thread measured
        0.7 ms slower per Allocate there, and Allocates are rare next to the loop's 100 ms ticks.
        """
        seq = self._take_seq()
        if self.offload_io:
            region = await asyncio.to_thread(self._build, seq, grant)
        else:
            region = self._build(seq, grant)
        self._add(region)
        try:
            extras = self.extras_for(region)
        except BaseException:
            self.discard(region.alloc_id)  # nobody else knows of it yet
            raise
        extras.rollback = lambda: self.discard(region.alloc_id)
        self.prepare_spares(len(grant.devices))
        return extras

    def discard(self, alloc_id: str) -> None:
        """Remove a region that no container will use (its Allocate failed after it was made)."""
        region = self._regions.pop(alloc_id, None)
        if region is None:
            return
        region.close()
        self._delete(region.path)
        self.counters.rolled_back += 1
        log.info("region_rolled_back", alloc_id=alloc_id)

    def prepare_spares(self, device_count: int) -> None:
        """Prepare region directories of this shape in a thread, off the Allocate path.

        Call on the event loop; Allocate calls it for its own shape after each region."""
        ready = len(self._spares.get(device_count, ())) + self._spares_pending.get(device_count, 0)
        for _ in range(SPARES_PER_SHAPE - ready):
            self._spares_pending[device_count] = self._spares_pending.get(device_count, 0) + 1
            task = asyncio.create_task(self._prepare_spare(device_count))
            self._spare_tasks.add(task)
            task.add_done_callback(self._spare_tasks.discard)

    async def _prepare_spare(self, device_count: int) -> None:
        try:
            path = await asyncio.to_thread(self._make_spare, device_count)
        except OSError as err:
            if self._closed:
                return
            log.warning("region_spare_failed", path=str(self.root), error=str(err))
            self._create_error = f"{self.root}: {err.strerror or err}"
            return
        finally:
            self._spares_pending[device_count] -= 1
        self._create_error = ""
        self._spares.setdefault(device_count, []).append(path)

    def _make_spare(self, device_count: int) -> Path:
        path = self.root / f"{_NEW_PREFIX}spare-{os.getpid()}-{next(self._spare_names)}"
        if self._closed:
            raise OSError(errno.ESHUTDOWN, "region store closed", str(path))
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.mkdir(path, DIR_MODE)
        try:
            os.chmod(path, DIR_MODE)
            self._write_state(path / STATE_FILE, device_count)
            with self._spare_lock:  # held for the bookkeeping only, never for the writes
                if not self._closed:
                    self._spares_made.add(path)
                    return path
            raise OSError(errno.ESHUTDOWN, "region store closed", str(path))
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def _take_spare(self, device_count: int) -> Path | None:
        spares = self._spares.get(device_count)
        if not spares:
            return None
        path = spares.pop()
        with self._spare_lock:
            self._spares_made.discard(path)
        return path

    def create(
        self,
        grant: Grant,
        *,
        policies: Sequence[CorePolicy | None] = (),
        priority: int = 0,
        pinned: bool = False,
    ) -> Region:
        """Create the region of one grant. Raises RegionError.

        `policies` (per device, None: the default) and `priority` come from a DRA claim's
        parameters. A `pinned` region is never collected by `reconcile`: its owner (a prepared
        DRA claim) removes it with `remove()`, since a prepared claim's container may start long
        after Prepare (an image pull) or restart.
        """
        region = self._build(self._take_seq(), grant, policies, priority)
        self._add(region)
        if pinned:
            self._pinned.add(region.alloc_id)
        return region

    def pin(self, alloc_id: str) -> None:
        """Keep `reconcile` from collecting this region (after an agent restart)."""
        self._pinned.add(alloc_id)

    async def remove(self, alloc_id: str, reason: str) -> bool:
        """Close and delete one region now; False if there is no such region."""
        self._pinned.discard(alloc_id)
        region = self._regions.pop(alloc_id, None)
        if region is None:
            return False
        self._retired_corrupt_reads += region.corrupt_reads
        self._retired_skipped_records += region.skipped_records
        region.close()
        await asyncio.to_thread(self._delete, region.path)
        self._binding.bound.pop(alloc_id, None)
        self._binding.unheld_since.pop(alloc_id, None)
        self.counters.removed += 1
        log.info("region_removed", alloc_id=alloc_id, reason=reason)
        return True

    def extras_for(self, region: Region) -> Extras:
        """What the container's Allocate response gets for `region`."""
        inside = self.container_region_dir
        base = inside.rstrip("/")
        # The files, never the directory: the container can create nothing in the state dir.
        mounts = [
            (f"{base}/{CONTROL_FILE}", str(region.path / CONTROL_FILE), True),
            (f"{base}/{STATE_FILE}", str(region.path / STATE_FILE), False),
        ]
        if (region.path / HAMI_CACHE_FILE).is_file():  # regions of older agents have none
            mounts.append((f"{base}/{HAMI_CACHE_FILE}", str(region.path / HAMI_CACHE_FILE), False))
        shim = self.shim_dir / SHIM_FILE
        preload = self.shim_dir / PRELOAD_FILE
        if shim.exists() and preload.exists():
            mounts.append((self.container_shim_path, str(shim), True))
            mounts.append((PRELOAD_CONTAINER_PATH, str(preload), True))
            if self._shim_missing_logged:
                log.info("shim_installed", path=str(shim))
                self._shim_missing_logged = False
        else:
            # Mounting a missing file would keep the container from starting at all.
            self.counters.shim_missing += 1
            if not self._shim_missing_logged:
                # Once per outage: every Allocate of a node without the shim would repeat it.
                log.warning(
                    "shim_not_installed",
                    alloc_id=region.alloc_id,
                    expected=[str(shim), str(preload)],
                    effect="the container runs without memory and core enforcement",
                    repeats="not logged again until the shim is installed; counted per allocation",
                )
                self._shim_missing_logged = True
        envs = {
            REGION_DIR_ENV: inside,
            HAMI_CACHE_ENV: f"{base}/{HAMI_CACHE_FILE}",
        }
        return Extras(envs=envs, mounts=mounts)

    def _take_seq(self) -> int:
        with self._seq_lock:
            if self._next_seq is None:
                try:
                    self._next_seq = self._largest_seq_on_disk() + 1
                except OSError as err:
                    # Guessing would risk a sequence number that sorts before existing regions.
                    self.counters.create_failures += 1
                    log.error("region_create_failed", error=str(err))
                    raise RegionError(f"cannot create region in {self.root}: {err}") from err
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def _largest_seq_on_disk(self) -> int:
        largest = 0
        for directory in (self.root, self.quarantine):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    bare = name
                    for prefix in (_NEW_PREFIX, _GC_PREFIX):
                        bare = bare.removeprefix(prefix)
                    seq = alloc_seq(bare.split(".", 1)[0])
                    if seq is not None:
                        largest = max(largest, seq)
        largest = max([largest, *(r.seq for r in self._regions.values())])
        return largest

    def _control_for(
        self,
        seq: int,
        grant: Grant,
        created_ns: int,
        policies: Sequence[CorePolicy | None] = (),
        priority: int = 0,
    ) -> layout.Control:
        devices = []
        for i, device in enumerate(grant.devices):
            chosen = policies[i] if i < len(policies) else None
            policy: CorePolicy = chosen or self.default_policy
            rate, burst = self.initial_rate(device, policy)
            devices.append(
                layout.ControlDevice(
                    uuid=device.uuid,
                    memory_limit=device.memory_limit,
                    core_limit=core_limit_ppm(device.core_percent),
                    rate=rate,
                    burst=burst,
                    policy=_POLICY_CODES[policy],
                    flags=layout.CONTROL_FLAG_SPILL if device.spill else 0,
                )
            )
        return layout.Control(
            devices=tuple(devices),
            device_ids=tuple(grant.device_ids),
            priority=priority,
            seq=seq,
            created_ns=created_ns,
            heartbeat_ns=created_ns,
            flags=self.control_flags,
        )

    def _build(
        self,
        seq: int,
        grant: Grant,
        policies: Sequence[CorePolicy | None] = (),
        priority: int = 0,
    ) -> Region:
        created_ns = self.clock()
        alloc_id = format_alloc_id(seq, grant.device_ids, created_ns)
        final = self.root / alloc_id
        spare = self._take_spare(len(grant.devices))
        temp = spare or self.root / (_NEW_PREFIX + alloc_id)
        try:
            control = layout.encode_control(
                self._control_for(seq, grant, created_ns, policies, priority)
            )
            if spare is None:
                self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                os.mkdir(temp, DIR_MODE)
                os.chmod(temp, DIR_MODE)  # the umask must not take the container's read access
                self._write_state(temp / STATE_FILE, len(grant.devices))
            _write_new(temp / CONTROL_FILE, control, CONTROL_MODE)
            os.rename(temp, final)
            region = Region.open(final)
        except (OSError, layout.RegionFormatError, RegionError) as err:
            self.counters.create_failures += 1
            self._create_error = f"{final}: {err}"
            shutil.rmtree(temp, ignore_errors=True)
            log.error("region_create_failed", alloc_id=alloc_id, error=str(err))
            raise RegionError(f"cannot create region {final}: {err}") from err
        self.counters.created += 1
        self._create_error = ""
        log.info(
            "region_created",
            alloc_id=alloc_id,
            device_ids=list(grant.device_ids),
            policy=[p or self.default_policy for p in policies] or self.default_policy,
        )
        return region

    def _write_state(self, path: Path, device_count: int) -> None:
        header = self._state_headers.get(device_count)
        if header is None:
            header = layout.encode_state(device_count)[: layout.STATE_HEADER_SIZE]
            self._state_headers[device_count] = header
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, STATE_MODE)
        try:
            os.fchmod(fd, STATE_MODE)
            # Blocks reserved now: a shim writing to a sparse page of a full disk gets SIGBUS.
            os.posix_fallocate(fd, 0, layout.STATE_SIZE)
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        # Made here, not by HAMi-core in the container: it can create nothing in the state dir,
        # and a non-root container could not create it in a root-owned one anyway.
        _write_new(path.with_name(HAMI_CACHE_FILE), b"", HAMI_CACHE_MODE)

    def _add(self, region: Region) -> None:
        self._regions[region.alloc_id] = region
        if self.on_added is not None:
            self.on_added()

    # --- adoption -----------------------------------------------------------------------------

    def adopt(self) -> list[Region]:
        """Open every region on disk as it is (limits untouched); quarantine unreadable ones.

        Call once at start, before serving Allocate (it does file I/O: run it in a thread if the
        loop is busy). Leftovers of interrupted creations and removals are deleted. Never raises:
        an unusable regions dir is logged, and Allocate then fails with the reason.
        """
        adopted: list[Region] = []
        try:
            self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            names = sorted(os.listdir(self.root))
        except OSError as err:
            # Not fatal here: the device plugin still serves, and each Allocate says why it fails.
            log.error("regions_dir_unusable", path=str(self.root), error=str(err))
            return adopted
        for name in names:
            path = self.root / name
            if name.startswith((_NEW_PREFIX, _GC_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                log.info("region_leftover_removed", path=str(path))
                continue
            if alloc_seq(name) is None or not path.is_dir() or path.is_symlink():
                log.warning("region_dir_unknown_entry", path=str(path))
                continue
            if name in self._regions:
                continue
            try:
                region = Region.open(path)
            except RegionError as err:
                self.counters.corrupt += 1
                self._move_aside(path, str(err))
                continue
            self._add(region)
            adopted.append(region)
            self.counters.adopted += 1
            log.info(
                "region_adopted",
                alloc_id=region.alloc_id,
                device_ids=list(region.device_ids),
                rates=[region.rate(d) for d in range(region.device_count)],
            )
        with self._seq_lock:
            try:
                floor = self._largest_seq_on_disk() + 1
            except OSError as err:
                log.error("regions_dir_unusable", path=str(self.quarantine), error=str(err))
                return adopted  # the next Allocate tries again, and fails with the reason
            self._next_seq = max(self._next_seq or 0, floor)
        return adopted

    def _move_aside(self, path: Path, reason: str) -> None:
        target = self.quarantine / f"{path.name}.{time.time_ns()}"
        try:
            self.quarantine.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, target)
        except OSError as err:
            log.error("region_corrupt", path=str(path), reason=reason, moved=False, error=str(err))
            return
        log.error("region_corrupt", path=str(path), reason=reason, moved_to=str(target))
        kept = sorted(os.listdir(self.quarantine))
        for name in kept[: max(0, len(kept) - QUARANTINE_KEEP)]:
            shutil.rmtree(self.quarantine / name, ignore_errors=True)

    # --- identity and collection --------------------------------------------------------------

    async def reconcile(self, assignments: Mapping[str, ContainerKey]) -> dict[str, str]:
        """Bind regions to the containers PodResources reports and remove garbage.

        `assignments` maps device ID -> (namespace, pod, container) for our resource. Returns the
        removed regions (alloc_id -> reason).

        An answer that lists no container of our resource is no evidence that any region is
        unused (a kubelet that restarts answers empty for a while): it binds nothing, removes
        nothing and restarts every grace period (counted as `gc_postponed`).
        """
        if not assignments:
            self._empty_answers += 1
            if self._regions:
                self.counters.gc_postponed += 1
                if self._empty_answers == 1:
                    log.warning(
                        "region_gc_postponed",
                        regions=len(self._regions),
                        reason="PodResources lists no container of this resource",
                        effect="no region is removed until it lists one again",
                    )
            self._binding = _Binding(self._binding.bound, {})
            return {}
        self._empty_answers = 0
        facts = [
            RegionFacts(r.alloc_id, r.seq, frozenset(r.device_ids), r.created_ns)
            for r in self._regions.values()
        ]
        plan = plan_regions(
            facts,
            assignments,
            self._binding.bound,
            self._binding.unheld_since,
            self.clock(),
            self.gc_grace_ns,
        )
        newly = {
            alloc_id: key
            for alloc_id, key in plan.bound.items()
            if self._binding.bound.get(alloc_id) != key
        }
        last_known = dict(self._binding.bound)
        bound = dict(plan.bound)
        for alloc_id in plan.remove:
            if alloc_id in self._pinned and alloc_id in last_known:
                bound[alloc_id] = last_known[alloc_id]  # kept, so it keeps its labels
        for alloc_id in self._pinned:
            # a claim's region belongs to the container holding all its IDs, also when that
            # container holds other claims too (the plan's rule wants the exact set)
            pinned = self._regions.get(alloc_id)
            if pinned is None or not pinned.device_ids:
                continue
            refs = {tuple(assignments[i]) for i in pinned.device_ids if i in assignments}
            if len(refs) == 1 and all(i in assignments for i in pinned.device_ids):
                key = refs.pop()
                if bound.get(alloc_id) != key and last_known.get(alloc_id) != key:
                    newly[alloc_id] = (key[0], key[1], key[2])
                bound[alloc_id] = (key[0], key[1], key[2])
        for alloc_id, key in newly.items():
            log.info(
                "region_bound", alloc_id=alloc_id, namespace=key[0], pod=key[1], container=key[2]
            )
        self._binding = _Binding(bound, plan.unheld_since)
        removed: dict[str, str] = {}
        for alloc_id, reason in plan.remove.items():
            if alloc_id in self._pinned:
                continue  # its DRA claim is still prepared; Unprepare removes it
            region = self._regions.pop(alloc_id, None)
            if region is None:
                continue
            removed[alloc_id] = reason
            # keep the counts monotonic for the metrics after the region is gone
            self._retired_corrupt_reads += region.corrupt_reads
            self._retired_skipped_records += region.skipped_records
            self._retired_tampering["state_replaced"] += region.state_replaced
            self._retired_tampering["files_truncated"] += region.files_truncated
            self._retired_tampering["foreign_removed"] += region.foreign_removed
            region.close()
            await asyncio.to_thread(self._delete, region.path)
            self.counters.removed += 1
            last = last_known.get(alloc_id)
            log.info(
                "region_removed",
                alloc_id=alloc_id,
                reason=reason,
                container="/".join(last) if last else None,
            )
        return removed

    def _delete(self, path: Path) -> None:
        doomed = path.with_name(_GC_PREFIX + path.name)
        try:
            os.rename(path, doomed)  # gone from the region namespace in one step
        except FileNotFoundError:
            return
        except OSError as err:
            log.error("region_remove_failed", path=str(path), error=str(err))
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
        for task in self._spare_tasks:
            task.cancel()
        # A spare still being made finishes first; one made but not handed over (its task was
        # cancelled) is deleted with the rest.
        with self._spare_lock:
            self._closed = True
            made, self._spares_made = self._spares_made, set()
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        self._spares.clear()


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)

"""A simulated in-container shim working on an allocation's real region files.

It does to `control` and `state` what `libvgpu.so` does inside a container: maps `control`
read-only and reads the device's policy, core limit, rate and burst from it; maps `state`
read-write, claims a process slot (pid, host pid, start time), and publishes the slot's counters
(launches, tokens spent, wait ns, last launch ns, memory used), the device totals and the token
bucket (balance, last refill) at the ABI offsets of `vgpu_agent.shm.layout`.

The token rule itself runs in `gpu.ShimGate` on an in-memory `SimRegion` mirror: `pull` loads the
files into the mirror before a simulated step, `push` stores the mirror back after it, as the
shim publishes its counters once per clock tick. Only aligned 64-bit stores are used.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vgpu_agent.shm import layout
from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.shm.regions import CONTROL_FILE, STATE_FILE
from vgpu_agent.simulation.region import ProcessCounters, SimRegion

_SIGN = 1 << 63
_WRAP = 1 << 64


class ShimFileError(Exception):
    """A region's files cannot be used by the simulated shim; the message names file and reason."""


def host_pid_candidates(proc_root: str = "/proc") -> Iterator[int]:
    """Host PIDs for simulated processes that no real process holds.

    PIDs at or above the kernel's `pid_max` can never be given to a process, so those come first;
    where `pid_max` is already at the ABI's bound, the highest PIDs not in use now are used. Either
    way the controller's cgroup fallback finds no `/proc/<pid>` to attribute them by.
    """
    try:
        with open(os.path.join(proc_root, "sys/kernel/pid_max"), encoding="ascii") as f:
            pid_max = int(f.read().strip())
    except (OSError, ValueError):
        pid_max = layout.PID_MAX
    yield from range(max(300, pid_max), layout.PID_MAX)
    for pid in range(min(pid_max, layout.PID_MAX) - 1, 300, -1):
        if not os.path.exists(os.path.join(proc_root, str(pid))):
            yield pid


@dataclass
class ShimProcess:
    """One simulated process's slot in `state`, with its counters and memory per device."""

    slot: int
    counters: ProcessCounters
    memory_used: list[int]


class RegionShim:
    """The simulated shim of one allocation, on `<region>/control` and `<region>/state`."""

    def __init__(self, path: Path):
        self.path = path
        self._control, self._control_view = _map(path / CONTROL_FILE, write=False)
        try:
            control = layout.decode_control(self._control_view)
            self._state, self._state_view = _map(path / STATE_FILE, write=True)
        except (layout.RegionFormatError, ShimFileError) as err:
            self._unmap_control()
            raise ShimFileError(f"{path / CONTROL_FILE}: {err}") from None
        self.device_count = len(control.devices)
        if self.device_count == 0 or self._state_load("device_count") != self.device_count:
            found = self._state_load("device_count")
            self.close()
            raise ShimFileError(
                f"{path / STATE_FILE}: {found} devices, control has {self.device_count}: "
                "the counts must match and be at least 1"
            )
        self.memory_limits = tuple(d.memory_limit for d in control.devices)
        self.mirror = SimRegion(
            path.name,
            tuple(d.uuid for d in control.devices),
            tuple(100.0 for _ in control.devices),
            tuple("off" for _ in control.devices),
            memory_limits=self.memory_limits,
        )
        self.processes: list[ShimProcess] = []
        # Device totals count ended processes too: what was there before we came, plus what our
        # ended processes did.
        self._base = [
            [self._device_load(d, f) for f in ("tokens_spent", "launches", "wait_ns")]
            for d in range(self.device_count)
        ]
        self.pull()

    # -- the shim's reads of control and its bucket -----------------------------------------
    def pull(self) -> None:
        """Load policy, limit, rate and burst from `control` and the bucket from `state`."""
        view, mirror = self._live_control(), self.mirror
        limits, policies, rates = [], [], []
        for dev in range(self.device_count):
            core = layout.load_u64(view, layout.control_device_offset(dev, "core_limit"))
            code = layout.load_u64(view, layout.control_device_offset(dev, "policy"))
            limits.append(max(1e-4, min(100.0, core * 100 / layout.CORE_LIMIT_FULL)))
            name: CorePolicy = layout.POLICY_NAMES.get(code, "off")  # type: ignore[assignment]
            policies.append(name)  # an unknown policy is not enforced, as in the shim
            rates.append((
                layout.load_u64(view, layout.control_device_offset(dev, "rate")),
                layout.load_u64(view, layout.control_device_offset(dev, "burst")),
            ))
            balance = self._device_load(dev, "balance")
            mirror.balances[dev] = balance - _WRAP if balance & _SIGN else balance
            mirror.last_refill_ns[dev] = self._device_load(dev, "last_refill_ns")
        mirror.core_limits, mirror.policies, mirror.rates = tuple(limits), tuple(policies), rates

    # -- process slots ----------------------------------------------------------------------
    def start_process(self, host_pid: int, memory: list[int]) -> ShimProcess:
        """Claim a free slot for a new process holding `memory` bytes per device."""
        if len(memory) != self.device_count or min(memory) < 0:
            raise ValueError(
                f"memory per device must be {self.device_count} values >= 0, got {memory!r}"
            )
        if not 0 < host_pid < layout.PID_MAX:
            raise ValueError(f"host pid {host_pid} is not allowed: 1..{layout.PID_MAX - 1}")
        view = self._live_state()
        taken = {p.slot for p in self.processes}
        for slot in range(layout.MAX_PROCS):
            if slot not in taken and layout.load_u64(view, _slot_offset(slot, "pid")) == 0:
                break
        else:
            raise ShimFileError(f"{self.path / STATE_FILE}: all {layout.MAX_PROCS} slots in use")
        pid = len(self.processes) + 1  # the in-container pid namespace starts at 1
        while any(p.counters.pid == pid for p in self.processes):
            pid += 1
        n = self.device_count
        counters = ProcessCounters(pid, host_pid, [0] * n, [0] * n, [0] * n, [0] * n)
        proc = ShimProcess(slot, counters, list(memory))
        self.mirror.processes.append(counters)
        # Like the shim: raise the slot high-water mark above the slot (readers skip the slots
        # past it), claim the slot by its pid, then fill in the rest. One writer owns this file,
        # so a load and a store stand in for the shim's atomic max.
        mark = layout.STATE_OFFSETS["slot_high_water"]
        layout.store_u64(view, mark, max(layout.load_u64(view, mark), slot + 1))
        layout.store_u64(view, _slot_offset(slot, "pid"), pid)
        layout.store_u64(view, _slot_offset(slot, "host_pid"), host_pid)
        ticks = int(time.monotonic() * os.sysconf("SC_CLK_TCK"))
        layout.store_u64(view, _slot_offset(slot, "start_time"), ticks)
        for dev in range(n):
            self._device_store(dev, "memory_used", self._device_load(dev, "memory_used")
                               + memory[dev])
        self.processes.append(proc)
        self.push()
        return proc

    def end_process(self, proc: ShimProcess) -> None:
        """The process exits: its memory is freed, its slot zeroed and given back."""
        if proc not in self.processes:
            return
        self.push()
        view = self._live_state()
        c = proc.counters
        for dev in range(self.device_count):
            for i, value in enumerate((c.tokens_spent[dev], c.launches[dev], c.wait_ns[dev])):
                self._base[dev][i] += value
            held = self._device_load(dev, "memory_used")
            self._device_store(dev, "memory_used", max(0, held - proc.memory_used[dev]))
            for field in layout.PROC_DEVICE_OFFSETS:
                layout.store_u64(view, _slot_offset(proc.slot, field, dev), 0)
        for field in ("host_pid", "start_time"):
            layout.store_u64(view, _slot_offset(proc.slot, field), 0)
        layout.store_u64(view, _slot_offset(proc.slot, "pid"), 0)
        self.processes.remove(proc)
        self.mirror.processes.remove(c)

    # -- the shim's publication of its counters ---------------------------------------------
    def push(self) -> None:
        """Store the bucket, every live slot's counters and the device totals into `state`."""
        view, mirror = self._live_state(), self.mirror
        for dev in range(self.device_count):
            self._device_store(dev, "balance", mirror.balances[dev] % _WRAP)
            self._device_store(dev, "last_refill_ns", mirror.last_refill_ns[dev])
            totals = list(self._base[dev])
            for proc in self.processes:
                c = proc.counters
                totals[0] += c.tokens_spent[dev]
                totals[1] += c.launches[dev]
                totals[2] += c.wait_ns[dev]
                for field, value in (
                    ("memory_used", proc.memory_used[dev]),
                    ("launches", c.launches[dev]),
                    ("tokens_spent", c.tokens_spent[dev]),
                    ("wait_ns", c.wait_ns[dev]),
                    ("last_launch_ns", c.last_launch_ns[dev]),
                ):
                    layout.store_u64(view, _slot_offset(proc.slot, field, dev), value)
            for field, value in zip(("tokens_spent", "launches", "wait_ns"), totals, strict=True):
                self._device_store(dev, field, value)

    def close(self) -> None:
        """Unmap the files (the processes' slots stay as they are, as after a crash)."""
        for name in ("_state_view", "_control_view"):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
                setattr(self, name, None)
        for name in ("_state", "_control"):
            mapped = getattr(self, name, None)
            if mapped is not None:
                mapped.close()
                setattr(self, name, None)

    # -- helpers ----------------------------------------------------------------------------
    def _unmap_control(self) -> None:
        self._control_view.release()
        self._control.close()

    def _live_control(self) -> memoryview:
        if self._control_view is None:
            raise ShimFileError(f"{self.path}: closed")
        return self._control_view

    def _live_state(self) -> memoryview:
        if self._state_view is None:
            raise ShimFileError(f"{self.path}: closed")
        return self._state_view

    def _state_load(self, field: str) -> int:
        raw = bytes(self._live_state()[layout.STATE_OFFSETS[field]:][:4])
        return int.from_bytes(raw, "little")

    def _device_load(self, dev: int, field: str) -> int:
        return layout.load_u64(self._live_state(), _device_offset(dev, field))

    def _device_store(self, dev: int, field: str, value: int) -> None:
        layout.store_u64(self._live_state(), _device_offset(dev, field), value)


def _device_offset(dev: int, field: str) -> int:
    return (layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
            + layout.STATE_DEVICE_OFFSETS[field])


def _slot_offset(slot: int, field: str, dev: int | None = None) -> int:
    base = layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
    if dev is None:
        return base + layout.SLOT_OFFSETS[field]
    return (base + layout.SLOT_OFFSETS["devices"] + dev * layout.PROC_DEVICE_SIZE
            + layout.PROC_DEVICE_OFFSETS[field])


def _map(path: Path, *, write: bool) -> tuple[mmap.mmap, memoryview]:
    """Map a region file whole, after checking it is a regular file of the ABI's size (a shorter
    file would make touching the mapping past its end fatal)."""
    # a `state` an agent of ABI 1.0 created is smaller (no extension); this writer uses none of it
    sizes = (layout.STATE_SIZE, layout.STATE_SIZE_1_0) if write else (layout.CONTROL_SIZE,)
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise ShimFileError(f"cannot open {path}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size not in sizes:
            raise ShimFileError(
                f"{path} is {info.st_size} bytes (mode {info.st_mode:o}): a regular file of "
                f"{' or '.join(str(size) for size in sizes)} bytes expected"
            )
        expected = info.st_size
        mapped = mmap.mmap(fd, expected, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    view = memoryview(mapped)
    magic = layout.load_u64(view, 0)
    wanted = layout.STATE_MAGIC if write else layout.CONTROL_MAGIC
    if magic != wanted:
        view.release()
        mapped.close()
        raise ShimFileError(f"{path}: magic {magic:#x}, expected {wanted:#x}")
    return mapped, view

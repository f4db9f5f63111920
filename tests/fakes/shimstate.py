"""Region files on disk as the agent and the shim leave them, for the metrics tests.

`make_region` writes a real `control` file (what Allocate writes) and a fresh `state` file; a
`ShimWriter` then fills process slots (raising the slot high-water mark) and device totals at
the offsets of the region ABI, the way `libvgpu.so` does from inside a container. `FileRegion`
is a read-only `RegionHandle` over the two files (mmap'd, decoded on every call with the
project's defensive decoders), so the collectors read exactly the bytes a shim would have
written, corrupt ones included.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from vgpu_agent.shm import layout
from vgpu_agent.shm.api import CorePolicy, RegionUsage
from vgpu_agent.shm.regions import core_limit_ppm

POLICY_CODES = {"off": layout.POLICY_OFF, "strict": layout.POLICY_STRICT,
                "work-conserving": layout.POLICY_WORK_CONSERVING}


@dataclass(frozen=True)
class DeviceSpec:
    uuid: str
    memory_limit: int
    core_percent: float
    policy: CorePolicy = "strict"
    rate: int = 0
    burst: int = 0


def make_region(
    root: Path, alloc_id: str, devices: list[DeviceSpec], device_ids: list[str], seq: int = 1
) -> Path:
    directory = root / alloc_id
    directory.mkdir(parents=True)
    control = layout.Control(
        devices=tuple(
            layout.ControlDevice(
                uuid=d.uuid,
                memory_limit=d.memory_limit,
                core_limit=core_limit_ppm(d.core_percent),  # as Allocate rounds it
                rate=d.rate,
                burst=d.burst,
                policy=POLICY_CODES[d.policy],
            )
            for d in devices
        ),
        device_ids=tuple(device_ids),
        seq=seq,
    )
    (directory / "control").write_bytes(layout.encode_control(control))
    (directory / "state").write_bytes(layout.encode_state(len(devices)))
    return directory


def store_words(buf: mmap.mmap | bytearray, offset: int, *values: int) -> None:
    """`values` as consecutive u64 fields from `offset`, each in one aligned 8-byte store, as
    the shim's atomic stores. Not `struct.pack_into`: it writes a field in parts, zeroes first,
    and a reader in another process (the agent's pread) can see a total fallen to 0 halfway."""
    for n, value in enumerate(values):
        layout.store_u64(buf, offset + 8 * n, value)


class ShimWriter:
    """Writes a region's `state` the way the shim does (one 8-byte store per field, at ABI
    offsets)."""

    def __init__(self, directory: Path):
        self._fd = os.open(directory / "state", os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def process(
        self,
        slot: int,
        pid: int,
        host_pid: int,
        dev: int,
        *,
        memory: int = 0,
        launches: int = 0,
        wait_ns: int = 0,
        last_launch_ns: int = 0,
        tokens: int = 0,
    ) -> None:
        # as the shim claims: the high-water mark raised above the slot before its pid is set
        mark = layout.STATE_OFFSETS["slot_high_water"]
        layout.store_u64(self._map, mark, max(layout.load_u64(self._map, mark), slot + 1))
        base = layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
        store_words(self._map, base + layout.SLOT_OFFSETS["pid"], pid, host_pid)
        dev_base = base + layout.SLOT_OFFSETS["devices"] + dev * layout.PROC_DEVICE_SIZE
        o = layout.PROC_DEVICE_OFFSETS
        total_base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for field, value in (("launches", launches), ("tokens_spent", tokens),
                             ("wait_ns", wait_ns)):
            # what the slot gained went into the device's cumulative total too, as the shim
            # counts it (a total never below the sum of the live slots)
            # (a value no shim counts to is a hostile container's store: the total stays)
            gained = value - layout.load_u64(self._map, dev_base + o[field])
            if gained > 0 and value <= layout.PLAUSIBLE_COUNTER:
                self._add(total_base + layout.STATE_DEVICE_OFFSETS[field], gained)
        for field, value in (("memory_used", memory), ("launches", launches),
                             ("tokens_spent", tokens), ("wait_ns", wait_ns),
                             ("last_launch_ns", last_launch_ns)):
            store_words(self._map, dev_base + o[field], value)

    def publish(self, slot: int, dev: int, *, launches: int = 0, wait_ns: int = 0,
                tokens: int = 0, last_launch_ns: int = 0) -> None:
        """What a thread of the process in `slot` publishes, as the shim does: its counts
        added to the slot's and to the device's cumulative totals in the header."""
        slot_base = (layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
                     + layout.SLOT_OFFSETS["devices"] + dev * layout.PROC_DEVICE_SIZE)
        total_base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for field, value in (("launches", launches), ("wait_ns", wait_ns),
                             ("tokens_spent", tokens)):
            self._add(slot_base + layout.PROC_DEVICE_OFFSETS[field], value)
            self._add(total_base + layout.STATE_DEVICE_OFFSETS[field], value)
        if last_launch_ns:
            store_words(self._map, slot_base + layout.PROC_DEVICE_OFFSETS["last_launch_ns"],
                        last_launch_ns)

    def _add(self, at: int, value: int) -> None:
        store_words(self._map, at, layout.load_u64(self._map, at) + value)

    def reclaim(self, slot: int) -> None:
        """The slot of a process that ended, reclaimed as the shim does: its counters zeroed
        (the device totals keep them) and its pid cleared last."""
        base = layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
        devices = base + layout.SLOT_OFFSETS["devices"]
        for dev in range(layout.MAX_DEVICES):
            dev_base = devices + dev * layout.PROC_DEVICE_SIZE
            for field in ("launches", "tokens_spent", "wait_ns", "last_launch_ns"):
                store_words(self._map, dev_base + layout.PROC_DEVICE_OFFSETS[field], 0)
        store_words(self._map, base + layout.SLOT_OFFSETS["start_time"], 0)
        store_words(self._map, base + layout.SLOT_OFFSETS["host_pid"], 0)
        store_words(self._map, base + layout.SLOT_OFFSETS["pid"], 0)

    def device_totals(self, dev: int, *, memory: int, tokens: int = 0) -> None:
        base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        o = layout.STATE_DEVICE_OFFSETS
        store_words(self._map, base + o["memory_used"], memory)
        store_words(self._map, base + o["tokens_spent"], tokens)

    def memory_kinds(
        self, dev: int, *, context: int = 0, module: int = 0, pool: int = 0, spilled: int = 0
    ) -> None:
        """How much of the device's total is of each kind (the ABI 1.1 extension); `spilled` is
        the part of the data served by managed memory."""
        base = layout.STATE_OFFSETS["ext"] + dev * layout.STATE_EXT_DEVICE_SIZE
        o = layout.STATE_EXT_DEVICE_OFFSETS
        for field, value in (("memory_context", context), ("memory_module", module),
                             ("memory_pool", pool), ("memory_spilled", spilled)):
            store_words(self._map, base + o[field], value)

    def graphs_unpriced(self, dev: int, count: int) -> None:
        """Executable graphs the shim priced at the graph_cost floor (the ABI 1.1 extension)."""
        base = layout.STATE_OFFSETS["ext"] + dev * layout.STATE_EXT_DEVICE_SIZE
        store_words(self._map, base + layout.STATE_EXT_DEVICE_OFFSETS["graphs_unpriced"], count)

    def scribble_header(self) -> None:
        """What a buggy or hostile process in the container could do to the file."""
        self._map[0:16] = b"\xde\xad\xbe\xef" * 4


class FileRegion:
    """A read-only `RegionHandle` over one region directory."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._control = layout.decode_control((directory / "control").read_bytes())

    @property
    def alloc_id(self) -> str:
        return self.directory.name

    @property
    def closed(self) -> bool:
        return False  # read-only: nothing collects it

    @property
    def seq(self) -> int:
        return self._control.seq

    @property
    def priority(self) -> int:
        return self._control.priority

    @property
    def device_ids(self) -> tuple[str, ...]:
        return self._control.device_ids

    @property
    def device_uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self._control.devices)

    def memory_limit(self, dev: int) -> int:
        return self._control.devices[dev].memory_limit

    def core_limit(self, dev: int) -> float:
        return self._control.devices[dev].core_limit * 100 / layout.CORE_LIMIT_FULL

    def policy(self, dev: int) -> CorePolicy:
        name = layout.POLICY_NAMES[self._control.devices[dev].policy]
        assert name in POLICY_CODES
        return name  # type: ignore[return-value]

    def rate(self, dev: int) -> tuple[int, int]:
        d = self._control.devices[dev]
        return d.rate, d.burst

    def usage(self) -> RegionUsage:
        with open(self.directory / "state", "rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
            try:
                return layout.decode_state(data, len(self._control.devices))
            finally:
                data.close()

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        raise NotImplementedError("read-only stand-in")

    def beat(self, now_ns: int) -> None:
        raise NotImplementedError("read-only stand-in")


def put_totals(region_dir: Path, dev: int, spent: int, launches: int, waited: int) -> None:
    """Write one device's header totals into a region's `state`, as the shim keeps them."""
    with open(region_dir / "state", "r+b") as f:
        base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for name, value in (("tokens_spent", spent), ("launches", launches), ("wait_ns", waited)):
            f.seek(base + layout.STATE_DEVICE_OFFSETS[name])
            f.write(struct.pack("<Q", value))

"""The interface between allocation regions and the code that steers or reports them.

`regions.py` implements it on mmap'd files; the throttle controller and the metrics collectors
code against it, and tests can hand them in-memory stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

CorePolicy = Literal["off", "strict", "work-conserving"]
CORE_POLICIES: tuple[CorePolicy, ...] = ("off", "strict", "work-conserving")


@dataclass(frozen=True)
class ProcessUsage:
    """One live process slot of a region, as read (and bounds-checked) from its `state` file."""

    pid: int
    host_pid: int  # 0 when the shim could not learn it
    memory_used: tuple[int, ...]  # bytes, per region device
    launches: tuple[int, ...]
    tokens_spent: tuple[int, ...]
    wait_ns: tuple[int, ...]
    last_launch_ns: tuple[int, ...]  # CLOCK_MONOTONIC ns, 0 = never
    # clock ticks since boot (/proc/<pid>/stat field 22): the same in every pid namespace, so
    # with the in-container pid it identifies the process from the host's /proc
    start_time: int = 0


@dataclass(frozen=True)
class RegionUsage:
    """What the shim reports for one allocation; totals are per region device."""

    processes: tuple[ProcessUsage, ...] = ()
    memory_used: tuple[int, ...] = ()  # the shim's accounted total per device
    tokens_spent: tuple[int, ...] = ()  # cumulative, may drop when dead slots are reclaimed
    skipped_records: int = 0  # nonsense values found and ignored while reading
    corrupt: bool = False  # the header itself was unreadable: all of the above are empty
    bucket_balance: tuple[int, ...] = field(default_factory=tuple)
    # the shim's cumulative device totals (ended processes included); empty when the reader has
    # none, and then the slots' sums stand in
    launches: tuple[int, ...] = ()
    wait_ns: tuple[int, ...] = ()
    # ABI 1.1: how much of memory_used is of each kind, per device (zeros for a 1.0 file, whose
    # memory is all counted as data); data is what remains of memory_used
    memory_context: tuple[int, ...] = ()
    memory_module: tuple[int, ...] = ()
    memory_pool: tuple[int, ...] = ()
    # of the data: bytes served by managed memory because the card was full (spilled), <= data
    memory_spilled: tuple[int, ...] = ()
    graphs_unpriced: tuple[int, ...] = ()  # executable graphs charged the fallback, cumulative
    extension: bool = False  # the file carries the 1.1 extension

    def memory_data(self, dev: int) -> int:
        """Bytes of plain allocations on device `dev`: the total less the other kinds, >= 0."""
        others = sum(kind[dev] for kind in self.memory_kinds_other() if dev < len(kind))
        return max(0, self.memory_used[dev] - others)

    def memory_kinds_other(self) -> tuple[tuple[int, ...], ...]:
        return (self.memory_context, self.memory_module, self.memory_pool)


class RegionHandle(Protocol):
    """One allocation's region, as the controller and the metrics see it."""

    @property
    def alloc_id(self) -> str: ...

    @property
    def seq(self) -> int:
        """Creation order: a later allocation of the same device IDs has a larger seq."""

    @property
    def priority(self) -> int: ...

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The kubelet device IDs (`<uuid>::<n>`) the allocation was made for."""

    @property
    def device_uuids(self) -> tuple[str, ...]:
        """Physical GPU UUIDs in the order the container sees them."""

    def memory_limit(self, dev: int) -> int: ...

    def core_limit(self, dev: int) -> float:
        """Percent of the GPU's SM time, 0 < x <= 100."""

    def policy(self, dev: int) -> CorePolicy: ...

    def rate(self, dev: int) -> tuple[int, int]:
        """The (refill rate tokens/s, burst tokens) currently written for the device."""

    def usage(self) -> RegionUsage: ...

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        """Store the new token rate and burst (aligned 64-bit stores) and bump the generation."""

    def beat(self, now_ns: int) -> None:
        """Refresh the agent heartbeat (CLOCK_MONOTONIC ns)."""

    @property
    def closed(self) -> bool:
        """The store collected it (its container is gone): it reads as nothing, and a reader
        that finds it closed part-way skips it rather than counting an error."""

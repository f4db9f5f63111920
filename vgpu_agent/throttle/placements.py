"""Where a time-sliced GPU's processes were placed, kept between the periods they are given.

A time-sliced driver names one process a sample period (`timesliced.read_as_periods`), so each
process on a crowded GPU is named only now and then: of 18 containers' processes, each about
once in 18 periods. The controller forgets a placement SHARED_PERIODS periods after the process
was last named, and placing it afresh on host evidence (`identity.Attributor`: its mount table,
every region's mark and claims on the GPU, the slots read at most once a second per GPU) cost a
time-sliced node of 144 container-devices more CPU than all its steering
(`bench_scrape.py --time-sliced`, BENCHMARKS.md).

`HeldPlacements` keeps a placement for `hold_s` after the process was last named, and gives it
back when the same process is named again: the same pid with the same start time (field 22 of
its `stat`, read afresh each time it is given back), so that a pid the kernel reused for
another process, maybe another container's, is placed afresh on host evidence, never charged
to the container of the process that had it before. A process whose start time cannot be read
is not kept.

Pure but for the `start_time` it is given (the controller's reads the host's /proc).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

PLACED_HOLD_S = 60.0  # as long as a GPU is read as per-process after its last shared period
PLACED_MOST = 4096  # per GPU: a GPU naming more processes than this in `hold_s` starts over


class HeldPlacements:
    """Per GPU: host pid -> (alloc_id, start time, when it was last named, in NVML's us)."""

    __slots__ = ("held", "hold_us", "most", "start_time")

    def __init__(self, start_time: Callable[[int], int | None], hold_s: float = PLACED_HOLD_S,
                 most: int = PLACED_MOST) -> None:
        if not 0 < hold_s <= 3600:
            raise ValueError(f"a placement's hold must be in (0, 3600] s, got {hold_s!r}")
        if not (type(most) is int and most >= 1):
            raise ValueError(f"placements held per GPU must be an int >= 1, got {most!r}")
        self.start_time = start_time
        self.hold_us = round(hold_s * 1e6)
        self.most = most
        self.held: dict[str, dict[int, tuple[str, int, int]]] = {}

    def keep(self, uuid: str, pid: int, alloc_id: str, now_us: int) -> None:
        """`pid` was placed in `alloc_id` on host evidence (named at `now_us`)."""
        start = self.start_time(pid)
        on_gpu = self.held.setdefault(uuid, {})
        if start is None:
            on_gpu.pop(pid, None)
            return
        if len(on_gpu) >= self.most and pid not in on_gpu:
            on_gpu.clear()
        on_gpu[pid] = (alloc_id, start, now_us)

    def named(self, uuid: str, pid: int, now_us: int) -> None:
        """`pid`, placed lately, was named again: its hold starts over."""
        on_gpu = self.held.get(uuid)
        entry = on_gpu.get(pid) if on_gpu is not None else None
        if on_gpu is not None and entry is not None:
            on_gpu[pid] = (entry[0], entry[1], now_us)

    def take(self, uuid: str, pid: int, now_us: int) -> str | None:
        """The container `pid` was placed in, where it is held and is still the process that
        was placed (named again at `now_us`); None otherwise (and its entry dropped)."""
        on_gpu = self.held.get(uuid)
        entry = on_gpu.pop(pid, None) if on_gpu is not None else None
        if on_gpu is None or entry is None:
            return None
        alloc_id, start, last_us = entry
        if now_us - last_us > self.hold_us or self.start_time(pid) != start:
            return None
        on_gpu[pid] = (alloc_id, start, now_us)
        return alloc_id

    def prune(self, uuid: str, now_us: int, present: Collection[str] | None = None) -> None:
        """Drops the GPU's placements not named within the hold, and those of containers no
        longer on it (`present`: the alloc_ids with a device there; None: all kept)."""
        on_gpu = self.held.get(uuid)
        if not on_gpu:
            return
        hold_us = self.hold_us
        # (asked at every sampled tick of a time-sliced GPU, where mostly nothing is dropped)
        gone = [pid for pid, entry in on_gpu.items() if now_us - entry[2] > hold_us
                or (present is not None and entry[0] not in present)]
        for pid in gone:
            del on_gpu[pid]

    def forget(self, uuid: str) -> None:
        self.held.pop(uuid, None)

"""Which containers started spilling GPU memory to host memory, each told once. Pure.

The shim counts, per region device, the bytes it served from managed memory because the card was
full (`RegionUsage.memory_spilled`). A container is reported the first time any of its devices
shows spilled bytes while its region is bound to a container (so the report can name it); a
region not yet bound is looked at again next time. Values come from a file the container writes:
only plausible ones (at most the device's limit) count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vgpu_agent.shm.api import RegionUsage

ContainerKey = tuple[str, str, str]  # namespace, pod, container


@dataclass(frozen=True)
class SpillSeen:
    """A region device with spilled bytes: which GPU, how much, against which limit."""

    dev: int
    gpu_uuid: str
    spilled_bytes: int
    limit_bytes: int


@dataclass(frozen=True)
class SpillNotice:
    """A container to tell about its spilling, once."""

    alloc_id: str
    container: ContainerKey
    devices: tuple[SpillSeen, ...]


class SpillReports:
    """Remembers the regions already reported; `forget` drops regions that are gone."""

    def __init__(self) -> None:
        self._reported: set[str] = set()

    def observe(
        self,
        alloc_id: str,
        container: ContainerKey | None,
        usage: RegionUsage,
        uuids: Sequence[str],
        limits: Sequence[int],
    ) -> SpillNotice | None:
        if alloc_id in self._reported or container is None or usage.corrupt:
            return None
        seen = []
        for dev, spilled in enumerate(usage.memory_spilled):
            if dev >= len(uuids) or dev >= len(limits):
                break
            limit = limits[dev]
            if spilled <= 0 or (limit > 0 and spilled > limit):
                continue  # nothing spilled, or a value no shim could have written
            seen.append(SpillSeen(dev, uuids[dev], spilled, limit))
        if not seen:
            return None
        self._reported.add(alloc_id)
        return SpillNotice(alloc_id, container, tuple(seen))

    def forget(self, live: Iterable[str]) -> None:
        self._reported &= set(live)

    def __len__(self) -> int:
        return len(self._reported)

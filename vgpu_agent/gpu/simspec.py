"""The simulated GPU inventory spec, e.g. `2xA100-80GB,1xL4-24GB`. Pure: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPECTED_FORM = "[<count>x]<model>-<memory>GB, comma-separated, e.g. 2xA100-80GB,1xL4-24GB"
MAX_GPUS = 256  # far above any real node; stops a typo from building a huge inventory

_PART = re.compile(
    r"^(?:(?P<count>\d+)x)?(?P<model>[A-Za-z0-9][A-Za-z0-9_.-]*?)-(?P<mem>\d+)GB$", re.IGNORECASE
)


@dataclass(frozen=True)
class SimGpuSpec:
    """`count` simulated GPUs of one model with `memory_gib` GiB each."""

    count: int
    model: str
    memory_gib: int


def parse_sim_spec(spec: str) -> list[SimGpuSpec]:
    """Parse an inventory spec; ValueError names the bad part and the expected form."""
    if not spec.strip():
        raise ValueError(f"simulated GPU inventory is empty; expected {EXPECTED_FORM}")
    out: list[SimGpuSpec] = []
    for raw in spec.split(","):
        part = raw.strip()
        match = _PART.match(part)
        if match is None:
            raise ValueError(f"bad simulated GPU entry {part!r}; expected {EXPECTED_FORM}")
        count = int(match["count"]) if match["count"] is not None else 1
        memory = int(match["mem"])
        if count < 1:
            raise ValueError(f"bad simulated GPU entry {part!r}: count must be >= 1")
        if memory < 1:
            raise ValueError(f"bad simulated GPU entry {part!r}: memory must be >= 1 GB")
        out.append(SimGpuSpec(count=count, model=match["model"], memory_gib=memory))
    total = sum(s.count for s in out)
    if total > MAX_GPUS:
        raise ValueError(f"simulated GPU inventory {spec!r} has {total} GPUs; at most {MAX_GPUS}")
    return out

"""How much memory the host gives its pods: /proc/meminfo, lowered by the pods' cgroup limit.

Spilled GPU memory is host memory charged to each container's own memory cgroup; all pods
together live under the kubelet's `kubepods` cgroup, whose limit (when set) is what they can
use at most. The smaller of the two is the host memory spilling is measured against.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# cgroup v2 (systemd and cgroupfs drivers) and v1 places of the pods' limit, under cgroup_root.
_POD_LIMIT_FILES = (
    "kubepods.slice/memory.max",
    "kubepods/memory.max",
    "memory/kubepods.slice/memory.limit_in_bytes",
    "memory/kubepods/memory.limit_in_bytes",
)


def meminfo_total(proc_dir: str | Path = "/proc") -> int:
    """MemTotal in bytes; 0 when the file cannot be read or has no such line."""
    try:
        text = (Path(proc_dir) / "meminfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemTotal":
            parts = rest.split()
            if parts and parts[0].isdigit():
                unit = parts[1].lower() if len(parts) > 1 else ""
                return int(parts[0]) * (1024 if unit == "kb" else 1)
    return 0


def pods_cgroup_limit(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """The pods' memory limit in bytes, or 0 when none is set or none can be read."""
    for name in _POD_LIMIT_FILES:
        with contextlib.suppress(OSError, ValueError):
            text = (Path(cgroup_root) / name).read_text(encoding="ascii").strip()
            if text == "max":
                return 0
            value = int(text)
            # cgroup v1 writes "no limit" as a huge page-rounded number
            return value if 0 < value < 1 << 60 else 0
    return 0


def host_memory(proc_dir: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """Bytes of memory the node's pods can use: MemTotal, or the pods' limit when smaller."""
    total = meminfo_total(proc_dir)
    limit = pods_cgroup_limit(cgroup_root)
    found = min(v for v in (total, limit) if v > 0) if total > 0 or limit > 0 else 0
    log.debug("host_memory", meminfo_total=total, pods_limit=limit, bytes=found)
    return found

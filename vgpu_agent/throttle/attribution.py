"""Which container a GPU process belongs to: decided from host evidence, never from `state` alone.

Pure: no I/O. NVML names processes by host PID; a container's `state` slots *claim* PIDs (a host
pid, or an in-container pid and start time), but a container can write anything there. So a
process is attributed to a region only on evidence read from the host (`hostproc.ProcEvidence`:
the process's own mount table shows that region's `control` file mounted at the container's
region path, with the device of the agent's file). Claims only serve to notice lies: a claim
on a sampled process that the host places elsewhere is rejected and counted for the claiming
region. Two containers whose processes share an in-container pid and start time (every
container's pid 1, started in the same second) stay apart, because the claim never decides.

A process the host tells nothing about (it ended before it could be examined) is left
unattributed for the tick. Whoever holds a proven process may vouch for its cgroup siblings
(the controller's fallback); a claim never does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

# `HostEvidence.owner` results besides an alloc_id.
NONE_OF_THEM = ""  # examined: the process shows none of the regions (a host process, a stranger)
# None: nothing could be read (the process is gone, or /proc denies it)



class Mark(NamedTuple):
    """What a process's mount of a region's `control` must show, per alloc_id."""

    dev: int  # st_dev of the file as the agent sees it
    fs_path: str | None  # its path inside that filesystem; None when the agent cannot tell


# None: the agent could not stat the file; such a region can be proven by nobody.
RegionMarks = Mapping[str, Mark | None]


class HostEvidence(Protocol):
    def owner(self, host_pid: int, marks: RegionMarks) -> str | None:
        """The alloc_id the host proves `host_pid` belongs to, NONE_OF_THEM, or None (unknown)."""

    def forget_except(self, live: Iterable[int]) -> None:
        """Drop what was learned of pids that are no longer sampled (their numbers get reused)."""


@dataclass(frozen=True)
class Claims:
    """What one region's `state` slots say about its processes, as read this tick."""

    host_pids: frozenset[int] = frozenset()
    namespaced: frozenset[tuple[int, int]] = frozenset()  # (in-container pid, start time)


@dataclass(frozen=True)
class Attribution:
    owner: dict[int, str]  # host pid -> alloc_id, proven by the host
    rejected: frozenset[tuple[str, int]] = field(default_factory=frozenset)  # (alloc_id, pid)
    unknown: tuple[int, ...] = ()  # sampled pids the host told nothing about


def attribute(
    pids: Iterable[int],
    proofs: Mapping[int, str | None],
    claims: Mapping[str, Claims],
    identities: Mapping[int, tuple[int, int] | None],
) -> Attribution:
    """Owners of the sampled `pids`, and the claims the host contradicts.

    `proofs[pid]` is `HostEvidence.owner`'s answer, `identities[pid]` the process's (pid in its
    innermost namespace, start time) from the host's /proc, None when unreadable. A claim by
    host pid is rejected when the host proves that pid elsewhere; a claim by (pid, start time)
    is rejected when sampled processes carry that identity and none of them is the claimant's
    (so identical identities in two containers are no lie). Claims on processes the host told
    nothing about are neither accepted nor rejected.
    """
    owner: dict[int, str] = {}
    unknown: list[int] = []
    by_identity: dict[tuple[int, int], list[int]] = {}
    sampled = list(dict.fromkeys(pids))
    for pid in sampled:
        proof = proofs.get(pid)
        if proof is None:
            unknown.append(pid)
            continue
        if proof:
            owner[pid] = proof
        ident = identities.get(pid)
        if ident is not None:
            by_identity.setdefault(ident, []).append(pid)
    examined = {pid for pid in sampled if proofs.get(pid) is not None}
    rejected: set[tuple[str, int]] = set()
    for alloc_id, claim in claims.items():
        for pid in claim.host_pids:
            if pid in examined and owner.get(pid) != alloc_id:
                rejected.add((alloc_id, pid))
        for ident in claim.namespaced:
            holders = by_identity.get(ident)
            if holders and all(owner.get(pid) != alloc_id for pid in holders):
                rejected.update((alloc_id, pid) for pid in holders)
    return Attribution(owner, frozenset(rejected), tuple(unknown))


def claims_of(processes: Iterable[tuple[int, int, int]]) -> Claims:
    """Claims from (pid, host_pid, start_time) of a region's slots."""
    host: set[int] = set()
    namespaced: set[tuple[int, int]] = set()
    for pid, host_pid, start_time in processes:
        if host_pid > 0:
            host.add(host_pid)
        elif start_time > 0:
            namespaced.add((pid, start_time))
    return Claims(frozenset(host), frozenset(namespaced))


# ------------------------------------------------------------------ /proc/<pid>/mountinfo


@dataclass(frozen=True)
class Mount:
    """One line of /proc/<pid>/mountinfo: the fields attribution needs."""

    dev: int  # os.makedev(major, minor)
    root: str  # the mounted path inside its filesystem
    mount_point: str  # where the process sees it


MAX_MOUNTINFO_LINES = 4096  # a container has tens; more is not a mount table worth reading


def _unescape(field_text: str) -> str:
    # The kernel writes space, tab, newline and backslash as \ooo octal escapes.
    if "\\" not in field_text:
        return field_text
    out: list[str] = []
    i = 0
    while i < len(field_text):
        ch = field_text[i]
        octal = field_text[i + 1 : i + 4]
        if ch == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The lines of a mountinfo file; malformed lines are skipped, at most MAX_MOUNTINFO_LINES."""
    mounts: list[Mount] = []
    for line in text.split("\n", MAX_MOUNTINFO_LINES)[:MAX_MOUNTINFO_LINES]:
        fields = line.split(" ", 6)
        if len(fields) < 6:
            continue
        major, sep, minor = fields[2].partition(":")
        if not sep or not major.isdigit() or not minor.isdigit():
            continue
        if len(major) > 10 or len(minor) > 10:
            continue
        mounts.append(Mount(os.makedev(int(major), int(minor)), _unescape(fields[3]),
                            _unescape(fields[4])))
    return mounts


def control_mount(mounts: Iterable[Mount], control_path: str) -> Mount | None:
    """The mount in force at `control_path` (the last one on the path), if any."""
    found: Mount | None = None
    for mount in mounts:
        if mount.mount_point == control_path:
            found = mount
    return found


def proven_region(seen: Mount | None, marks: RegionMarks) -> str:
    """The region a process's control mount proves, NONE_OF_THEM when it proves none of `marks`.

    The mount must be of the region's own `control`: its root (the path inside its filesystem)
    is exactly the file's, on the device the agent's file is on. A process can mount only what
    it can see, no container sees another's region, and nobody but the agent can create a file
    at that path. A mark without a known path is matched on its last two components
    (`<alloc_id>/control`) and the device alone.
    """
    if seen is None:
        return NONE_OF_THEM
    parts = seen.root.rsplit("/", 2)
    if len(parts) != 3 or parts[2] != "control":
        return NONE_OF_THEM
    alloc_id = parts[1]
    mark = marks.get(alloc_id)
    if mark is None or mark.dev != seen.dev:
        return NONE_OF_THEM
    if mark.fs_path is not None and mark.fs_path != seen.root:
        return NONE_OF_THEM
    return alloc_id


def path_in_filesystem(path: str, dev: int, own_mounts: Sequence[Mount]) -> str | None:
    """Where `path` (as this process sees it, on device `dev`) lies inside its filesystem, which
    is what another mount namespace's mountinfo shows as a bind mount's root; None when no
    mount of `dev` contains it."""
    best: Mount | None = None
    for mount in own_mounts:
        point = mount.mount_point.rstrip("/") or "/"
        inside = point == "/" or path == point or path.startswith(point + "/")
        if mount.dev == dev and inside and (
            best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")
        ):
            best = mount
    if best is None:
        return None
    point = best.mount_point.rstrip("/") or "/"
    rest = path[len(point):] if point != "/" else path
    root = best.root.rstrip("/")
    return f"{root}/{rest.lstrip('/')}" if rest.strip("/") else (best.root or "/")

"""Host evidence for `attribution`: the host's /proc, read for the processes NVML reports.

`ProcEvidence` reads `/proc/<pid>/mountinfo` (world-readable: the agent needs no capability,
unlike `/proc/<pid>/root`, which needs ptrace access). The kernel writes that table; a
container cannot change what it says about the mounts the runtime made for it.
`Attributor` joins the evidence with the regions' claims once per GPU and tick, keeps the
per-region count of rejected claims, and logs each rejection once. Where a process's mount table
proves nothing, `NamespacePidResolver` matches its pid inside its namespace and start time with
a shim slot, and `CgroupPidResolver` places it beside a proven process of the same cgroup.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import structlog

from vgpu_agent.shm.api import RegionHandle, RegionUsage
from vgpu_agent.throttle.attribution import (
    HostEvidence,
    Mark,
    Mount,
    RegionMarks,
    attribute,
    claims_of,
    control_mount,
    parse_mountinfo,
    path_in_filesystem,
    proven_region,
)

log = structlog.get_logger(__name__)

MOUNTINFO_MAX_BYTES = 256 * 1024  # a container's table is a few KiB; more is not read


class ProcEvidence:
    """Proves a host pid's region from its mount table under the host's /proc."""

    def __init__(self, proc_root: str = "/proc", container_region_dir: str = "/run/vgpu",
                 own_mountinfo: str = "/proc/self/mountinfo"):
        self.proc_root = proc_root
        self.control_path = f"{container_region_dir.rstrip('/')}/control"
        self.own_mountinfo = own_mountinfo
        self._own_mounts: list[Mount] | None = None
        self._located: dict[tuple[str, int], str | None] = {}
        # host pid -> the control mount its table shows (None: none); mounts do not change
        self._seen: dict[int, Mount | None] = {}
        self.reads = 0  # mount tables read (for the tests of per-tick work)

    def owner(self, host_pid: int, marks: RegionMarks) -> str | None:
        if host_pid in self._seen:
            return proven_region(self._seen[host_pid], marks)
        text = self._mountinfo(host_pid)
        if text is None:
            return None
        seen = self._seen[host_pid] = control_mount(parse_mountinfo(text), self.control_path)
        return proven_region(seen, marks)

    def forget_except(self, live: Iterable[int]) -> None:
        keep = set(live)
        self._seen = {pid: v for pid, v in self._seen.items() if pid in keep}

    def locate(self, path: str, dev: int) -> str | None:
        """`path` (as the agent sees it) inside its filesystem: what a container's mount table
        shows as the root of its bind mount. From the agent's own mount table, read once."""
        key = (path, dev)
        if key in self._located:
            return self._located[key]
        if self._own_mounts is None:
            try:
                with open(self.own_mountinfo, encoding="utf-8", errors="replace") as f:
                    self._own_mounts = parse_mountinfo(f.read(MOUNTINFO_MAX_BYTES))
            except OSError as err:
                log.warning("identity_own_mounts_unreadable", path=self.own_mountinfo,
                            error=str(err))
                self._own_mounts = []
        found = path_in_filesystem(os.path.realpath(path), dev, self._own_mounts)
        if found is None:
            log.warning("identity_path_unknown", path=path,
                        effect="its mounts are matched on region name and device only")
        if len(self._located) > 65536:
            self._located.clear()
        self._located[key] = found
        return found

    def _mountinfo(self, host_pid: int) -> str | None:
        if host_pid <= 0:
            return None
        path = os.path.join(self.proc_root, str(host_pid), "mountinfo")
        self.reads += 1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            data = os.read(fd, MOUNTINFO_MAX_BYTES)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data.decode("utf-8", "replace")


class NsIdentity(Protocol):
    def identity(self, host_pid: int) -> tuple[int, int] | None: ...


class CgroupFallback(Protocol):
    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None: ...


class Attributor:
    """Attributes one GPU's sampled pids to regions, and counts the claims the host refutes."""

    def __init__(
        self,
        evidence: HostEvidence,
        identities: NsIdentity,
        fallback: CgroupFallback | None = None,
        on_error: Callable[[int], None] | None = None,
        budget_slots: bool = True,
    ):
        self.evidence = evidence
        self.identities = identities
        self.fallback = fallback
        self.on_error = on_error
        self.budget_slots = budget_slots  # size regions' slot reads (the controller's own)
        self.rejected: dict[str, int] = {}  # alloc_id -> distinct (claim, pid) refused
        self.rejected_total = 0  # monotonic, regions gone included
        self._reported: set[tuple[str, int]] = set()
        self._proven: dict[str, set[int]] = {}  # this tick's proven pids, per alloc_id

    def owners(
        self, regions: Iterable[tuple[RegionHandle, RegionUsage]], pids: Iterable[int]
    ) -> dict[int, str]:
        """host pid -> alloc_id for the sampled `pids` of one GPU (its regions as read)."""
        marks: dict[str, Mark | None] = {}
        claims = {}
        for region, usage in regions:
            alloc_id = region.alloc_id
            if alloc_id in marks:
                continue
            marks[alloc_id] = self._mark(region)
            claims[alloc_id] = claims_of(
                (p.pid, p.host_pid, p.start_time) for p in usage.processes
            )
        sampled = list(pids)
        proofs = {pid: self.evidence.owner(pid, marks) for pid in sampled}
        needs_identity = any(c.namespaced for c in claims.values())
        identities = (
            {pid: self.identities.identity(pid) for pid in sampled if proofs[pid] is not None}
            if needs_identity else {}
        )
        result = attribute(sampled, proofs, claims, identities)
        for alloc_id, pid in result.rejected - self._reported:
            self._reported.add((alloc_id, pid))
            self.rejected[alloc_id] = self.rejected.get(alloc_id, 0) + 1
            self.rejected_total += 1
            log.warning("identity_rejected", alloc_id=alloc_id, pid=pid,
                        proven_owner=proofs.get(pid) or None,
                        reason="the region's state claims a process the host places elsewhere")
        owner = dict(result.owner)
        if self.budget_slots:
            for pid, alloc_id in owner.items():
                self._proven.setdefault(alloc_id, set()).add(pid)
        if self.fallback is not None and result.unknown and owner:
            # A process the host could not show (yet) shares a cgroup with a proven one.
            for pid in result.unknown:
                try:
                    found = self.fallback(pid, owner)
                except Exception:
                    if self.on_error is not None:
                        self.on_error(pid)
                    found = None
                if found is not None and found in marks:
                    owner[pid] = found
        return owner

    def _mark(self, region: RegionHandle) -> Mark | None:
        dev = getattr(region, "control_dev", None)
        if not isinstance(dev, int):
            return None
        path = getattr(region, "path", None)
        locate = getattr(self.evidence, "locate", None)
        fs_path = locate(os.path.join(str(path), "control"), dev) if (
            locate is not None and path is not None) else None
        return Mark(dev, fs_path)

    def end_tick(self, live: Iterable[int], regions: Iterable[RegionHandle],
                 placed: Mapping[str, int] | None = None) -> None:
        """After a tick with samples: size each region's next `state` read by the processes the
        host proved for it (`placed`, per alloc_id, when the caller keeps its placements, else
        those proven this tick; `Region.limit_slots`), and forget pids no longer sampled."""
        proven, self._proven = self._proven, {}
        counts = dict(placed) if placed is not None else {a: len(p) for a, p in proven.items()}
        names = []
        for region in regions:
            try:
                alloc_id = region.alloc_id
            except Exception:
                continue
            names.append(alloc_id)
            limit = getattr(region, "limit_slots", None)
            if limit is not None:
                limit(counts.get(alloc_id, 0))
        self.forget_except(live, names)

    def forget_except(self, live: Iterable[int], regions: Iterable[str]) -> None:
        keep = set(live)
        self.evidence.forget_except(keep)
        present = set(regions)
        self._reported = {(a, p) for a, p in self._reported if p in keep and a in present}
        if any(a not in present for a in self.rejected):
            self.rejected = {a: n for a, n in self.rejected.items() if a in present}


class PidResolver(Protocol):
    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None:
        """The alloc_id of host `pid`, given the host PIDs already known per allocation."""


class CgroupPidResolver:
    """Assigns an unknown host PID to the allocation whose known processes share its cgroup.

    The shim cannot always learn its host PID (no access to the host's PID namespace); a sibling
    process that did tells us which container cgroup is the allocation's.
    """

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root

    def cgroup_of(self, pid: int) -> str | None:
        try:
            # (a container may name the cgroups it makes with any bytes: kept as they are, so
            # that two names never compare alike)
            with open(os.path.join(self.proc_root, str(pid), "cgroup"), encoding="utf-8",
                      errors="surrogateescape") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        # cgroup v2 has one "0::<path>" line; with v1, any controller's path names the container.
        paths = sorted(line.split(":", 2)[2] for line in lines if line.count(":") >= 2)
        paths = [p for p in paths if p not in ("", "/")]
        return "\n".join(paths) or None

    def __call__(self, pid: int, known: Mapping[int, str]) -> str | None:
        wanted = self.cgroup_of(pid)
        if wanted is None:
            return None
        for other, alloc_id in known.items():
            if self.cgroup_of(other) == wanted:
                return alloc_id
        return None


class NamespacePidResolver:
    """Maps a host PID to the allocation whose shim slot holds the same process.

    Inside a container the shim sees only its own pid namespace, so its slots carry the
    in-container pid and the process start time, rarely the host pid. The host's /proc tells,
    for a host pid, the pid in its innermost namespace (last `NSpid` field) and the same start
    time (`stat` field 22): the pair names the slot. Needs the host's /proc (hostPID, or the
    host's /proc mounted and `proc_root` pointing at it).
    """

    def __init__(self, proc_root: str = "/proc"):
        self.proc_root = proc_root
        self._seen: dict[int, tuple[int, int] | None] = {}

    def identity(self, host_pid: int) -> tuple[int, int] | None:
        """(pid in its innermost namespace, start time) of a host pid, None if unreadable."""
        if host_pid in self._seen:
            return self._seen[host_pid]
        found: tuple[int, int] | None = None
        base = os.path.join(self.proc_root, str(host_pid))
        try:
            # (the command name, in both, is the container's to set, to any bytes: not decoded
            # strictly, or a process named so would have no identity to refute claims by)
            with open(os.path.join(base, "status"), encoding="utf-8", errors="replace") as f:
                nspid = next((ln for ln in f if ln.startswith("NSpid:")), "")
            with open(os.path.join(base, "stat"), encoding="utf-8", errors="replace") as f:
                stat = f.read()
            inner = int(nspid.split()[-1])
            found = (inner, _start_time(stat))
        except (OSError, ValueError, IndexError, StopIteration, UnicodeDecodeError):
            found = None
        self._seen[host_pid] = found
        return found

    def start_time(self, host_pid: int) -> int | None:
        """A host pid's start time (`stat` field 22), read afresh; None if unreadable. The
        same pid with another start time is another process."""
        if host_pid <= 0:
            return None
        # Read without a text file object: asked for every held process named again, which on
        # a time-sliced GPU is once a sample period (a third of the cost of `open`).
        try:
            fd = os.open(os.path.join(self.proc_root, str(host_pid), "stat"),
                         os.O_RDONLY | os.O_CLOEXEC)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
            # (the command name is the container's to set, to any bytes: not decoded strictly,
            # or a process named so could not be held on a time-sliced GPU)
            return _start_time(stat.decode("utf-8", "replace"))
        except (OSError, ValueError, IndexError):
            return None

    def forget_except(self, live: Iterable[int]) -> None:
        """Drop cached pids that stopped appearing in samples (their numbers may be reused)."""
        keep = set(live)
        self._seen = {pid: v for pid, v in self._seen.items() if pid in keep}

    def resolve(self, host_pid: int, slots: Mapping[tuple[int, int], str]) -> str | None:
        ident = self.identity(host_pid)
        return slots.get(ident) if ident is not None else None


def _start_time(stat: str) -> int:
    """Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) may hold spaces and
    parentheses: the fields are counted after its last ')'."""
    return int(stat.rsplit(")", 1)[1].split()[19])

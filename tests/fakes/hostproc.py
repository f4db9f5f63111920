"""A fake host /proc: per host pid the files the agent reads, as the kernel writes them.

`status` (NSpid), `stat` (start time, field 22), `cgroup`, and `mountinfo`: a container's mount
table shows its region's `control` bind-mounted at the container's region path, with the real
device number of the agent's file and the path inside that filesystem, the way the runtime's
bind mount appears. The agent never learns these from the container, so nothing here is written
by the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path

CONTAINER_REGION_DIR = "/run/vgpu"

_BASE_MOUNTS = (
    "1201 1100 0:310 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/l,upperdir=/u\n"
    "1202 1201 0:312 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "1203 1201 0:313 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755\n"
)


def _escape(path: str) -> str:
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def mount_line(mount_id: int, dev: int, root: str, mount_point: str, fstype: str = "ext4") -> str:
    return (f"{mount_id} 1201 {os.major(dev)}:{os.minor(dev)} {_escape(root)} "
            f"{_escape(mount_point)} ro,relatime - {fstype} /dev/sda1 rw\n")


def in_filesystem(path: Path) -> str:
    """`path` inside its filesystem, as a bind mount's root shows it in another namespace: the
    kernel computes it; here it is derived from this process's own mount table."""
    from vgpu_agent.throttle.attribution import parse_mountinfo, path_in_filesystem

    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = parse_mountinfo(f.read())
    found = path_in_filesystem(os.path.realpath(path), os.stat(path).st_dev, mounts)
    assert found is not None, f"no mount of this machine holds {path}"
    return found


def region_mounts(region_path: Path, inside: str = CONTAINER_REGION_DIR) -> str:
    """The lines a runtime's bind mounts of one region's files add to a container's table."""
    inside = inside.rstrip("/")
    lines = []
    for n, name in enumerate(("control", "state")):
        f = region_path / name
        lines.append(mount_line(1210 + n, os.stat(f).st_dev, in_filesystem(f), f"{inside}/{name}"))
    return "".join(lines)


class FakeHostProc:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> str:
        return str(self.root)

    def process(
        self,
        host_pid: int,
        *,
        inner_pid: int | None = None,
        start: int = 1000,
        mounts: str = "",
        cgroup: str = "0::/system.slice/sshd.service\n",
        comm: str | bytes = "python train.py",
    ) -> Path:
        """A process; `mounts` are the table lines after the container's base mounts. `comm`,
        its command name, is the process's own to set to any bytes (`prctl(PR_SET_NAME)`): the
        kernel writes it as it is into `stat`, and into `status` with backslashes and every
        white space but the space escaped, C-style (as kernels since 5.x do)."""
        d = self.root / str(host_pid)
        d.mkdir(exist_ok=True)
        name = comm.encode() if isinstance(comm, str) else comm
        shown = name.replace(b"\\", b"\\\\")
        for raw, escaped in ((b"\n", b"\\n"), (b"\t", b"\\t"), (b"\r", b"\\r"),
                             (b"\f", b"\\f"), (b"\v", b"\\v")):
            shown = shown.replace(raw, escaped)
        nspid = f"{host_pid}\t{inner_pid}" if inner_pid is not None else str(host_pid)
        d.joinpath("status").write_bytes(
            b"Name:\t" + shown + f"\nPid:\t{host_pid}\nNSpid:\t{nspid}\n".encode())
        fields = ["S", "1"] + ["0"] * 17 + [str(start), "0"]  # fields 3.. ; 22 is start time
        d.joinpath("stat").write_bytes(
            f"{host_pid} (".encode() + name + f") {' '.join(fields)}\n".encode())
        d.joinpath("cgroup").write_text(cgroup)
        d.joinpath("mountinfo").write_text(_BASE_MOUNTS + mounts)
        return d

    def container_process(
        self, host_pid: int, region_path: Path, *, inner_pid: int = 1, start: int = 1000,
        cgroup: str | None = None, inside: str = CONTAINER_REGION_DIR,
    ) -> Path:
        """A process in the container that was started with `region_path` mounted."""
        return self.process(
            host_pid, inner_pid=inner_pid, start=start, mounts=region_mounts(region_path, inside),
            cgroup=cgroup or f"0::/kubepods/pod-{region_path.name}/cri-containerd-{host_pid}\n",
        )

    def end(self, host_pid: int) -> None:
        d = self.root / str(host_pid)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()

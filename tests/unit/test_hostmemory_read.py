"""Host memory for the spill bound: MemTotal, lowered by the pods' cgroup limit when smaller."""

from pathlib import Path

from vgpu_agent.hostmemory import host_memory, meminfo_total, pods_cgroup_limit

MEMINFO = "MemTotal:       65794812 kB\nMemFree:        1234 kB\nMemAvailable:   99 kB\n"


def proc(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "proc"
    directory.mkdir(exist_ok=True)
    (directory / "meminfo").write_text(text)
    return directory


def cgroup(tmp_path: Path, name: str, text: str) -> Path:
    root = tmp_path / "cgroup"
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
    return root


def test_meminfo_total_in_bytes(tmp_path):
    assert meminfo_total(proc(tmp_path, MEMINFO)) == 65794812 * 1024


def test_missing_or_garbled_meminfo_reads_as_unknown(tmp_path):
    assert meminfo_total(tmp_path / "nowhere") == 0
    assert meminfo_total(proc(tmp_path, "MemTotal: lots\n")) == 0
    assert meminfo_total(proc(tmp_path, "\x00\xff garbage")) == 0


def test_cgroup_v2_limit_and_its_absence(tmp_path):
    assert pods_cgroup_limit(cgroup(tmp_path, "kubepods.slice/memory.max", "8589934592\n")) == 8 << 30
    assert pods_cgroup_limit(cgroup(tmp_path, "kubepods.slice/memory.max", "max\n")) == 0
    assert pods_cgroup_limit(tmp_path / "empty") == 0


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    root = cgroup(tmp_path, "memory/kubepods/memory.limit_in_bytes", "9223372036854771712\n")
    assert pods_cgroup_limit(root) == 0
    root = cgroup(tmp_path, "memory/kubepods/memory.limit_in_bytes", "not a number\n")
    assert pods_cgroup_limit(root) == 0


def test_the_smaller_of_the_two_is_the_host_memory(tmp_path):
    p = proc(tmp_path, MEMINFO)
    assert host_memory(p, cgroup(tmp_path, "kubepods/memory.max", "1073741824")) == 1 << 30
    assert host_memory(p, tmp_path / "no-cgroup") == 65794812 * 1024
    assert host_memory(tmp_path / "no-proc", cgroup(tmp_path, "kubepods/memory.max", "4096")) == 4096
    assert host_memory(tmp_path / "no-proc", tmp_path / "no-cgroup") == 0

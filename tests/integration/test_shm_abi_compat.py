"""Region ABI 1.0 and 1.1 meeting each other: an agent and a shim of either version.

A 1.1 agent adopts, steers and reads a region a 1.0 agent created; a 1.1 shim enforces the limit
on such a region; a 1.0 shim (built from the last commit of this repository whose header says
1.0) refuses a 1.1 `state` with its named error and passes through, or refuses CUDA with
VGPU_FAIL_CLOSED=1: the documented one-time cost of 1.1; and a 1.0 agent (after a downgrade)
still reads a 1.1 region, counting the size it does not know.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests import shimbuild
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, RegionStore

SHIM, BUILD = shimbuild.SHIM, shimbuild.BUILD
REPO = SHIM.parent
MIB = 1 << 20

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None,
                                reason="the shim needs make and gcc")


def _fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def _region(root: Path, state_minor: int, memory_limit: int = 64 * MIB) -> Path:
    region = root / "000000000001-0000beef"
    region.mkdir(parents=True)
    uuid = _fake_gpu_uuid(0)
    (region / "control").write_bytes(layout.encode_control(layout.Control(
        devices=(layout.ControlDevice(uuid, memory_limit=memory_limit),),
        device_ids=(f"{uuid}::0",), seq=1, created_ns=time.monotonic_ns(),
        heartbeat_ns=time.monotonic_ns())))
    (region / "state").write_bytes(layout.encode_state(1, abi_minor=state_minor))
    return region


def _env(region: Path, shim: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LD_PRELOAD=str(shim), VGPU_REGION_DIR=str(region), **extra)
    env.pop("VGPU_DISABLE", None)
    if "VGPU_FAIL_CLOSED" not in extra:
        env.pop("VGPU_FAIL_CLOSED", None)
    return env


@pytest.fixture(scope="module")
def client() -> Path:
    result = shimbuild.make("all", "build/cuda_client")
    assert result.returncode == 0, result.stderr
    return BUILD / "cuda_client"


def _last_1_0_commit() -> str | None:
    """The newest commit whose region header still says ABI minor 0."""
    try:
        log = subprocess.run(
            ["git", "-C", str(REPO), "log", "--format=%H", "--", "shim/include/vgpu_shm.h"],
            capture_output=True, text=True, timeout=30, check=True).stdout.split()
        for commit in log:
            header = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{commit}:shim/include/vgpu_shm.h"],
                capture_output=True, text=True, timeout=30, check=True).stdout
            if "#define VGPU_ABI_MINOR 0u" in header:
                return commit
    except (OSError, subprocess.SubprocessError):
        return None
    return None


@pytest.fixture(scope="module")
def old_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    commit = _last_1_0_commit()
    if commit is None:
        pytest.skip("no git history with a 1.0 shim (not a git checkout)")
    work = tmp_path_factory.mktemp("shim-1.0")
    archive = work / "shim.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit, "shim"],
                   check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    result = subprocess.run(["make", "-C", str(work / "shim"), "build/libvgpu.so"],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    return work / "shim" / "build" / "libvgpu.so"


def test_agent_adopts_steers_and_reads_a_1_0_region(tmp_path: Path, client: Path) -> None:
    state_dir = tmp_path / "state"
    region_dir = _region(state_dir / "regions", state_minor=0)
    store = RegionStore(state_dir)
    adopted = store.adopt()
    try:
        assert [r.alloc_id for r in adopted] == [region_dir.name]
        region = adopted[0]
        region.set_rate(0, 1000, 50)
        assert region.rate(0) == (1000, 50)
        holder = subprocess.Popen(
            [str(client), "direct", "ctx", "0", "alloc", "plain", "48M", "ok", "alloc", "plain",
             "17M", "oom", "hold"],
            env=_env(region_dir, BUILD / "libvgpu.so"), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "ready"
            usage = region.usage()
            assert not usage.corrupt and usage.skipped_records == 0 and not usage.extension
            assert usage.memory_used == (48 * MIB,)
            assert usage.memory_data(0) == 48 * MIB and usage.memory_context == (0,)
            assert [p.pid for p in usage.processes] == [holder.pid]
        finally:
            _, err = holder.communicate(timeout=30)
        assert holder.returncode == 0, err
        assert "libvgpu:" not in err  # the 1.1 shim took the 1.0 region without complaint
        assert os.stat(region_dir / "state").st_size == layout.STATE_SIZE_1_0  # left as it was
    finally:
        store.close()


def test_new_regions_are_1_1(tmp_path: Path) -> None:
    region_dir = _region(tmp_path, state_minor=layout.ABI_MINOR)
    region = Region.open(region_dir)
    try:
        assert region.usage().extension
    finally:
        region.close()


def test_a_1_0_shim_refuses_a_1_1_state_by_name(tmp_path: Path, client: Path,
                                                 old_shim: Path) -> None:
    region_dir = _region(tmp_path, state_minor=layout.ABI_MINOR, memory_limit=16 * MIB)
    run = subprocess.run(
        [str(client), "direct", "ctx", "0", "alloc", "plain", "32M", "ok"],
        env=_env(region_dir, old_shim), capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert "is not a region state file this shim understands" in run.stderr
    assert "passing through" in run.stderr
    closed = subprocess.run(
        [str(client), "direct", "ctx", "0", "alloc", "plain", "1M", "noinit"],
        env=_env(region_dir, old_shim, VGPU_FAIL_CLOSED="1"), capture_output=True, text=True,
        timeout=60, check=False)
    assert closed.returncode == 0, closed.stderr
    assert "is not a region state file this shim understands" in closed.stderr
    # and the same old shim still works on the 1.0 regions it was made for
    old_region = _region(tmp_path / "old", state_minor=0, memory_limit=16 * MIB)
    fine = subprocess.run(
        [str(client), "direct", "ctx", "0", "alloc", "plain", "8M", "ok", "alloc", "plain",
         "9M", "oom"],
        env=_env(old_region, old_shim), capture_output=True, text=True, timeout=60, check=False)
    assert fine.returncode == 0, fine.stderr
    assert "libvgpu:" not in fine.stderr


def test_agent_reads_memory_by_kind_the_shim_wrote(tmp_path: Path, client: Path) -> None:
    region_dir = _region(tmp_path, state_minor=layout.ABI_MINOR, memory_limit=1 << 30)
    env = _env(region_dir, BUILD / "libvgpu.so", FAKE_CUDA_CONTEXT_MEMORY=str(100 * MIB))
    holder = subprocess.Popen(
        [str(client), "direct", "ctx", "0", "module", "data", "8M", "ok", "alloc", "async", "16M",
         "ok", "free", "ok", "alloc", "plain", "4M", "ok", "hold"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    region = Region.open(region_dir)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        usage = region.usage()
        assert usage.extension and usage.skipped_records == 0
        assert usage.memory_used == (128 * MIB,)
        assert (usage.memory_context, usage.memory_module, usage.memory_pool) == (
            (100 * MIB,), (8 * MIB,), (16 * MIB,))  # the pool keeps what was freed into it
        assert usage.memory_data(0) == 4 * MIB
        assert [p.memory_used for p in usage.processes] == [(128 * MIB,)]
    finally:
        _, err = holder.communicate(timeout=30)
        region.close()
    assert holder.returncode == 0, err
    after = layout.decode_state((region_dir / "state").read_bytes(), 1)
    assert after.memory_used == (0,) and after.memory_context == (0,) and after.memory_pool == (0,)


def _layout_1_0(tmp_path: Path) -> ModuleType | None:
    """vgpu_agent/shm/layout.py as the last 1.0 agent had it (from this repository's history)."""
    commit = _last_1_0_commit()
    if commit is None:
        return None
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:vgpu_agent/shm/layout.py"],
        capture_output=True, text=True, timeout=30, check=True).stdout
    path = tmp_path / "layout_1_0.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("layout_1_0", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["layout_1_0"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["layout_1_0"]
    return module


def test_a_1_0_agent_reads_a_1_1_state_and_counts_the_size_it_does_not_know(
    tmp_path: Path, client: Path
) -> None:
    old = _layout_1_0(tmp_path)
    if old is None:
        pytest.skip("no git history with a 1.0 agent (not a git checkout)")
    assert old.ABI_MINOR == 0 and old.STATE_SIZE == layout.STATE_SIZE_1_0
    region_dir = _region(tmp_path, state_minor=layout.ABI_MINOR, memory_limit=64 * MIB)
    holder = subprocess.Popen(
        [str(client), "direct", "ctx", "0", "alloc", "plain", "24M", "ok", "hold"],
        env=_env(region_dir, BUILD / "libvgpu.so"), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        usage = old.decode_state((region_dir / "state").read_bytes(), 1)
        # after a downgrade: the regions stay readable, the unknown size is one skipped record
        assert not usage.corrupt and usage.skipped_records == 1
        assert usage.memory_used == (24 * MIB,)
        assert [p.pid for p in usage.processes] == [holder.pid]
    finally:
        _, err = holder.communicate(timeout=30)
    assert holder.returncode == 0, err

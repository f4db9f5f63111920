"""Shims and agents of ABI 1.0 and 1.1 together.

- A 1.0 shim (built from the last commit before 1.1) with a `control` a 1.1 agent writes: it
  accepts it (the policy word took reserved space), enforces its limits, and ignores the word, so
  it honours VGPU_DISABLE as it always did. (A 1.1 `state` is larger; a 1.0 shim refuses that by
  name, which shim/README.md describes: the `state` here is a 1.0 one, as an agent that adopted
  it from before the upgrade keeps it.)
- A 1.1 shim with a 1.0 control: the word reads as all clear (see the C tests in
  shim/tests/policy_tests.c), so VGPU_DISABLE is ignored: the secure default. An agent of 1.0
  never meant to allow anything else; operators who relied on VGPU_DISABLE set
  `shim_allow_disable` on the new agent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests import shimbuild
from vgpu_agent.shm import layout

REPO = Path(__file__).resolve().parents[2]
BUILD = shimbuild.BUILD
MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("gcc") is None or shutil.which("git") is None,
    reason="needs make, gcc and git",
)


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=60, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


@pytest.fixture(scope="module")
def old_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    first_1_1 = _git("log", "--format=%H", "-S", "VGPU_ABI_MINOR 1u", "--",
                     "shim/include/vgpu_shm.h").splitlines()
    if not first_1_1:
        pytest.skip("no git history with the ABI 1.0 shim")
    base = tmp_path_factory.mktemp("shim-1.0")
    archive = base / "shim.tar"
    done = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive),
                           f"{first_1_1[-1]}^", "shim"], capture_output=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot read the 1.0 shim from git: {done.stderr!r}")
    with tarfile.open(archive) as tar:
        tar.extractall(base, filter="data")
    header = (base / "shim" / "include" / "vgpu_shm.h").read_text()
    assert "#define VGPU_ABI_MINOR 0u" in header
    built = subprocess.run(["make", "-C", str(base / "shim"), "all"], capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return base / "shim" / "build" / "libvgpu.so"


@pytest.fixture(scope="module")
def client() -> Path:
    built = shimbuild.make("all", "build/cuda_client", timeout=300)
    assert built.returncode == 0, built.stderr
    return BUILD / "cuda_client"


def _fake_gpu_uuid(dev: int) -> str:
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def _region(root: Path, flags: int, state_minor: int = layout.ABI_MINOR) -> Path:
    region = root / "000000000001-0000beef"
    region.mkdir()
    device = layout.ControlDevice(_fake_gpu_uuid(0), memory_limit=64 * MIB)
    (region / "control").write_bytes(layout.encode_control(layout.Control(
        devices=(device,), device_ids=(f"{device.uuid}::0",), seq=1, flags=flags,
        created_ns=time.monotonic_ns(), heartbeat_ns=time.monotonic_ns())))
    (region / "state").write_bytes(layout.encode_state(1, abi_minor=state_minor))
    return region


def _run(client: Path, shim: Path, region: Path, *steps: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("VGPU_DISABLE", "VGPU_FAIL_CLOSED")}
    environ.update(LD_PRELOAD=str(shim), VGPU_REGION_DIR=str(region), **env)
    done = subprocess.run([str(client), *steps], env=environ, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_1_0_shim_enforces_a_control_a_1_1_agent_writes(old_shim, client, tmp_path):
    region = _region(tmp_path, 0, state_minor=0)
    assert layout.decode_control((region / "control").read_bytes()).abi_minor == 1
    err = _run(client, old_shim, region, "direct", "ctx", "0", "alloc", "plain", "1G", "oom",
               "alloc", "plain", "32M", "ok", "launch", "kernel", "1", "1", "32", "ok")
    assert "libvgpu:" not in err
    assert layout.decode_state((region / "state").read_bytes(), 1).launches == (1,)


def test_a_1_0_shim_ignores_the_policy_word_and_honours_vgpu_disable(old_shim, client, tmp_path):
    region = _region(tmp_path, 0, state_minor=0)  # nothing allowed: only a 1.1 shim reads that
    _run(client, old_shim, region, "direct", "ctx", "0", "alloc", "plain", "1G", "ok",
         VGPU_DISABLE="1")
    assert layout.decode_state((region / "state").read_bytes(), 1).launches == (0,)


def test_a_1_1_shim_honours_vgpu_disable_only_when_the_agent_allows_it(client, tmp_path):
    new_shim = BUILD / "libvgpu.so"
    (tmp_path / "a").mkdir()
    refused = _region(tmp_path / "a", 0)
    err = _run(client, new_shim, refused, "direct", "ctx", "0", "alloc", "plain", "1G", "oom",
               VGPU_DISABLE="1")
    assert "VGPU_DISABLE=1 ignored" in err
    (tmp_path / "b").mkdir()
    allowed = _region(tmp_path / "b", layout.CONTROL_ALLOW_DISABLE)
    err = _run(client, new_shim, allowed, "direct", "ctx", "0", "alloc", "plain", "1G", "ok",
               VGPU_DISABLE="1")
    assert "libvgpu:" not in err

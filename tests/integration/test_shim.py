"""The shim (libvgpu.so): its C tests, plain and sanitized, and region files written by Python.

The C tests (`make -C shim test` / `sanitize-test`) run a CUDA client against a fake libcuda with
the shim preloaded. The tests below additionally prove that what the agent's Python code writes
(`vgpu_agent.shm.layout`) is what the C shim enforces, and that what the shim writes is what the
agent reads back.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import shimbuild
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region

SHIM, BUILD = shimbuild.SHIM, shimbuild.BUILD
MIB = 1 << 20

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("gcc") is None,
                                reason="the shim needs make and gcc")


def _make(*targets: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    # (the targets are independent compiles of a few seconds each)
    return shimbuild.make(*targets, jobs=4, timeout=timeout)


def _tap_failures(output: str) -> str:
    lines = output.splitlines()
    bad = [i for i, line in enumerate(lines) if line.startswith("not ok")]
    return "\n".join("\n".join(lines[i:i + 3]) for i in bad) or output[-4000:]


def test_shim_c_tests() -> None:
    result = _make("test")
    assert result.returncode == 0, _tap_failures(result.stdout + result.stderr)
    assert "not ok" not in result.stdout


@pytest.mark.slow
def test_shim_c_tests_under_address_and_undefined_behaviour_sanitizers() -> None:
    result = _make("sanitize-test", timeout=300)
    assert result.returncode == 0, _tap_failures(result.stdout + result.stderr)
    assert "not ok" not in result.stdout


# ---------------------------------------------------------------- Python-written regions


def _fake_gpu_uuid(dev: int) -> str:
    """The UUID the fake driver gives device `dev` (shim/tests/fake_ids.h)."""
    raw = bytes((k * 17 + 0x40 + dev * 5) & 0xFF for k in range(16)).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


@pytest.fixture(scope="module")
def client() -> Path:
    result = _make("all", "build/cuda_client")
    assert result.returncode == 0, result.stderr
    return BUILD / "cuda_client"


def _region(tmp_path: Path, device: layout.ControlDevice) -> Path:
    region = tmp_path / "000000000001-0000beef"  # an allocation's name: the agent opens it too
    region.mkdir()
    (region / "control").write_bytes(layout.encode_control(layout.Control(
        devices=(device,), device_ids=(f"{device.uuid}::0",), seq=1,
        created_ns=time.monotonic_ns(), heartbeat_ns=time.monotonic_ns())))
    (region / "state").write_bytes(layout.encode_state(1))
    return region


def _env(region: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LD_PRELOAD=str(BUILD / "libvgpu.so"), VGPU_REGION_DIR=str(region))
    env.pop("VGPU_FAIL_CLOSED", None)
    env.pop("VGPU_DISABLE", None)
    return env


def _state(region: Path, device_count: int = 1) -> layout.RegionUsage:
    return layout.decode_state((region / "state").read_bytes(), device_count)


def _mark(region: Path) -> int:
    return layout.load_u64((region / "state").read_bytes(), layout.STATE_OFFSETS["slot_high_water"])


def _agent_reads(region: Path) -> layout.RegionUsage:
    """The region as the agent's `Region.usage()` reads it: header, then slots below the mark."""
    opened = Region.open(region)
    try:
        return opened.usage()
    finally:
        opened.close()


def test_limit_written_by_python_is_enforced_and_usage_read_back(client: Path,
                                                                 tmp_path: Path) -> None:
    region = _region(tmp_path, layout.ControlDevice(_fake_gpu_uuid(0), memory_limit=64 * MIB))
    holder = subprocess.Popen(
        [str(client), "direct", "ctx", "0", "alloc", "plain", "48M", "ok", "alloc", "create",
         "17M", "oom", "hold"],
        env=_env(region), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        usage = _state(region)
        assert not usage.corrupt and usage.skipped_records == 0
        assert [p.pid for p in usage.processes] == [holder.pid]
        assert usage.processes[0].memory_used == (48 * MIB,)
        assert usage.memory_used == (48 * MIB,)
        other = subprocess.run(
            [str(client), "dlsym", "ctx", "0", "alloc", "plain", "17M", "oom", "alloc", "plain",
             "16M", "ok"], env=_env(region), capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    # the killed holder still counts until a shim looks; cuMemGetInfo reclaims it
    assert _state(region).memory_used == (48 * MIB,)
    after = subprocess.run([str(client), "procaddr", "ctx", "0", "info", "64M", "64M"],
                           env=_env(region), capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr
    usage = _state(region)
    assert usage.processes == () and usage.memory_used == (0,)


def _hold(client: Path, region: Path, *steps: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen([str(client), *steps, "hold"], env=_env(region),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready", holder.stderr
    return holder


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22


def test_agent_reads_the_slots_two_shim_processes_claimed_up_to_their_mark(
    client: Path, tmp_path: Path
) -> None:
    region = _region(tmp_path, layout.ControlDevice(_fake_gpu_uuid(0), memory_limit=64 * MIB))
    assert _mark(region) == 0 and _agent_reads(region).processes == ()
    holders = []
    try:
        holders.append(_hold(client, region, "direct", "ctx", "0", "alloc", "plain", "8M", "ok"))
        holders.append(_hold(client, region, "dlsym", "ctx", "0", "alloc", "plain", "16M", "ok"))
        first, second = holders
        usage = _agent_reads(region)
        assert not usage.corrupt and usage.skipped_records == 0
        assert [(p.pid, p.memory_used, p.start_time) for p in usage.processes] == [
            (first.pid, (8 * MIB,), _start_time(first.pid)),
            (second.pid, (16 * MIB,), _start_time(second.pid)),
        ]
        assert usage.memory_used == (24 * MIB,)
        assert _mark(region) == 2
        assert usage == _state(region)  # two preads read what the whole file says
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        reclaim = subprocess.run([str(client), "procaddr", "ctx", "0", "info", "64M", "48M"],
                                 env=_env(region), capture_output=True, text=True, timeout=60)
        assert reclaim.returncode == 0, reclaim.stderr
        usage = _agent_reads(region)
        assert [p.pid for p in usage.processes] == [second.pid]
        assert usage.memory_used == (16 * MIB,)
        assert _mark(region) == 2  # slot 0 is free again, the mark does not come down
    finally:
        for holder in holders:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)


def test_rate_raised_by_python_reaches_a_waiting_launch(client: Path, tmp_path: Path) -> None:
    # 1000-token launches against 100 tokens/s: the second launch would wait 10 s (capped at 2 s
    # per launch); the agent raises the rate while it waits and the launch goes at once
    region = _region(tmp_path, layout.ControlDevice(
        _fake_gpu_uuid(0), core_limit=250_000, rate=100, burst=1000,
        policy=layout.POLICY_STRICT))
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(client), "direct", "ctx", "0", "timed", "4", "10", "100"],
        env=_env(region), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    with open(region / "control", "r+b") as f, mmap.mmap(f.fileno(), 0) as control:
        generation = layout.set_rate(control, 0, 10**9, 10**6)
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err
    assert generation == 2
    assert elapsed < 1.8, f"the launches took {elapsed:.2f} s: the new rate was not picked up"
    buf = (region / "state").read_bytes()
    dev = layout.STATE_OFFSETS["devices"]
    waited = layout.load_u64(buf, dev + layout.STATE_DEVICE_OFFSETS["wait_ns"])
    launches = layout.load_u64(buf, dev + layout.STATE_DEVICE_OFFSETS["launches"])
    assert launches == 4
    assert 0.3e9 < waited < 1.8e9
    assert _state(region).tokens_spent == (4000,)


def test_policy_set_by_the_agent_for_the_pod_reaches_the_running_shim(
    client: Path, tmp_path: Path
) -> None:
    # the same starved launches; the pod's annotation turns throttling off while they wait, and
    # the agent writes that into `control` (Region.set_policy): the shim stops spending tokens
    region = _region(tmp_path, layout.ControlDevice(
        _fake_gpu_uuid(0), core_limit=250_000, rate=100, burst=1000,
        policy=layout.POLICY_STRICT))
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(client), "direct", "ctx", "0", "timed", "4", "10", "100"],
        env=_env(region), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    opened = Region.open(region)
    try:
        assert opened.set_policy("off", 7)
    finally:
        opened.close()
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err
    # strict all along: three launches waiting 2 s each
    assert elapsed < 3.0, f"the launches took {elapsed:.2f} s: the policy was not picked up"
    control = layout.decode_control((region / "control").read_bytes())
    assert (control.devices[0].policy, control.priority) == (layout.POLICY_OFF, 7)
    assert control.generation == 2 and control.devices[0].rate == 100  # nothing else moved
    assert layout.load_u64((region / "state").read_bytes(), layout.STATE_OFFSETS["devices"]
                           + layout.STATE_DEVICE_OFFSETS["launches"]) == 4


def test_state_scribbled_by_a_container_process_is_read_safely(client: Path,
                                                               tmp_path: Path) -> None:
    region = _region(tmp_path, layout.ControlDevice(_fake_gpu_uuid(0), memory_limit=64 * MIB))
    ran = subprocess.run([str(client), "direct", "ctx", "0", "alloc", "plain", "8M", "ok"],
                         env=_env(region), capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert _mark(region) == 1  # the client's slot, given back at its exit
    with open(region / "state", "r+b") as f:
        f.seek(layout.STATE_OFFSETS["slots"])
        f.write(b"\xff" * layout.SLOT_SIZE)  # a slot full of nonsense, below the mark
        f.seek(layout.STATE_OFFSETS["slot_high_water"])
        f.write(b"\xff" * 8)  # and a mark beyond every slot
    usage = _state(region)
    assert not usage.corrupt
    assert usage.skipped_records == 2
    assert usage.processes == ()

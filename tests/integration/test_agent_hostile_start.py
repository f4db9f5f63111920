"""`vgpu-agent` as a process against hostile configuration and unusable directories.

Every bad configuration exits 2 with the key named and no traceback, quickly; a state dir or
plugin dir that cannot be used exits 1 with the path and the OS error before the plugin
registers, never at the first Allocate.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from tests.integration.plugin_harness import short_dir
from tests.unit.test_config_hostile_values import alias_bomb_under_one_key
from vgpu_agent.kubelet.standin import KubeletStandIn


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


async def run_cli(args: list[str], env: dict[str, str] | None = None, limit_s: float = 30):
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vgpu_agent.cli", *args,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), limit_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, stderr.decode(), time.monotonic() - started


def sim_args(root, *more: str) -> list[str]:
    return ["run", "--backend", "sim", "--device-plugin-dir", str(root / "dp"),
            "--state-dir", str(root / "state"), "--metrics-address", "127.0.0.1:0",
            "--pod-resources-socket", str(root / "pr.sock"), *more]


@pytest.mark.parametrize(
    ("content", "key"),
    [
        (alias_bomb_under_one_key("xid_ignore"), "xid_ignore"),
        ("split_count: " + "7" * 5000 + "\n", "split_count"),
        ("health_check_seconds: .inf\n", "health_check_seconds"),
        ("endpoint_name: ../../escape.sock\n", "endpoint_name"),
        ("split_count: 2000000\n", "split_count"),
    ],
)
async def test_hostile_config_files_exit_2_naming_the_key(root, content, key):
    cfg = root / "cfg.yaml"
    cfg.write_text(content)
    code, stderr, took = await run_cli(sim_args(root, "--config", str(cfg)), limit_s=20)
    assert code == 2, stderr
    assert f"invalid configuration: {key}=" in stderr
    assert "Traceback" not in stderr
    assert len(stderr) < 2500
    assert not (root / "dp").exists() and not (root / "state").exists()
    assert took < 15


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "fifo", "dir"])
async def test_a_config_that_is_not_a_regular_file_exits_2_at_once(root, path):
    if path == "fifo":
        path = str(root / "fifo")
        os.mkfifo(path)  # no writer: a blocking open would hang the start for ever
    elif path == "dir":
        path = str(root)
    code, stderr, _ = await run_cli(sim_args(root, "--config", path), limit_s=20)
    assert code == 2, stderr
    assert f"--config='{path}'" in stderr and "not a regular file" in stderr
    assert "Traceback" not in stderr


async def test_an_oversized_or_binary_config_file_exits_2(root):
    big = root / "big.yaml"
    big.write_bytes(b"#" * (65 * 1024))
    code, stderr, _ = await run_cli(sim_args(root, "--config", str(big)))
    assert code == 2 and "at most 65536 bytes" in stderr
    binary = root / "bin.yaml"
    binary.write_bytes(b"split_count: 4\n\xff\xfe\n")
    code, stderr, _ = await run_cli(sim_args(root, "--config", str(binary)))
    assert code == 2 and "is not UTF-8" in stderr and "Traceback" not in stderr


async def test_huge_and_infinite_values_in_the_environment_exit_2(root):
    for name, value in (
        ("VGPU_AGENT_SPLIT_COUNT", "9" * 5000),
        ("VGPU_AGENT_THROTTLE_TICK_SECONDS", "inf"),
        ("VGPU_AGENT_MEMORY_SCALING", "1e400"),
    ):
        code, stderr, _ = await run_cli(sim_args(root), {name: value})
        assert code == 2, stderr
        assert f"invalid configuration: {name}=" in stderr and "Traceback" not in stderr


def file_in_the_path(root) -> str:
    (root / "blocker").write_text("a file where a directory is expected")
    return str(root / "blocker" / "sub")


@pytest.mark.parametrize("which", ["state", "plugin"])
async def test_an_unusable_directory_exits_1_before_registering(root, which):
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"))
    await kubelet.start()
    try:
        bad = file_in_the_path(root)
        args = sim_args(root)
        flag = "--state-dir" if which == "state" else "--device-plugin-dir"
        args[args.index(flag) + 1] = bad  # the kubelet stand-in stays on the good one
        code, stderr, took = await run_cli(args)
    finally:
        await kubelet.stop()
    assert code == 1, stderr
    assert bad in stderr and "Not a directory" in stderr
    assert "Traceback" not in stderr
    assert kubelet.registrations == []
    assert took < 20

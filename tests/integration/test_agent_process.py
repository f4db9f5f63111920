"""`vgpu-agent run` as a process: real NVML backend on the fake library, kubelet stand-in, signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import pytest

from tests.integration.plugin_harness import RESOURCE, short_dir
from vgpu_agent.deviceplugin.ids import parse_device_id
from vgpu_agent.kubelet.standin import KubeletStandIn


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


async def start_agent(args: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vgpu_agent.cli",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def agent_args(root, fake) -> list[str]:
    return [
        "run",
        "--backend",
        "nvml",
        "--nvml-library",
        str(fake.library_path),
        "--device-plugin-dir",
        str(root / "dp"),
        "--pod-resources-socket",
        str(root / "pr.sock"),
        "--state-dir",
        str(root / "state"),
        "--metrics-address",
        "127.0.0.1:0",
        "--split-count",
        "3",
        "--log-format",
        "json",
    ]


@contextlib.asynccontextmanager
async def agent_with_kubelet(root, fake, recovery_s: str):
    """`vgpu-agent run` on the fake NVML against a kubelet stand-in; yields (process, devices)."""
    os.makedirs(root / "dp")
    kubelet = KubeletStandIn(str(root / "dp"))
    await kubelet.start()
    env = {"VGPU_AGENT_HEALTH_RECOVERY_SECONDS": recovery_s, "VGPU_AGENT_HEALTH_CHECK_SECONDS": "0.2"}
    proc = await start_agent(agent_args(root, fake), {**fake.env(), **env})

    def devices() -> dict[str, str]:
        state = kubelet.resources.get(RESOURCE)
        return dict(state.devices) if state else {}

    try:
        await kubelet.wait_for(lambda: len(devices()) == 6, limit_s=30)
        yield proc, kubelet, devices
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await kubelet.stop()


def slices_of(devices, uuid: str) -> set[str]:
    return {h for d, h in devices().items() if d.startswith(uuid)}


async def test_run_with_fake_nvml_serves_ids_health_and_cleans_up_on_sigterm(root, fake_nvml):
    async with agent_with_kubelet(root, fake_nvml, "1") as (proc, kubelet, devices):
        assert {parse_device_id(d).uuid for d in devices()} == set(fake_nvml.uuids)

        admission = await kubelet.admit("ns", "p", "c", RESOURCE, 2)
        assert len(admission.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2

        lost = fake_nvml.uuids[1]
        fake_nvml.inject_xid(lost, 79)
        await kubelet.wait_for(lambda: slices_of(devices, lost) == {"Unhealthy"}, limit_s=5)
        assert {h for d, h in devices().items() if not d.startswith(lost)} == {"Healthy"}
        await kubelet.wait_for(lambda: set(devices().values()) == {"Healthy"}, limit_s=10)

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert not os.path.exists(root / "dp" / "vgpu-agent.sock")


async def test_gpu_lost_marks_its_slices_unhealthy(root, fake_nvml):
    async with agent_with_kubelet(root, fake_nvml, "0") as (proc, kubelet, devices):
        lost = fake_nvml.uuids[0]
        fake_nvml.lose_gpu(lost)
        await kubelet.wait_for(lambda: slices_of(devices, lost) == {"Unhealthy"}, limit_s=5)
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--split-count", "0"],
            {},
            "split_count='0' (from command line): must be an integer >= 1",
        ),
        (["--backend", "cuda"], {}, "backend='cuda' (from command line): must be one of nvml, sim"),
        ([], {"VGPU_AGENT_MEMORY_SCALING": "2"}, "allow_memory_oversubscription"),
        ([], {"VGPU_AGENT_BOGUS": "1"}, "VGPU_AGENT_BOGUS='1' (from environment): unknown key"),
        (["--config", "/nonexistent/cfg.yaml"], {}, "'/nonexistent/cfg.yaml'"),
        (["--log-format", "xml"], {}, "log_format='xml'"),
    ],
)
async def test_config_errors_exit_2_with_a_message_and_start_nothing(root, args, env, message):
    proc = await start_agent(
        ["run", "--device-plugin-dir", str(root / "dp"), "--backend", "sim", *args], env
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert message in stderr.decode()
    assert not (root / "dp").exists()


async def test_config_file_errors_name_the_file(root):
    cfg = root / "cfg.yaml"
    cfg.write_text("split_count: 4\nallocation_policy: fastest\n")
    proc = await start_agent(["run", "--config", str(cfg)], {})
    _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert f"allocation_policy='fastest' (from {cfg})" in stderr.decode()


async def test_metrics_port_taken_exits_1_naming_the_address(root):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await start_agent(
            ["run", "--backend", "sim", "--device-plugin-dir", str(root / "dp"),
             "--state-dir", str(root / "state"), "--metrics-address", f"127.0.0.1:{port}"],
            {},
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in stderr.decode()
    assert "Traceback" not in stderr.decode()

"""The device plugin against the kubelet stand-in: registration, devices, allocation, restarts."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from tests.integration.plugin_harness import RESOURCE, config_for, running_agent, short_dir
from vgpu_agent.deviceplugin.ids import parse_device_id
from vgpu_agent.gpu.sim import SimBackend


@pytest.fixture
def root():
    with short_dir() as path:
        yield path


async def test_registers_once_serving_and_advertises_k_slices_per_gpu(root):
    config = config_for(root)
    async with running_agent(config) as run:
        reg = run.kubelet.registrations[0]
        assert reg.resource_name == RESOURCE
        assert reg.endpoint == config.endpoint_name
        assert reg.options.get_preferred_allocation_available
        devices = run.devices()
        assert len(devices) == 3 * 4
        assert set(devices.values()) == {"Healthy"}
        per_gpu = {}
        for device_id in devices:
            uuid, n = parse_device_id(device_id)
            per_gpu.setdefault(uuid, set()).add(n)
        assert all(slices == {0, 1, 2, 3} for slices in per_gpu.values())
        topology = run.kubelet.resources[RESOURCE].topology
        assert all(len(nodes) == 1 for nodes in topology.values())


async def test_spread_admission_lands_on_distinct_gpus_with_envs(root):
    async with running_agent(config_for(root)) as run:
        admission = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 2)
        uuids = [parse_device_id(d).uuid for d in admission.device_ids]
        assert len(set(uuids)) == 2
        envs = admission.response.envs
        visible = envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert sorted(visible) == sorted(uuids)
        assert envs["CUDA_DEVICE_SM_LIMIT"] == "25"
        assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"].endswith("m")


async def test_binpack_admission_puts_both_slices_on_one_gpu(root):
    async with running_agent(config_for(root, allocation_policy="binpack")) as run:
        admission = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 2)
        assert len({parse_device_id(d).uuid for d in admission.device_ids}) == 1
        envs = admission.response.envs
        assert len(envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == 1
        assert envs["CUDA_DEVICE_SM_LIMIT"] == "50"


async def test_cdi_strategy_returns_cdi_devices(root):
    async with running_agent(config_for(root, device_list_strategy="cdi")) as run:
        admission = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        uuid = parse_device_id(admission.device_ids[0]).uuid
        assert [d.name for d in admission.response.cdi_devices] == [f"nvidia.com/gpu={uuid}"]
        assert "NVIDIA_VISIBLE_DEVICES" not in admission.response.envs


@pytest.mark.parametrize(
    ("bad_id", "named"),
    [
        ("not-a-device", "not-a-device"),
        ("GPU-00000000-dead-beef-0000-000000000000::1", "not on this node"),
    ],
)
async def test_unknown_or_malformed_ids_fail_with_invalid_argument(root, bad_id, named):
    async with running_agent(config_for(root)) as run:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run.kubelet.allocate(RESOURCE, [bad_id])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_id in err.value.details()
        assert named in err.value.details()
        # nothing else broke: a good allocation still works
        good = await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        assert good.response.envs["NVIDIA_VISIBLE_DEVICES"]


async def test_kubelet_restart_is_followed_by_registration_within_a_second(root):
    async with running_agent(config_for(root)) as run:
        assert len(run.kubelet.registrations) == 1
        await run.kubelet.restart()
        restarted = time.monotonic()
        await run.kubelet.wait_for(lambda: len(run.kubelet.registrations) == 2, limit_s=5)
        assert run.kubelet.registrations[1].at - restarted < 1.0
        await run.kubelet.wait_for(lambda: run.kubelet.resources[RESOURCE].stream_open, limit_s=5)
        assert len(run.devices()) == 12
        assert run.agent.runner.status.kubelet_restarts == 1


async def test_registration_after_a_restart_is_not_held_by_a_connection_in_backoff(root):
    # Another channel to kubelet.sock saw the kubelet go and is in reconnect backoff; from
    # gRPC's process-wide pool the registrar's new channels took over its connection and
    # failed until that backoff ran out. The registrar's channel dials on its own.
    async with running_agent(config_for(root)) as run:
        stale = grpc.aio.insecure_channel(f"unix:{run.kubelet.kubelet_socket}")
        await asyncio.wait_for(stale.channel_ready(), 5)
        await run.kubelet.stop()
        stale.get_state(try_to_connect=True)
        await asyncio.sleep(0.1)  # it tries, fails, and waits out its backoff (about 1 s)
        await run.kubelet.start()
        restarted = time.monotonic()
        await run.kubelet.wait_for(lambda: len(run.kubelet.registrations) == 2, limit_s=5)
        # (0.7-1.5 s before, the stale connection's backoff; a few milliseconds now)
        assert run.kubelet.registrations[1].at - restarted < 0.5
        await stale.close()


async def test_a_new_kubelet_socket_that_reuses_the_inode_number_is_still_a_restart(
    root, monkeypatch
):
    """Filesystems hand a freed inode number to the next file at once: a kubelet whose new
    socket got the old number (and that left ours in place) is still seen to have restarted."""
    from vgpu_agent.kubelet.standin import KubeletStandIn

    async with running_agent(config_for(root)) as run:
        kubelet_sock = run.kubelet.kubelet_socket
        old = os.stat(kubelet_sock)
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            st = real_stat(path, *args, **kwargs)
            if path != kubelet_sock:
                return st
            fields = list(st)
            fields[1], fields[2] = old.st_ino, old.st_dev  # same device and inode number
            return os.stat_result(fields, {"st_ctime_ns": st.st_ctime_ns})

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(KubeletStandIn, "_wipe_sockets",
                            lambda self: os.unlink(self.kubelet_socket)
                            if os.path.exists(self.kubelet_socket) else None)
        await asyncio.sleep(0.01)  # a change time of its own for the new socket
        await run.kubelet.restart()
        await run.kubelet.wait_for(lambda: len(run.kubelet.registrations) == 2, limit_s=5)
        assert run.agent.runner.status.kubelet_restarts == 1


async def test_own_socket_deleted_means_register_again(root):
    config = config_for(root)
    async with running_agent(config) as run:
        os.unlink(config.plugin_socket)
        await run.kubelet.wait_for(lambda: len(run.kubelet.registrations) == 2, limit_s=5)
        assert os.path.exists(config.plugin_socket)


async def test_registration_rejected_is_retried_with_backoff(root):
    config = config_for(root)
    async with running_agent(config) as run:
        run.kubelet.reject_registrations = 2
        await run.kubelet.restart()
        await run.kubelet.wait_for(lambda: len(run.kubelet.registrations) == 2, limit_s=10)
        assert run.kubelet.reject_registrations == 0
        # the kubelet records the registration before its reply reaches the agent
        for _ in range(50):
            if run.agent.runner.status.registered:
                break
            await asyncio.sleep(0.1)
        assert run.agent.runner.status.registered
        assert run.agent.runner.status.last_error == ""


async def test_waits_for_kubelet_socket_before_serving(root):
    config = config_for(root)
    backend = SimBackend(config.sim_gpus)
    from vgpu_agent.agent import Agent
    from vgpu_agent.kubelet.standin import KubeletStandIn

    os.makedirs(config.device_plugin_dir)
    agent = Agent(config, backend=backend)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.sleep(0.5)
        assert not os.path.exists(config.plugin_socket)
        kubelet = KubeletStandIn(config.device_plugin_dir)
        await kubelet.start()
        await kubelet.wait_for(lambda: bool(kubelet.registrations), limit_s=5)
        await kubelet.stop()
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
    assert not os.path.exists(config.plugin_socket)


async def test_xid_makes_slices_unhealthy_then_they_recover(root):
    config = config_for(root, health_recovery_seconds=0.5)
    backend = SimBackend(config.sim_gpus)
    async with running_agent(config, backend=backend) as run:
        uuid = backend.uuids[1]
        backend.inject_xid(uuid, 79)
        await run.kubelet.wait_for(
            lambda: {h for d, h in run.devices().items() if d.startswith(uuid)} == {"Unhealthy"},
            limit_s=5,
        )
        others = {h for d, h in run.devices().items() if not d.startswith(uuid)}
        assert others == {"Healthy"}
        await run.kubelet.wait_for(lambda: set(run.devices().values()) == {"Healthy"}, limit_s=5)


async def test_ignored_xid_changes_nothing(root):
    config = config_for(root)
    backend = SimBackend(config.sim_gpus)
    async with running_agent(config, backend=backend) as run:
        updates = run.kubelet.resources[RESOURCE].updates
        backend.inject_xid(backend.uuids[0], 13)
        await asyncio.sleep(0.5)
        assert run.kubelet.resources[RESOURCE].updates == updates
        assert set(run.devices().values()) == {"Healthy"}


async def test_stop_removes_the_plugin_socket(root):
    config = config_for(root)
    async with running_agent(config):
        assert os.path.exists(config.plugin_socket)
    assert not os.path.exists(config.plugin_socket)


async def test_first_allocate_finds_a_spare_region_directory_ready(root):
    config = config_for(root)
    async with running_agent(config) as run:
        regions_dir = os.path.join(config.state_dir, "regions")
        for _ in range(50):
            if any(e.startswith(".new-spare-") for e in os.listdir(regions_dir)):
                break
            await asyncio.sleep(0.05)
        spares = {e for e in os.listdir(regions_dir) if e.startswith(".new-spare-")}
        assert spares, "no spare prepared at start"
        await run.kubelet.admit("ns", "pod", "main", RESOURCE, 1)
        assert len(spares - set(os.listdir(regions_dir))) == 1  # the Allocate took one

"""The PodResources client against the kubelet stand-in's `List`, and without it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from tests.integration.plugin_harness import short_dir
from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2
from vgpu_agent._proto.podresources.v1 import api_pb2 as pr_api_pb2
from vgpu_agent._proto.podresources.v1 import api_pb2_grpc as pr_api_pb2_grpc
from vgpu_agent.kubelet.podresources import (
    ContainerRef,
    PodResourcesClient,
    PodResourcesError,
    PodResourcesUnavailable,
)
from vgpu_agent.kubelet.standin import Admission, KubeletStandIn

RESOURCE = "nvidia.com/gpu"
OTHER = "example.com/fpga"


@pytest.fixture
def root() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def admit(kubelet: KubeletStandIn, ns: str, pod: str, container: str, resource: str,
          ids: list[str]) -> None:
    """Record an admission as the stand-in would after a successful Allocate."""
    kubelet.admissions.append(
        Admission(ns, pod, container, resource, ids, api_pb2.ContainerAllocateResponse())
    )


@contextlib.asynccontextmanager
async def kubelet_at(root: Path):
    kubelet = KubeletStandIn(str(root / "dp"), str(root / "pr" / "kubelet.sock"))
    await kubelet.start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()


async def test_list_maps_our_device_ids_to_containers(root: Path) -> None:
    async with kubelet_at(root) as kubelet:
        admit(kubelet, "ml", "train-0", "worker", RESOURCE, ["GPU-a::0", "GPU-b::1"])
        admit(kubelet, "ml", "train-0", "sidecar", RESOURCE, ["GPU-a::1"])
        admit(kubelet, "ml", "train-0", "worker", OTHER, ["fpga-0"])
        admit(kubelet, "web", "infer", "server", RESOURCE, ["GPU-b::3"])
        client = PodResourcesClient(kubelet.pod_resources_socket or "", RESOURCE)
        found = await client.list_assignments()
        await client.close()
    assert found == {
        "GPU-a::0": ContainerRef("ml", "train-0", "worker"),
        "GPU-b::1": ContainerRef("ml", "train-0", "worker"),
        "GPU-a::1": ContainerRef("ml", "train-0", "sidecar"),
        "GPU-b::3": ContainerRef("web", "infer", "server"),
    }


async def test_missing_socket_is_reported_once_counted_and_the_last_map_kept(root: Path) -> None:
    path = str(root / "pr" / "kubelet.sock")
    client = PodResourcesClient(path, RESOURCE)
    with pytest.raises(PodResourcesUnavailable, match="does not exist"):
        await client.list_assignments()

    updates: list[dict[str, ContainerRef]] = []

    async def record(found: dict[str, ContainerRef]) -> None:
        updates.append(found)

    with capture_logs() as logs:
        assert not await client.refresh(record)
        assert not await client.refresh(record)
        async with kubelet_at(root) as kubelet:
            admit(kubelet, "ml", "a", "main", RESOURCE, ["GPU-a::0"])
            assert await client.refresh(record)
            assert await client.refresh(record)
        # the kubelet goes away again
        assert not await client.refresh(record)
        assert not await client.refresh(record)
    await client.close()

    events = [e["event"] for e in logs if e["log_level"] != "debug" and "pod_resources" in e["event"]]
    assert events == [
        "pod_resources_unavailable",
        "pod_resources_available",
        "pod_resources_unavailable",
    ]
    assert "containers cannot be mapped" in next(
        e["effect"] for e in logs if e["event"] == "pod_resources_unavailable"
    )
    assert client.failures == 4 and client.successes == 2 and not client.available
    assert updates == [{"GPU-a::0": ContainerRef("ml", "a", "main")}] * 2
    assert client.assignments == {"GPU-a::0": ContainerRef("ml", "a", "main")}


async def test_a_file_that_is_not_a_socket_is_refused(root: Path) -> None:
    path = root / "kubelet.sock"
    path.write_text("")
    client = PodResourcesClient(str(path), RESOURCE)
    with pytest.raises(PodResourcesUnavailable, match="not a unix socket"):
        await client.list_assignments()


async def test_a_socket_nobody_listens_on_fails_with_the_grpc_code(root: Path) -> None:
    path = root / "kubelet.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a dead kubelet leaves behind
    try:
        client = PodResourcesClient(str(path), RESOURCE, timeout_s=2)
        with pytest.raises(PodResourcesError, match="UNAVAILABLE") as failure:
            await client.list_assignments()
        assert str(path) in str(failure.value)
        await client.close()
    finally:
        stale.close()


async def test_a_restarted_kubelet_is_reached_again(root: Path) -> None:
    client = PodResourcesClient(str(root / "pr" / "kubelet.sock"), RESOURCE)
    async with kubelet_at(root) as kubelet:
        admit(kubelet, "ml", "a", "main", RESOURCE, ["GPU-a::0"])
        assert await client.list_assignments() == {"GPU-a::0": ContainerRef("ml", "a", "main")}
    with pytest.raises(PodResourcesError):
        await client.list_assignments()
    async with kubelet_at(root) as kubelet:  # a new process on the same socket path
        admit(kubelet, "ml", "b", "main", RESOURCE, ["GPU-a::0"])
        found = await asyncio.wait_for(client.list_assignments(), 5)
        assert found == {"GPU-a::0": ContainerRef("ml", "b", "main")}
    await client.close()


async def test_a_connection_left_in_backoff_does_not_fail_the_first_call_after_a_restart(
        root: Path) -> None:
    # Another channel to the same socket saw the kubelet go and is in reconnect backoff (the
    # client's own previous channel while it closes is one). From gRPC's process-wide pool a
    # new channel took over that connection, and its first call after the restart failed
    # ("failed to connect to all addresses"); the client's channel dials on its own.
    path = str(root / "pr" / "kubelet.sock")
    stale = grpc.aio.insecure_channel(f"unix:{path}")
    lister = pr_api_pb2_grpc.PodResourcesListerStub(stale)
    async with kubelet_at(root):
        await lister.List(pr_api_pb2.ListPodResourcesRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        await lister.List(pr_api_pb2.ListPodResourcesRequest(), timeout=5)
    async with kubelet_at(root) as kubelet:
        admit(kubelet, "ml", "b", "main", RESOURCE, ["GPU-a::0"])
        client = PodResourcesClient(path, RESOURCE)
        assert await client.list_assignments() == {"GPU-a::0": ContainerRef("ml", "b", "main")}
        await client.close()
    await stale.close()


async def test_run_refreshes_on_poke_and_survives_a_failing_callback(root: Path) -> None:
    async with kubelet_at(root) as kubelet:
        client = PodResourcesClient(kubelet.pod_resources_socket or "", RESOURCE,
                                    poke_delay_s=0.01)
        seen: list[dict[str, ContainerRef]] = []
        changed = asyncio.Event()

        async def on_update(found: dict[str, ContainerRef]) -> None:
            seen.append(found)
            changed.set()
            if len(seen) == 1:
                raise RuntimeError("a bug downstream")

        task = asyncio.create_task(client.run(refresh_s=60, on_update=on_update))
        try:
            await asyncio.wait_for(changed.wait(), 5)  # the first List runs at once
            changed.clear()
            admit(kubelet, "ml", "a", "main", RESOURCE, ["GPU-a::2"])
            client.poke()  # far sooner than the 60 s interval
            await asyncio.wait_for(changed.wait(), 5)
            assert seen == [{}, {"GPU-a::2": ContainerRef("ml", "a", "main")}]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_run_polls_on_its_interval(root: Path) -> None:
    async with kubelet_at(root) as kubelet:
        client = PodResourcesClient(kubelet.pod_resources_socket or "", RESOURCE)
        task = asyncio.create_task(client.run(refresh_s=0.05))
        try:
            await asyncio.sleep(0.5)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert client.successes >= 3


async def test_run_polls_slowly_while_idle_and_at_its_interval_again_once_busy(
    root: Path,
) -> None:
    async with kubelet_at(root) as kubelet:
        client = PodResourcesClient(kubelet.pod_resources_socket or "", RESOURCE,
                                    poke_delay_s=0.01)
        busy = False
        task = asyncio.create_task(client.run(refresh_s=0.05, idle=lambda: not busy))
        try:
            await asyncio.sleep(0.5)
            assert client.successes == 1  # nothing needs the map: the next List is a minute on
            busy = True  # a region came, and with it a poke (as after an Allocate)
            client.poke()
            await asyncio.sleep(0.5)
            assert client.successes >= 4
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout must be > 0 s, got 0"):
        PodResourcesClient("/x", RESOURCE, timeout_s=0)
    client = PodResourcesClient("/x", RESOURCE)
    with pytest.raises(ValueError, match="refresh interval must be > 0 s, got -1"):
        await client.run(refresh_s=-1)

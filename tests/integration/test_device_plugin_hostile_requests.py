"""Allocate is atomic and bounded; GetPreferredAllocation is bounded; device IDs match exactly.

The requests are sent over the plugin's real gRPC socket, as a kubelet (or anything that can
reach the socket) would; regions are real files under a temporary state dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.integration.plugin_harness import RESOURCE, short_dir
from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_agent.deviceplugin.allocation import Grant, Split
from vgpu_agent.deviceplugin.registration import PluginRunner
from vgpu_agent.deviceplugin.server import DevicePluginServicer, DeviceState, Extras
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kubelet.standin import KubeletStandIn
from vgpu_agent.shm.regions import RegionError, RegionStore

GIB = 1 << 30
GPUS = [
    GpuInfo(0, "GPU-11111111-2222-3333-4444-555555555555", "NVIDIA A100", 80 * GIB, 0, "0:1:0.0"),
    GpuInfo(1, "GPU-66666666-7777-8888-9999-000000000000", "NVIDIA L4", 24 * GIB, 1, "0:2:0.0"),
]
U0, U1 = GPUS[0].uuid, GPUS[1].uuid


@dataclass
class Plugin:
    root: Path
    store: RegionStore
    stub: api_pb2_grpc.DevicePluginStub
    fail_on_grant: int | None = None  # the n-th hook call (1-based) fails
    hang_on_grant: int | None = None  # the n-th hook call never returns
    grants: int = 0

    def region_dirs(self) -> list[str]:
        return sorted(
            e for e in os.listdir(self.store.root) if not e.startswith(".new-spare-")
        )


@contextlib.asynccontextmanager
async def plugin() -> AsyncIterator[Plugin]:
    with short_dir() as root:
        store = RegionStore(root / "state")
        store.adopt()
        holder: list[Plugin] = []

        async def on_grant(grant: Grant) -> Extras:
            p = holder[0]
            p.grants += 1
            if p.grants == p.fail_on_grant:
                raise RegionError(f"cannot create region: injected failure at {p.grants}")
            if p.grants == p.hang_on_grant:
                await asyncio.Event().wait()  # a region that takes for ever (a hung disk)
            return await store.on_grant(grant)

        plugin_dir = str(root / "dp")
        os.makedirs(plugin_dir)
        kubelet = KubeletStandIn(plugin_dir)
        await kubelet.start()
        servicer = DevicePluginServicer(
            DeviceState(GPUS, Split(4)), policy="spread", strategy="envvar", on_grant=on_grant
        )
        runner = PluginRunner(
            servicer, plugin_dir=plugin_dir, endpoint="vg.sock", resource_name=RESOURCE
        )
        task = asyncio.create_task(runner.run())
        await kubelet.wait_for(lambda: RESOURCE in kubelet.resources, limit_s=15)
        channel = grpc.aio.insecure_channel(f"unix:{plugin_dir}/vg.sock")
        holder.append(Plugin(root, store, api_pb2_grpc.DevicePluginStub(channel)))
        try:
            yield holder[0]
        finally:
            await channel.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await kubelet.stop()
            store.close()


def allocate_request(*containers: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


async def refused(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def test_an_allocate_failing_part_way_leaves_no_region_behind() -> None:
    async with plugin() as p:
        p.fail_on_grant = 3
        err = await refused(p.stub.Allocate(allocate_request([f"{U0}::0"], [f"{U0}::1"],
                                                             [f"{U1}::0"])))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert "injected failure at 3" in err.details()
        assert p.store.regions() == []
        assert p.region_dirs() == []  # the two made before the failure are gone from disk too
        assert p.store.counters.rolled_back == 2

        # the node's Allocate is unaffected: the same IDs work at once
        p.fail_on_grant = None
        response = await p.stub.Allocate(allocate_request([f"{U0}::0"], [f"{U0}::1"]))
        assert len(response.container_responses) == 2
        assert len(p.store.regions()) == 2 and len(p.region_dirs()) == 2


async def test_an_allocate_the_kubelet_gives_up_on_leaves_no_region_behind() -> None:
    async with plugin() as p:
        p.hang_on_grant = 2
        err = await refused(
            p.stub.Allocate(allocate_request([f"{U0}::0"], [f"{U1}::0"]), timeout=0.5)
        )
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):  # the server learns of the cancellation on its own schedule
            if p.store.counters.rolled_back:
                break
            await asyncio.sleep(0.05)
        assert p.store.counters.rolled_back == 1
        assert p.store.regions() == [] and p.region_dirs() == []


async def test_more_container_requests_than_the_node_has_slices_are_refused_at_once() -> None:
    async with plugin() as p:
        request = allocate_request(*([[f"{U0}::{n % 4}"] for n in range(10_000)]))
        started = time.perf_counter()
        err = await refused(p.stub.Allocate(request))
        assert time.perf_counter() - started < 2.0
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "10000 container requests; this node has 8 slices" in err.details()
        assert p.grants == 0 and p.store.regions() == [] and p.region_dirs() == []

        too_many_ids = allocate_request([f"{U0}::{n % 4}" for n in range(9)])
        err = await refused(p.stub.Allocate(too_many_ids))
        assert "9 device IDs; this node has 8 slices" in err.details()


@pytest.mark.parametrize(
    ("device_id", "shown"),
    [
        (f"{U0}::1\n", f"'{U0}::1\\n'"),
        (f"{U0}\n::1", f"'{U0}\\n::1'"),
        (f" {U0}::1", f"' {U0}::1'"),
        (f"{U0}::01", f"'{U0}::01'"),
    ],
)
async def test_device_ids_are_matched_exactly(device_id: str, shown: str) -> None:
    async with plugin() as p:
        err = await refused(p.stub.Allocate(allocate_request([device_id])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert shown in err.details()
        assert p.store.regions() == []


async def test_an_id_given_to_two_containers_and_a_huge_id_are_refused() -> None:
    async with plugin() as p:
        err = await refused(p.stub.Allocate(allocate_request([f"{U0}::1"], [f"{U0}::1"])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "granted to two containers" in err.details()
        huge = "GPU-" + "a" * 1_000_000 + "::1"
        err = await refused(p.stub.Allocate(allocate_request([huge])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "(1000007 characters)" in err.details()
        assert len(err.details()) < 400  # the ID is named, not echoed whole
        assert p.store.regions() == []


async def test_preferred_allocation_refuses_more_ids_than_the_node_has() -> None:
    async with plugin() as p:
        available = [f"GPU-{n:08x}-0000-0000-0000-000000000000::0" for n in range(4000)]
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, allocation_size=2
                )
            ]
        )
        started = time.perf_counter()
        err = await refused(p.stub.GetPreferredAllocation(request))
        assert time.perf_counter() - started < 2.0
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "available_deviceIDs has 4000 entries; this node has 8 slices" in err.details()

        fine = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[f"{U0}::{n}" for n in range(4)] + [f"{U1}::3"],
                    allocation_size=2,
                )
            ]
        )
        answer = await p.stub.GetPreferredAllocation(fine)
        assert sorted(answer.container_responses[0].deviceIDs) == [f"{U0}::0", f"{U1}::3"]

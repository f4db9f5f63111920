"""The kubelet-facing gRPC servicer: ListAndWatch, GetPreferredAllocation, Allocate.

Device state lives in `DeviceState`, which outlives servers: the registrar restarts the gRPC
server on every kubelet restart, and each new ListAndWatch stream starts from the current list.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_agent.deviceplugin.allocation import (
    AllocationError,
    Grant,
    Policy,
    Split,
    Strategy,
    cdi_device_names,
    container_envs,
    device_list,
    grant_all,
    preferred_allocation,
    preferred_request_error,
)
from vgpu_agent.deviceplugin.ids import shown
from vgpu_agent.gpu.model import GpuInfo

log = structlog.get_logger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# GetPreferredAllocation requests with more IDs than this are worked out in a thread
PREFERRED_INLINE_IDS = 1024


@dataclass
class Extras:
    """What other parts of the agent add to a container's response (region mounts, variables)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # container, host, read-only
    annotations: dict[str, str] = field(default_factory=dict)
    # undoes what the hook made, for an Allocate that fails after this container's part
    rollback: Callable[[], None] | None = None


GrantHook = Callable[[Grant], Awaitable[Extras]]
ResultHook = Callable[[str, float], None]


class DeviceState:
    """The GPUs, how they are split and which are healthy; wakes ListAndWatch on every change."""

    def __init__(self, gpus: Sequence[GpuInfo], split: Split):
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        self.split = split
        self._healthy = {gpu.uuid: True for gpu in gpus}
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self._version

    def healthy(self) -> Mapping[str, bool]:
        return dict(self._healthy)

    async def set_health(self, uuid: str, healthy: bool) -> None:
        if uuid not in self._healthy or self._healthy[uuid] == healthy:
            return
        self._healthy[uuid] = healthy
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def wait_change(self, seen: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen)
            return self._version

    def list_response(self) -> api_pb2.ListAndWatchResponse:
        devices = []
        for dev in device_list(self.gpus.values(), self.split, self._healthy):
            topology = None
            if dev.numa_node is not None:
                topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=dev.numa_node)])
            devices.append(
                api_pb2.Device(
                    ID=dev.device_id,
                    health=HEALTHY if dev.healthy else UNHEALTHY,
                    topology=topology,
                )
            )
        return api_pb2.ListAndWatchResponse(devices=devices)


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(
        self,
        state: DeviceState,
        *,
        policy: Policy,
        strategy: Strategy,
        cdi_vendor_class: str = "nvidia.com/gpu",
        on_grant: GrantHook | None = None,
        on_result: ResultHook | None = None,
    ):
        self._state = state
        self._policy = policy
        self._strategy = strategy
        self._cdi_vendor_class = cdi_vendor_class
        self._on_grant = on_grant
        self._on_result = on_result
        self._gpu_order = {uuid: gpu.index for uuid, gpu in state.gpus.items()}

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        version = self._state.version
        response = self._state.list_response()
        log.info(
            "list_and_watch_sent", devices=len(response.devices), unhealthy=_unhealthy(response)
        )
        yield response
        while True:
            version = await self._state.wait_change(version)
            response = self._state.list_response()
            log.info(
                "list_and_watch_sent", devices=len(response.devices), unhealthy=_unhealthy(response)
            )
            yield response

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        slices = len(self._state.gpus) * self._state.split.count
        problem = ""
        if len(request.container_requests) > slices:
            problem = f"{len(request.container_requests)} container requests; {slices} slices"
        for req in request.container_requests:
            problem = problem or preferred_request_error(
                len(req.available_deviceIDs),
                len(req.must_include_deviceIDs),
                req.allocation_size,
                slices,
            )
        if problem:
            log.warning("preferred_allocation_rejected", error=problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        work = [
            (list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size)
            for req in request.container_requests
        ]
        if sum(len(a) for a, _, _ in work) > PREFERRED_INLINE_IDS:
            chosen = await asyncio.to_thread(self._preferred, work)  # keep the loop answering
        else:
            chosen = self._preferred(work)
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in chosen
            ]
        )

    def _preferred(self, work: list[tuple[list[str], list[str], int]]) -> list[list[str]]:
        return [
            preferred_allocation(available, must, size, self._policy, self._gpu_order)
            for available, must, size in work
        ]

    async def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AllocateResponse:
        started = time.perf_counter()
        try:
            grants = grant_all(
                [req.devices_ids for req in request.container_requests],
                self._state.gpus,
                self._state.split,
            )
        except AllocationError as err:
            self._result("invalid", started)
            log.warning("allocate_rejected", device_id=shown(err.device_id), error=str(err))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # abort raises; this keeps type checkers and readers certain
        made: list[Extras] = []  # all or nothing: what a failure part-way made is undone
        try:
            responses = [await self._container_response(g, made) for g in grants]
        except BaseException as err:
            _roll_back(made)
            if not isinstance(err, Exception):  # cancelled: the kubelet gave up waiting
                raise
            self._result("error", started)
            log.exception("allocate_failed", error=str(err), rolled_back=len(made))
            await context.abort(grpc.StatusCode.INTERNAL, f"allocation failed: {err}")
            raise
        self._result("ok", started)
        for g in grants:
            log.info(
                "allocated",
                device_ids=list(g.device_ids),
                gpus=[d.uuid for d in g.devices],
                memory_mib=[d.memory_limit_mib for d in g.devices],
                core_percent=[round(d.core_percent, 2) for d in g.devices],
            )
        return api_pb2.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    async def _container_response(
        self, g: Grant, made: list[Extras]
    ) -> api_pb2.ContainerAllocateResponse:
        envs = container_envs(g, self._strategy)
        response = api_pb2.ContainerAllocateResponse()
        if self._strategy == "cdi":
            response.cdi_devices.extend(
                api_pb2.CDIDevice(name=name) for name in cdi_device_names(g, self._cdi_vendor_class)
            )
        if self._on_grant is not None:
            extras = await self._on_grant(g)
            made.append(extras)
            envs.update(extras.envs)
            response.annotations.update(extras.annotations)
            response.mounts.extend(
                api_pb2.Mount(container_path=c, host_path=h, read_only=ro)
                for c, h, ro in extras.mounts
            )
        response.envs.update(envs)
        return response

    def _result(self, result: str, started: float) -> None:
        if self._on_result is not None:
            self._on_result(result, time.perf_counter() - started)


def _roll_back(made: list[Extras]) -> None:
    for extras in reversed(made):
        if extras.rollback is None:
            continue
        try:
            extras.rollback()
        except Exception as err:  # the rest are still undone; the failure itself is answered
            log.error("allocate_rollback_failed", error=str(err))


def _unhealthy(response: api_pb2.ListAndWatchResponse) -> int:
    return sum(1 for d in response.devices if d.health != HEALTHY)

"""A kubelet stand-in that behaves like the kubelet's device manager, for `simulate` and the tests.

What it does, as the kubelet does:
- serves `Registration` on `<plugin_dir>/kubelet.sock`; validates the version and the resource
  name, then, before replying, dials the plugin's socket (10 s), asks `GetDevicePluginOptions`
  and starts reading `ListAndWatch`;
- each `ListAndWatch` message replaces the resource's device set; when the stream ends every
  device of the resource turns unhealthy;
- admits containers: `GetPreferredAllocation` (when the plugin offers it) over the free healthy
  devices, falls back to its own choice when the answer is short or invalid, then `Allocate`;
- serves the PodResources `List` API on its own socket from what it admitted, with the DRA
  claims the DRA stand-in (`drastandin.py`) prepared for containers as `dynamic_resources`;
- `restart()`: stops, deletes every socket in the plugin dir except its checkpoint file, and
  serves a fresh `kubelet.sock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_agent._proto.podresources.v1 import api_pb2 as pr_pb2
from vgpu_agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc

log = structlog.get_logger(__name__)

CHECKPOINT = "kubelet_internal_checkpoint"
_EXTENDED = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass
class Registration:
    resource_name: str
    endpoint: str
    options: api_pb2.DevicePluginOptions
    at: float  # time.monotonic()


@dataclass
class Admission:
    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: list[str]
    response: api_pb2.ContainerAllocateResponse


@dataclass
class DynamicAdmission:
    """A container using a prepared DRA claim, as PodResources reports it."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    driver: str
    devices: list[tuple[str, str, list[str]]]  # pool, device, CDI device IDs


@dataclass
class ResourceState:
    endpoint: str = ""
    options: api_pb2.DevicePluginOptions = field(default_factory=api_pb2.DevicePluginOptions)
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    topology: dict[str, list[int]] = field(default_factory=dict)
    updates: int = 0
    last_update: float = 0.0
    stream_open: bool = False
    channel: grpc.aio.Channel | None = None
    reader: asyncio.Task[None] | None = None


class KubeletStandIn:
    def __init__(self, plugin_dir: str, pod_resources_socket: str | None = None):
        self.plugin_dir = plugin_dir
        self.pod_resources_socket = pod_resources_socket
        self.resources: dict[str, ResourceState] = {}
        self.registrations: list[Registration] = []
        self.admissions: list[Admission] = []
        self.dynamic: list[DynamicAdmission] = []  # kept by the DRA stand-in
        self.changed = asyncio.Condition()
        self.reject_registrations = 0  # answer this many Register calls with UNAVAILABLE
        self.pod_resources_empty = False  # PodResources List answers with no pods at all
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.plugin_dir, "kubelet.sock")

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        self._wipe_sockets()
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        server.add_insecure_port(f"unix:{self.kubelet_socket}")
        await server.start()
        self._server = server
        if self.pod_resources_socket and self._pr_server is None:
            os.makedirs(os.path.dirname(self.pod_resources_socket), exist_ok=True)
            pr_server = grpc.aio.server()
            pr_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesServicer(self), pr_server)
            pr_server.add_insecure_port(f"unix:{self.pod_resources_socket}")
            await pr_server.start()
            self._pr_server = pr_server
        log.info("kubelet_standin_started", socket=self.kubelet_socket)

    async def stop(self) -> None:
        for state in self.resources.values():
            await self._close_stream(state)
        if self._server is not None:
            await self._server.stop(grace=0)
            self._server = None
        if self._pr_server is not None:
            await self._pr_server.stop(grace=0)
            self._pr_server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.kubelet_socket)

    async def restart(self) -> None:
        """What a kubelet restart looks like to plugins: all sockets gone, a new kubelet.sock."""
        pr = self._pr_server
        self._pr_server = None  # PodResources keeps serving across the restart here
        await self.stop()
        self._pr_server = pr
        await self.start()

    def _wipe_sockets(self) -> None:
        for name in os.listdir(self.plugin_dir):
            path = os.path.join(self.plugin_dir, name)
            if name != CHECKPOINT and not os.path.isdir(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # --- device manager ------------------------------------------------------------------------

    async def _connect(self, resource: str, endpoint: str) -> api_pb2.DevicePluginOptions:
        state = self.resources.setdefault(resource, ResourceState())
        await self._close_stream(state)
        channel = grpc.aio.insecure_channel(f"unix:{os.path.join(self.plugin_dir, endpoint)}")
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        state.endpoint, state.options, state.channel = endpoint, options, channel
        state.stream_open = True
        state.reader = asyncio.create_task(self._read_stream(resource, state, stub))
        return options

    async def _read_stream(
        self, resource: str, state: ResourceState, stub: api_pb2_grpc.DevicePluginStub
    ) -> None:
        try:
            async for response in stub.ListAndWatch(api_pb2.Empty()):
                state.devices = {d.ID: d.health for d in response.devices}
                state.topology = {d.ID: [n.ID for n in d.topology.nodes] for d in response.devices}
                state.updates += 1
                state.last_update = time.monotonic()
                async with self.changed:
                    self.changed.notify_all()
        except grpc.aio.AioRpcError as err:
            log.info("kubelet_standin_stream_ended", resource=resource, code=err.code().name)
        finally:
            state.stream_open = False
            state.devices = {d: "Unhealthy" for d in state.devices}
            async with self.changed:
                self.changed.notify_all()

    async def _close_stream(self, state: ResourceState) -> None:
        if state.reader is not None:
            state.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await state.reader
            state.reader = None
        if state.channel is not None:
            await state.channel.close()
            state.channel = None

    async def wait_for(self, predicate: Callable[[], bool], limit_s: float = 10.0) -> None:
        """Wait until `predicate()` is true, woken by registrations and stream updates."""

        async def _wait() -> None:
            async with self.changed:
                await self.changed.wait_for(predicate)

        await asyncio.wait_for(_wait(), limit_s)

    def _stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        state = self.resources.get(resource)
        if state is None or state.channel is None:
            raise RuntimeError(f"no plugin registered for {resource}")
        return api_pb2_grpc.DevicePluginStub(state.channel)

    def free_devices(self, resource: str) -> list[str]:
        state = self.resources.get(resource)
        if state is None:
            return []
        taken = {d for a in self.admissions if a.resource_name == resource for d in a.device_ids}
        return [d for d, h in state.devices.items() if h == "Healthy" and d not in taken]

    async def preferred(
        self, resource: str, available: list[str], must: list[str], size: int
    ) -> list[str]:
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        response = await self._stub(resource).GetPreferredAllocation(request)
        return list(response.container_responses[0].deviceIDs)

    async def allocate(
        self, resource: str, device_ids: list[str]
    ) -> api_pb2.ContainerAllocateResponse:
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=device_ids)]
        )
        response = await self._stub(resource).Allocate(request)
        return response.container_responses[0]

    async def admit(
        self, namespace: str, pod: str, container: str, resource: str, count: int
    ) -> Admission:
        """Admit one container asking for `count` devices, as the kubelet would."""
        free = self.free_devices(resource)
        if len(free) < count:
            raise RuntimeError(
                f"only {len(free)} free healthy {resource} devices, {count} requested"
            )
        chosen = free[:count]
        if self.resources[resource].options.get_preferred_allocation_available:
            preferred = await self.preferred(resource, free, [], count)
            if len(preferred) == count and set(preferred) <= set(free):
                chosen = preferred
        response = await self.allocate(resource, chosen)
        admission = Admission(namespace, pod, container, resource, chosen, response)
        self.admissions.append(admission)
        return admission

    def remove_pod(self, namespace: str, pod: str) -> None:
        self.admissions = [a for a in self.admissions if (a.namespace, a.pod) != (namespace, pod)]


class _RegistrationServicer(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletStandIn):
        self._kubelet = kubelet

    async def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.Empty:
        kubelet = self._kubelet
        if kubelet.reject_registrations > 0:
            kubelet.reject_registrations -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is not ready")
        if request.version != "v1beta1":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version!r}"
            )
        if not _EXTENDED.match(request.resource_name):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid extended resource name {request.resource_name!r}",
            )
        try:
            options = await kubelet._connect(request.resource_name, request.endpoint)
        except (TimeoutError, grpc.aio.AioRpcError) as err:
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot connect to plugin: {err!r}")
        kubelet.registrations.append(
            Registration(request.resource_name, request.endpoint, options, time.monotonic())
        )
        async with kubelet.changed:
            kubelet.changed.notify_all()
        return api_pb2.Empty()


class _PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: KubeletStandIn):
        self._kubelet = kubelet

    async def List(
        self, request: pr_pb2.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr_pb2.ListPodResourcesResponse:
        pods: dict[tuple[str, str], dict[str, pr_pb2.ContainerResources]] = {}
        if self._kubelet.pod_resources_empty:  # a restarting kubelet before it knows its pods
            return pr_pb2.ListPodResourcesResponse()
        for a in self._kubelet.admissions:
            containers = pods.setdefault((a.namespace, a.pod), {})
            ctr = containers.setdefault(a.container, pr_pb2.ContainerResources(name=a.container))
            ctr.devices.append(
                pr_pb2.ContainerDevices(resource_name=a.resource_name, device_ids=a.device_ids)
            )
        for d in self._kubelet.dynamic:
            containers = pods.setdefault((d.namespace, d.pod), {})
            ctr = containers.setdefault(d.container, pr_pb2.ContainerResources(name=d.container))
            ctr.dynamic_resources.append(
                pr_pb2.DynamicResource(
                    claim_name=d.claim_name,
                    claim_namespace=d.claim_namespace,
                    claim_resources=[
                        pr_pb2.ClaimResource(
                            cdi_devices=[pr_pb2.CDIDevice(name=n) for n in cdi_ids],
                            driver_name=d.driver,
                            pool_name=pool,
                            device_name=device,
                        )
                        for pool, device, cdi_ids in d.devices
                    ],
                )
            )
        return pr_pb2.ListPodResourcesResponse(
            pod_resources=[
                pr_pb2.PodResources(name=pod, namespace=ns, containers=list(containers.values()))
                for (ns, pod), containers in pods.items()
            ]
        )

    async def GetAllocatableResources(
        self, request: pr_pb2.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr_pb2.AllocatableResourcesResponse:
        devices = [
            pr_pb2.ContainerDevices(resource_name=name, device_ids=list(state.devices))
            for name, state in self._kubelet.resources.items()
        ]
        return pr_pb2.AllocatableResourcesResponse(devices=devices)

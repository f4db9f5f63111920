"""The kubelet-facing gRPC side of DRA: the DRAPlugin service (v1 and v1beta1, one `DraDriver`
behind both) on `<dra_plugin_dir>/<driver>/dra.sock`, and the plugin watcher's `Registration`
service on `<plugin_registry_dir>/<driver>-reg.sock`.

Registration, as the kubelet's plugin watcher does it: it notices the socket in its registry
directory, calls `GetInfo` (type `DRAPlugin`, the driver name, the DRA socket as endpoint, the
services offered), checks it, and calls `NotifyRegistrationStatus` with its verdict. A refusal
is logged as an error with the kubelet's reason and shown in `status`.

A kubelet restart may wipe the sockets; `DraPluginRunner.run()` checks both every
`check_interval_s` and serves them again when either is gone or replaced, so the plugin watcher
finds the registration socket anew and registers the driver again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
import structlog

from vgpu_agent._proto.dra.v1 import api_pb2 as v1
from vgpu_agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_agent._proto.dra.v1beta1 import api_pb2 as v1beta1
from vgpu_agent._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from vgpu_agent._proto.pluginregistration.v1 import api_pb2 as reg
from vgpu_agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_agent.backoff import Backoff
from vgpu_agent.dra.driver import DraDriver
from vgpu_agent.dra.grant import ClaimRef

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _servicer(pb: ModuleType, grpc_mod: ModuleType, driver: DraDriver, with_share: bool) -> Any:
    """A DRAPlugin servicer for one API version: the messages differ only by package."""

    class Servicer(grpc_mod.DRAPluginServicer):  # type: ignore[name-defined,misc]
        async def NodePrepareResources(
            self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Any:
            results = await driver.prepare(_claims(request))
            response = pb.NodePrepareResourcesResponse()
            for uid, result in results.items():
                entry = response.claims[uid]  # every claim gets an entry, also a failed one
                if result.error:
                    entry.error = result.error
                    continue
                for d in result.devices:
                    device = entry.devices.add(
                        request_names=list(d.requests),
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_ids),
                    )
                    if with_share and d.share_id is not None:
                        device.share_id = d.share_id
            return response

        async def NodeUnprepareResources(
            self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Any:
            errors = await driver.unprepare(_claims(request))
            response = pb.NodeUnprepareResourcesResponse()
            for uid, error in errors.items():
                response.claims[uid].error = error
            return response

    return Servicer()


@dataclass
class RegistrationStatus:
    registered: bool | None = None  # None: the kubelet has not answered yet
    error: str = ""
    at: float = 0.0  # time.monotonic() of the kubelet's last verdict
    registrations: int = 0  # verdicts received (one per kubelet registration)


class _RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, name: str, endpoint: str, status: RegistrationStatus):
        self._name = name
        self._endpoint = endpoint
        self._status = status

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self._name,
            endpoint=self._endpoint,
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg.RegistrationStatusResponse:
        status = self._status
        status.registered = request.plugin_registered
        status.error = "" if request.plugin_registered else request.error
        status.at = time.monotonic()
        status.registrations += 1
        if request.plugin_registered:
            log.info("dra_registered", driver=self._name, endpoint=self._endpoint)
        else:
            log.error(
                "dra_registration_rejected",
                driver=self._name,
                reason=request.error or "(the kubelet gave no reason)",
                effect="the kubelet will not call this driver; claims for it cannot start",
            )
        return reg.RegistrationStatusResponse()


class DraPluginRunner:
    def __init__(
        self,
        driver: DraDriver,
        *,
        driver_name: str,
        dra_socket: str,
        registration_socket: str,
        check_interval_s: float = 1.0,
    ):
        self.driver = driver
        self.driver_name = driver_name
        self.dra_socket = dra_socket
        self.registration_socket = registration_socket
        self.check_interval_s = check_interval_s
        self.status = RegistrationStatus()
        self.serves = 0  # times the sockets were (re)created
        self.serving = asyncio.Event()
        self._servers: list[grpc.aio.Server] = []
        self._inodes: dict[str, tuple[int, int]] = {}  # path -> (inode, ctime) of our socket

    # --- the registration view the metrics read (same shape as the device plugin's) ------------

    @property
    def registered(self) -> bool:
        return self.status.registered is True and self.serving.is_set()

    @property
    def registrations(self) -> int:
        return self.status.registrations

    @property
    def kubelet_restarts(self) -> int:
        """Times the sockets had to be served again (a kubelet restart wipes them)."""
        return max(0, self.serves - 1)

    @property
    def last_error(self) -> str:
        return self.status.error

    async def run(self) -> None:
        """Serve until cancelled; serve again when a socket disappears (a kubelet restart)."""
        backoff = Backoff(initial=0.2, cap=10.0, jitter=0)
        try:
            while True:
                try:
                    await self._serve()
                    backoff.reset()
                except (OSError, RuntimeError) as err:
                    delay = backoff.next_delay()
                    log.error("dra_serve_failed", error=str(err), retry_in_s=delay)
                    await self._stop()
                    await asyncio.sleep(delay)
                    continue
                await self._watch()
                log.info("dra_sockets_gone", detail="serving again, the kubelet registers anew")
                await self._stop()
        finally:
            await self._stop()
            for path in (self.registration_socket, self.dra_socket):
                with contextlib.suppress(OSError):
                    if self._inodes.get(path) == _identity(path):
                        os.unlink(path)

    async def _serve(self) -> None:
        os.makedirs(os.path.dirname(self.dra_socket), exist_ok=True)
        os.makedirs(os.path.dirname(self.registration_socket), exist_ok=True)
        dra = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(_servicer(v1, v1_grpc, self.driver, True), dra)
        v1beta1_grpc.add_DRAPluginServicer_to_server(
            _servicer(v1beta1, v1beta1_grpc, self.driver, False), dra
        )
        await self._listen(dra, self.dra_socket)
        # The registration socket comes last: once the watcher sees it, the endpoint must answer.
        registration = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(
            _RegistrationServicer(self.driver_name, self.dra_socket, self.status), registration
        )
        await self._listen(registration, self.registration_socket)
        self.serves += 1
        self.serving.set()
        log.info(
            "dra_serving",
            driver=self.driver_name,
            dra_socket=self.dra_socket,
            registration_socket=self.registration_socket,
        )

    async def _listen(self, server: grpc.aio.Server, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of an earlier process
        server.add_insecure_port(f"unix:{path}")
        self._servers.append(server)
        await server.start()
        self._inodes[path] = _identity(path)

    async def _watch(self) -> None:
        """Return when a socket is gone or replaced (no inotify: the dirs are hostPaths that
        the kubelet may recreate)."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            if not self._sockets_intact():
                return

    def _sockets_intact(self) -> bool:
        for path, identity in self._inodes.items():
            try:
                if _identity(path) != identity:
                    return False
            except FileNotFoundError:
                return False
        return True

    async def _stop(self) -> None:
        self.serving.clear()
        servers, self._servers = self._servers, []
        for server in servers:
            await server.stop(grace=0.5)


def _identity(path: str) -> tuple[int, int]:
    """A socket file's identity: inode numbers are reused at once, change times are not."""
    info = os.stat(path)
    return info.st_ino, info.st_ctime_ns

"""The kubelet's DRA side, as a stand-in for `simulate` and the tests.

What it does, as the kubelet does:
- its plugin watcher looks at the registry directory; for each new socket it calls `GetInfo`,
  checks the type (`DRAPlugin`), the name (a DNS subdomain) and the versions (it speaks
  `v1.DRAPlugin` and `v1beta1.DRAPlugin`, preferring v1), dials the endpoint, and tells the
  plugin its verdict with `NotifyRegistrationStatus`;
- prepares and unprepares claims with `NodePrepareResources`/`NodeUnprepareResources`, one call
  per pod with the pod's claims of that driver, and treats a per-claim error as that claim's;
- records which container uses which prepared claim, so the PodResources `List` of the device
  plugin stand-in (`KubeletStandIn`) reports it under `dynamic_resources`;
- `restart()`: drops its connections, deletes every socket in the registry directory and in the
  plugin directory's driver folders, and registers again whatever reappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from vgpu_agent._proto.dra.v1 import api_pb2 as v1
from vgpu_agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_agent._proto.dra.v1beta1 import api_pb2 as v1beta1
from vgpu_agent._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from vgpu_agent._proto.pluginregistration.v1 import api_pb2 as reg
from vgpu_agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_agent.kubelet.standin import DynamicAdmission, KubeletStandIn

log = structlog.get_logger(__name__)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VERSIONS = {"v1.DRAPlugin": (v1, v1_grpc), "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc)}


@dataclass
class DraPlugin:
    name: str
    endpoint: str
    version: str
    channel: grpc.aio.Channel
    registration_socket: str


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    driver: str
    devices: list[Any] = field(default_factory=list)  # the plugin's Device messages


class DraKubeletStandIn:
    def __init__(
        self,
        registry_dir: str,
        plugins_dir: str | None = None,
        *,
        kubelet: KubeletStandIn | None = None,
        poll_s: float = 0.05,
        speak: Sequence[str] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
    ):
        self.registry_dir = registry_dir
        self.plugins_dir = plugins_dir
        self.kubelet = kubelet
        self.poll_s = poll_s
        self.speak = tuple(speak)
        self.plugins: dict[str, DraPlugin] = {}
        self.rejected: list[tuple[str, str]] = []  # socket, reason
        self.refuse: dict[str, str] = {}  # driver name -> reason to refuse it with
        self.registrations = 0
        self.changed = asyncio.Condition()
        self._seen: dict[str, tuple[int, int]] = {}  # socket path -> (inode, ctime) handled
        self._watcher: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(self.registry_dir, exist_ok=True)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="dra-plugin-watcher")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        for plugin in self.plugins.values():
            await plugin.channel.close()
        self.plugins.clear()
        self._seen.clear()

    async def restart(self) -> None:
        """A kubelet restart: connections dropped, sockets deleted, registration starts over."""
        await self.stop()
        for directory in self._socket_dirs():
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)
        await self.start()

    def _socket_dirs(self) -> list[str]:
        dirs = [self.registry_dir]
        if self.plugins_dir and os.path.isdir(self.plugins_dir):
            for name in os.listdir(self.plugins_dir):
                path = os.path.join(self.plugins_dir, name)
                if os.path.isdir(path):
                    dirs.append(path)
        return dirs

    async def wait_registered(
        self, driver: str, limit_s: float = 10.0, after: int = -1
    ) -> DraPlugin:
        """Wait until `driver` is registered, by a registration numbered above `after` (the
        `registrations` count seen before a plugin restarted) when given."""
        async with asyncio.timeout(limit_s), self.changed:
            await self.changed.wait_for(
                lambda: driver in self.plugins and self.registrations > after
            )
        return self.plugins[driver]

    # --- the plugin watcher ---------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                names = sorted(os.listdir(self.registry_dir))
            except FileNotFoundError:
                names = []
            present = {os.path.join(self.registry_dir, name) for name in names}
            for path in [p for p in self._seen if p not in present]:
                await self._deregister(path)  # the plugin's socket is gone: so is the plugin
            for name in names:
                path = os.path.join(self.registry_dir, name)
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                # inode numbers are reused at once: a new socket is told by its change time too
                identity = (info.st_ino, info.st_ctime_ns)
                if not stat.S_ISSOCK(info.st_mode) or self._seen.get(path) == identity:
                    continue
                self._seen[path] = identity
                try:
                    await self._register(path)
                except (grpc.aio.AioRpcError, TimeoutError) as err:
                    log.info("dra_standin_registration_failed", socket=path, error=repr(err))
                    self._seen.pop(path, None)  # try again on the next look
            await asyncio.sleep(self.poll_s)

    async def _register(self, path: str) -> None:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=5)
            reason = self._check(info)
            plugin_channel = None
            if not reason:
                plugin_channel = grpc.aio.insecure_channel(f"unix:{info.endpoint}")
                try:
                    await asyncio.wait_for(plugin_channel.channel_ready(), 5)
                except TimeoutError:
                    await plugin_channel.close()
                    plugin_channel = None
                    reason = f"cannot connect to endpoint {info.endpoint}"
            if reason:
                self.rejected.append((path, reason))  # recorded before the plugin hears it
                log.info("dra_standin_rejected", socket=path, reason=reason)
            await stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=not reason, error=reason), timeout=5
            )
        if reason or plugin_channel is None:
            return
        version = next(v for v in self.speak if v in info.supported_versions)
        old = self.plugins.get(info.name)
        if old is not None:
            await old.channel.close()
        self.plugins[info.name] = DraPlugin(info.name, info.endpoint, version, plugin_channel, path)
        self.registrations += 1
        log.info("dra_standin_registered", driver=info.name, version=version)
        async with self.changed:
            self.changed.notify_all()

    async def _deregister(self, path: str) -> None:
        self._seen.pop(path, None)
        for name, plugin in list(self.plugins.items()):
            if plugin.registration_socket == path:
                del self.plugins[name]
                await plugin.channel.close()
                log.info("dra_standin_deregistered", driver=name, socket=path)
                async with self.changed:
                    self.changed.notify_all()

    def _check(self, info: reg.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"plugin type {info.type!r} is not handled by this watcher (DRAPlugin)"
        if not _DNS_SUBDOMAIN.match(info.name) or len(info.name) > 253:
            return f"driver name {info.name!r} is not a DNS subdomain"
        if info.name in self.refuse:
            return self.refuse[info.name]
        if not any(v in info.supported_versions for v in self.speak):
            return (
                f"none of the versions {list(info.supported_versions)} is supported; "
                f"the kubelet speaks {list(self.speak)}"
            )
        if not info.endpoint.startswith("/"):
            return f"endpoint {info.endpoint!r} is not an absolute socket path"
        return ""

    # --- claims ---------------------------------------------------------------------------------

    def _api(self, driver: str) -> tuple[Any, Any]:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise RuntimeError(f"DRA driver {driver} is not registered with the kubelet")
        pb, grpc_mod = _VERSIONS[plugin.version]
        return pb, grpc_mod.DRAPluginStub(plugin.channel)

    async def prepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], rpc_timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """NodePrepareResources for (namespace, name, uid) claims: uid -> result message."""
        pb, stub = self._api(driver)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = await stub.NodePrepareResources(request, timeout=rpc_timeout_s)
        return dict(response.claims)

    async def unprepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]], rpc_timeout_s: float = 10.0
    ) -> dict[str, str]:
        """NodeUnprepareResources: uid -> error ('' on success)."""
        pb, stub = self._api(driver)
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = await stub.NodeUnprepareResources(request, timeout=rpc_timeout_s)
        return {uid: result.error for uid, result in response.claims.items()}

    async def start_container(
        self,
        namespace: str,
        pod: str,
        container: str,
        driver: str,
        claims: Sequence[tuple[str, str, str]],
    ) -> list[PreparedClaim]:
        """Prepare the pod's claims as the kubelet does before starting a container, and record
        the container as their user for PodResources. Raises RuntimeError naming a failed claim
        (the kubelet would not start the container)."""
        results = await self.prepare(driver, claims)
        prepared = []
        for ns, name, uid in claims:
            result = results.get(uid)
            if result is None:
                raise RuntimeError(f"claim {ns}/{name}: no answer from {driver}")
            if result.error:
                raise RuntimeError(f"claim {ns}/{name}: {result.error}")
            prepared.append(PreparedClaim(ns, name, uid, driver, list(result.devices)))
        if self.kubelet is not None:
            for claim in prepared:
                self.kubelet.dynamic.append(
                    DynamicAdmission(
                        namespace,
                        pod,
                        container,
                        claim.namespace,
                        claim.name,
                        driver,
                        [
                            (d.pool_name, d.device_name, list(d.cdi_device_ids))
                            for d in claim.devices
                        ],
                    )
                )
        return prepared

    async def remove_pod(
        self, namespace: str, pod: str, driver: str, claims: Sequence[tuple[str, str, str]]
    ) -> dict[str, str]:
        """The pod is gone: forget its containers, unprepare its claims."""
        if self.kubelet is not None:
            self.kubelet.dynamic = [
                d for d in self.kubelet.dynamic if (d.namespace, d.pod) != (namespace, pod)
            ]
        return await self.unprepare(driver, claims)

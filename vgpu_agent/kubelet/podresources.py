"""Which container holds which device: the kubelet's PodResources `List`, polled.

Allocate does not say which pod it serves; PodResources does, after the fact. `PodResourcesClient`
asks `List` on the kubelet's pod-resources socket and keeps, for our resource only, a map from
device ID to namespace/pod/container. `run()` refreshes it every few seconds and right after an
Allocate (`poke()`), and hands every good map to a callback (the region store's `reconcile`).
While the agent holds no region there is nothing to bind or collect: it then asks once a minute
(`IDLE_REFRESH_S`), and a new region pokes it as before.

The socket may be missing (an old kubelet, a hostPath not mounted) or the kubelet may be
restarting: the client then says once that it cannot map containers, counts every failure, keeps
the last good map and keeps trying. Nothing else in the agent waits for it.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc
import structlog

from vgpu_agent._proto.podresources.v1 import api_pb2, api_pb2_grpc
from vgpu_agent.dra.cdi import claim_uid_of

log = structlog.get_logger(__name__)
# A channel of its own connections (here and for `Register`): in gRPC's process-wide pool a new
# channel to a restarted kubelet may take over the connection a closed (or closing) one left in
# reconnect backoff, and its first call fails though the kubelet is back.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)

DEFAULT_TIMEOUT_S = 5.0
# After an Allocate the kubelet records the devices only once our answer reaches it, so a List
# sent at once would not show them yet; a short pause lets several Allocates share one List.
DEFAULT_POKE_DELAY_S = 0.5
# The period while `idle()` says nothing needs the map (no region): each List costs the idle
# agent about as much CPU as all its other periodic work together.
IDLE_REFRESH_S = 60.0


class ContainerRef(NamedTuple):
    namespace: str
    pod: str
    container: str


Assignments = dict[str, ContainerRef]
UpdateHook = Callable[[Assignments], Awaitable[object]]


class PodResourcesError(Exception):
    """`List` failed; the message names the socket and the reason."""

    def __init__(self, socket_path: str, reason: str):
        super().__init__(f"pod resources socket {socket_path}: {reason}")
        self.socket_path = socket_path
        self.reason = reason


class PodResourcesUnavailable(PodResourcesError):
    """The socket does not exist (or is not a socket): nothing to ask."""


def assignments_from(
    response: api_pb2.ListPodResourcesResponse, resource_name: str, dra_driver: str | None = None
) -> Assignments:
    """Device ID -> container, for `resource_name` only. A device listed twice keeps the last.

    With `dra_driver`, the devices of that driver's prepared claims (`dynamic_resources`) are
    included under the IDs their regions carry (`<claim uid>-<device>`); the claim's UID is
    read from the claim's CDI device name, the only place PodResources shows it.
    """
    if dra_driver is not None:  # DRA only: the device plugin registers without dra.grant
        from vgpu_agent.dra.grant import region_device_id
    found: Assignments = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = ContainerRef(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                if devices.resource_name != resource_name:
                    continue
                for device_id in devices.device_ids:
                    found[device_id] = ref
            if dra_driver is None:
                continue
            for claim in container.dynamic_resources:
                ours = [r for r in claim.claim_resources if r.driver_name == dra_driver]
                uids = {
                    uid
                    for r in ours
                    for cdi in r.cdi_devices
                    if (uid := claim_uid_of(cdi.name, dra_driver)) is not None
                }
                if len(uids) != 1:
                    continue  # not one of our prepared claims (or a confused answer)
                uid = uids.pop()
                for r in ours:
                    found[region_device_id(uid, r.device_name)] = ref
    return found


class PodResourcesClient:
    def __init__(
        self,
        socket_path: str,
        resource_name: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poke_delay_s: float = DEFAULT_POKE_DELAY_S,
        dra_driver: str | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"PodResources timeout must be > 0 s, got {timeout_s!r}")
        if not poke_delay_s >= 0:
            raise ValueError(f"PodResources poke delay must be >= 0 s, got {poke_delay_s!r}")
        self.socket_path = socket_path
        self.resource_name = resource_name
        self.dra_driver = dra_driver
        self.timeout_s = timeout_s
        self.poke_delay_s = poke_delay_s
        self.assignments: Assignments = {}  # the last good map; kept through failures
        self.failures = 0  # List calls that failed, for the metrics
        self.successes = 0
        self.available = False  # the last List succeeded
        self._channel: grpc.aio.Channel | None = None
        self._poked = asyncio.Event()

    async def list_assignments(self) -> Assignments:
        """One `List`: device ID -> container for our resource. Raises PodResourcesError."""
        try:
            mode = os.stat(self.socket_path).st_mode
        except FileNotFoundError:
            raise PodResourcesUnavailable(self.socket_path, "does not exist") from None
        except OSError as err:
            raise PodResourcesUnavailable(self.socket_path, f"cannot stat: {err}") from None
        if not stat.S_ISSOCK(mode):
            raise PodResourcesUnavailable(self.socket_path, "exists but is not a unix socket")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}",
                                                      options=OWN_CONNECTION)
        stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        try:
            response = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            # A fresh channel next time: a kubelet restart replaces the socket, and a channel that
            # failed would otherwise wait out gRPC's reconnect backoff before trying again.
            await self.close()
            raise PodResourcesError(
                self.socket_path, f"List failed with {err.code().name}: {err.details()}"
            ) from None
        return assignments_from(response, self.resource_name, self.dra_driver)

    async def refresh(self, on_update: UpdateHook | None = None) -> bool:
        """List once; on success remember the map and hand it to `on_update`. Never raises."""
        try:
            found = await self.list_assignments()
        except PodResourcesError as err:
            self.failures += 1
            if self.available or (self.successes == 0 and self.failures == 1):
                log.warning(
                    "pod_resources_unavailable",
                    socket=self.socket_path,
                    error=str(err),
                    effect="containers cannot be mapped to pods; regions are not collected; "
                    "metrics keep the last known labels",
                )
            else:
                log.debug("pod_resources_still_unavailable", error=str(err), failures=self.failures)
            self.available = False
            return False
        if not self.available and self.failures:
            log.info("pod_resources_available", socket=self.socket_path, failures=self.failures)
        self.available = True
        self.successes += 1
        self.assignments = found
        if on_update is not None:
            try:
                await on_update(found)
            except Exception as err:  # a bug downstream must not stop the mapping
                log.exception("pod_resources_update_failed", error=str(err))
        return True

    def poke(self) -> None:
        """Ask `run()` for a refresh soon (after an Allocate)."""
        self._poked.set()

    async def run(
        self,
        refresh_s: float = 5.0,
        on_update: UpdateHook | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """Refresh every `refresh_s` seconds (every `IDLE_REFRESH_S` at least while `idle()`)
        and shortly after each `poke()`, until cancelled."""
        if not refresh_s > 0:
            raise ValueError(f"PodResources refresh interval must be > 0 s, got {refresh_s!r}")
        try:
            while True:
                await self.refresh(on_update)
                await self._wait(max(refresh_s, IDLE_REFRESH_S) if idle and idle() else refresh_s)
        finally:
            await self.close()

    async def _wait(self, refresh_s: float) -> None:
        try:
            await asyncio.wait_for(self._poked.wait(), refresh_s)
        except TimeoutError:
            return
        await asyncio.sleep(self.poke_delay_s)
        self._poked.clear()  # pokes during the pause are served by the List that follows

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

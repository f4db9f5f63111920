"""The plugin's lifecycle against the kubelet: serve, register, notice restarts, serve again.

The kubelet deletes every plugin socket when it starts and recreates `kubelet.sock`, so a kubelet
restart shows up as a new `kubelet.sock` (another inode) or as our own socket vanishing. Either
restarts the plugin as a whole: stop the gRPC server, bind a fresh socket, register again.
Once registered, the directory is watched with inotify (`kubelet.dirwatch`): the two `stat` calls
run when an entry of the directory changes, and every `BACKSTOP_S` should inotify miss one.
Where inotify cannot be had they run every `watch_s` (0.5 s) instead; before registering, every
`poll_s` (0.1 s) while the kubelet's socket is missing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_agent.backoff import Backoff
from vgpu_agent.kubelet.dirwatch import DirWatch
from vgpu_agent.kubelet.podresources import OWN_CONNECTION

log = structlog.get_logger(__name__)

API_VERSION = "v1beta1"
BACKSTOP_S = 10.0  # sockets checked this often even with inotify watching the directory


@dataclass
class RegistrationStatus:
    """What the agent reports on /readyz and in metrics."""

    registered: bool = False
    registrations: int = 0
    kubelet_restarts: int = 0
    last_error: str = ""
    listeners: list[Callable[[], None]] = field(default_factory=list)


def check_plugin_dir(plugin_dir: str) -> None:
    """Raise OSError naming `plugin_dir` if the plugin socket cannot be created in it.

    Creating (and removing) a probe file is the only check that sees everything: a missing
    mount, a read-only file system, a file where a directory should be, missing permissions.
    """
    probe = os.path.join(plugin_dir, f".vgpu-agent-probe-{os.getpid()}")
    try:
        os.makedirs(plugin_dir, mode=0o755, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OSError(
            err.errno, f"device plugin dir {plugin_dir} is unusable: {err.strerror} ({probe})"
        ) from err


_FileId = tuple[int, int, int]  # device, inode, change time


def _inode(path: str) -> _FileId | None:
    """Which file `path` is: a socket removed and made again may reuse the inode number at
    once (ext4 and tmpfs do), so its change time tells the new one apart too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class PluginRunner:
    """Runs the device plugin server on `<plugin_dir>/<endpoint>` and keeps it registered."""

    def __init__(
        self,
        servicer: api_pb2_grpc.DevicePluginServicer,
        *,
        plugin_dir: str,
        endpoint: str,
        resource_name: str,
        poll_s: float = 0.1,
        register_timeout_s: float = 15.0,
        backoff_max_s: float = 5.0,
        watch_s: float = 0.5,
        dir_watch: Callable[[str], DirWatch | None] | None = DirWatch.open,
    ):
        self._servicer = servicer
        self._plugin_dir = plugin_dir
        self._endpoint = endpoint
        self._resource_name = resource_name
        self._poll_s = poll_s
        # Once registered, the sockets are checked less often: a kubelet restart takes seconds
        # anyway, and an idle agent should not wake ten times a second to stat two files.
        self._watch_s = max(poll_s, watch_s)
        self._dir_watch = dir_watch  # None: poll every `watch_s`
        self._register_timeout_s = register_timeout_s
        self._backoff_max_s = backoff_max_s
        self._server: grpc.aio.Server | None = None
        self.status = RegistrationStatus()

    @property
    def socket_path(self) -> str:
        return os.path.join(self._plugin_dir, self._endpoint)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self._plugin_dir, "kubelet.sock")

    async def run(self) -> None:
        """Until cancelled: wait for the kubelet, serve, register, and start over on restarts."""
        try:
            waited = False
            while True:
                kubelet = _inode(self.kubelet_socket)
                if kubelet is None:
                    if not waited:
                        log.info("kubelet_socket_waiting", path=self.kubelet_socket)
                        waited = True
                    self.status.registered = False
                    await asyncio.sleep(self._poll_s)
                    continue
                waited = False
                await self._serve()
                await self._register_with_backoff(kubelet)
                await self._watch(kubelet)
                self.status.kubelet_restarts += 1
                self.status.registered = False
                log.info("kubelet_restart_detected", kubelet_socket=self.kubelet_socket)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop serving and remove our socket (the kubelet then marks our devices unhealthy)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)
        self.status.registered = False
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        except OSError as err:
            # Said, not raised: this also runs on the way out, and a shutdown must finish.
            log.error("plugin_socket_remove_failed", path=self.socket_path, error=str(err))

    async def _serve(self) -> None:
        await self.stop()
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        await server.start()
        self._server = server
        log.info("plugin_serving", socket=self.socket_path)

    async def _register_with_backoff(self, kubelet: _FileId) -> None:
        backoff = Backoff(initial=0.1, cap=self._backoff_max_s, jitter=0)
        while True:
            try:
                await self._register()
                return
            except grpc.aio.AioRpcError as err:
                delay = backoff.next_delay()
                self.status.last_error = f"{err.code().name}: {err.details()}"
                log.warning(
                    "registration_failed",
                    code=err.code().name,
                    details=err.details(),
                    retry_in_s=round(delay, 2),
                )
            # A kubelet that restarted meanwhile needs a fresh server, not another attempt.
            if _inode(self.kubelet_socket) != kubelet or _inode(self.socket_path) is None:
                await self._serve()
                kubelet = _inode(self.kubelet_socket) or kubelet
            await asyncio.sleep(delay)

    async def _register(self) -> None:
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self._endpoint,
            resource_name=self._resource_name,
            options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        async with grpc.aio.insecure_channel(f"unix:{self.kubelet_socket}",
                                             options=OWN_CONNECTION) as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            await stub.Register(request, timeout=self._register_timeout_s)
        self.status.registered = True
        self.status.registrations += 1
        self.status.last_error = ""
        log.info(
            "registered",
            resource=self._resource_name,
            endpoint=self._endpoint,
            kubelet_socket=self.kubelet_socket,
        )
        for listener in self.status.listeners:
            listener()

    async def _watch(self, kubelet: _FileId) -> None:
        """Return when the kubelet restarted: its socket changed, or ours was deleted."""
        # opened before each check: a change between the two is not missed
        watch = self._open_watch()
        try:
            while True:
                if watch is not None and not watch.alive:  # the directory went: a new watch
                    watch.close()
                    watch = self._open_watch()  # or, failing that, polling from now on
                if _inode(self.kubelet_socket) != kubelet or _inode(self.socket_path) is None:
                    return
                if watch is not None:
                    await watch.wait(BACKSTOP_S)
                else:
                    await asyncio.sleep(self._watch_s)
        finally:
            if watch is not None:
                watch.close()

    def _open_watch(self) -> DirWatch | None:
        return self._dir_watch(self._plugin_dir) if self._dir_watch is not None else None

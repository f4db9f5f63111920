"""The plugin directory watched with inotify: a kubelet restart is seen at once without polling,
and where inotify cannot be had (or its directory goes) the runner polls as it did before."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.integration.plugin_harness import RESOURCE, short_dir
from vgpu_agent.deviceplugin import registration
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.deviceplugin.registration import PluginRunner
from vgpu_agent.deviceplugin.server import DevicePluginServicer, DeviceState
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kubelet import dirwatch
from vgpu_agent.kubelet.dirwatch import DirWatch
from vgpu_agent.kubelet.standin import KubeletStandIn

GPUS = [GpuInfo(0, "GPU-dw-0", "sim", 1 << 34, 0, "0000:00:01.0", 80, (8, 0))]


@pytest.fixture
def root() -> AsyncIterator[Path]:
    with short_dir() as path:
        yield path


def _bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


async def test_a_watch_wakes_on_entries_made_and_removed_and_only_then(root: Path) -> None:
    with DirWatch.open(str(root)) as watch:  # type: ignore[union-attr]
        assert watch is not None and watch.alive
        assert await watch.wait(0.1) is False  # nothing changed: it times out
        sock = _bind(root / "kubelet.sock")
        assert await watch.wait(2.0) is True
        sock.close()
        os.unlink(root / "kubelet.sock")
        assert await watch.wait(2.0) is True
        assert await watch.wait(0.1) is False  # each change wakes it once, not for ever
        (root / "sub").mkdir()
        (root / "sub" / "deeper").write_text("")  # below the directory: not its entries
        assert await watch.wait(2.0) is True  # the subdirectory itself was one
        assert await watch.wait(0.1) is False
        assert watch.alive


async def test_a_watch_whose_directory_goes_is_over_and_says_so(root: Path) -> None:
    directory = root / "dp"
    directory.mkdir()
    watch = DirWatch.open(str(directory))
    assert watch is not None
    try:
        directory.rmdir()
        assert await watch.wait(2.0) is True
        assert not watch.alive
        assert await watch.wait(5.0) is True  # at once, from then on
    finally:
        watch.close()
        watch.close()  # twice is harmless


async def test_no_watch_on_a_missing_directory_or_a_file(root: Path) -> None:
    assert DirWatch.open(str(root / "missing")) is None
    (root / "file").write_text("")
    assert DirWatch.open(str(root / "file")) is None


def test_no_watch_without_inotify_in_the_c_library_or_with_its_instances_used_up(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dirwatch, "_libc", lambda: None)
    assert DirWatch.open(str(root)) is None

    class NoInstancesLeft:  # the per-user limit on inotify instances reached: EMFILE
        @staticmethod
        def inotify_init1(flags: int) -> int:
            ctypes.set_errno(errno.EMFILE)
            return -1

    monkeypatch.setattr(dirwatch, "_libc", lambda: NoInstancesLeft())
    assert DirWatch.open(str(root)) is None


@contextlib.asynccontextmanager
async def _runner(
    root: Path, dir_watch: Callable[[str], DirWatch | None] | None
) -> AsyncIterator[tuple[KubeletStandIn, PluginRunner]]:
    plugin_dir = str(root / "dp")
    os.makedirs(plugin_dir)
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    servicer = DevicePluginServicer(DeviceState(GPUS, Split(2)), policy="spread",
                                    strategy="envvar")
    runner = PluginRunner(servicer, plugin_dir=plugin_dir, endpoint="vg.sock",
                          resource_name=RESOURCE, dir_watch=dir_watch)
    task = asyncio.create_task(runner.run())
    try:
        await kubelet.wait_for(lambda: len(kubelet.registrations) == 1, limit_s=15)
        yield kubelet, runner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kubelet.stop()


@pytest.mark.parametrize("watched", [True, False], ids=["inotify", "polling"])
async def test_a_kubelet_restart_is_followed_by_registration_within_a_second(
    root: Path, watched: bool
) -> None:
    opened: list[DirWatch | None] = []

    def dir_watch(path: str) -> DirWatch | None:
        opened.append(DirWatch.open(path) if watched else None)
        return opened[-1]

    async with _runner(root, dir_watch) as (kubelet, runner):
        await asyncio.sleep(0.2)  # the watch is in place
        for restart in (1, 2):
            await kubelet.restart()
            restarted = time.monotonic()
            await kubelet.wait_for(lambda: len(kubelet.registrations) == restart + 1, limit_s=5)
            assert kubelet.registrations[restart].at - restarted < 1.0
            assert runner.status.kubelet_restarts == restart
        assert len(opened) >= 2  # one watch for each registration (the last one's may be late)
        if watched:
            assert all(w is not None for w in opened)
            assert not any(w.alive for w in opened[:2] if w is not None)  # closed after use


async def test_with_inotify_an_idle_runner_checks_its_sockets_only_on_the_backstop(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = 0
    inode = registration._inode

    def counted(path: str) -> tuple[int, int, int] | None:
        nonlocal checks
        checks += 1
        return inode(path)

    monkeypatch.setattr(registration, "_inode", counted)
    async with _runner(root, DirWatch.open):
        await asyncio.sleep(0.2)
        before = checks
        await asyncio.sleep(1.5)  # three polls' worth at `watch_s` without the watch
        assert checks == before
        (root / "dp" / "other-plugin.sock").write_text("")  # another plugin's entry: one check
        await asyncio.sleep(0.2)
        # kubelet.sock and ours, once per read of the watch: the file's creation and its write
        # usually come in one read, on a loaded machine possibly in two
        assert checks - before in (2, 4)


async def test_a_plugin_directory_replaced_under_the_watch_is_watched_anew(root: Path) -> None:
    async with _runner(root, DirWatch.open) as (kubelet, runner):
        await asyncio.sleep(0.2)
        (root / "dp").rename(root / "dp-old")  # a hostPath remounted, say: the watch is over
        (root / "dp").mkdir()
        await kubelet.restart()  # into the new directory
        await kubelet.wait_for(lambda: len(kubelet.registrations) >= 2, limit_s=5)
        assert runner.status.kubelet_restarts >= 1
        assert (root / "dp" / "vg.sock").exists()

"""Regions through the real Allocate path and the PodResources API of a kubelet stand-in.

The device plugin servicer runs with `RegionStore.on_grant` as its hook and registers with the
stand-in; the stand-in admits containers (GetPreferredAllocation + Allocate) and serves
PodResources `List`; the store's clock is a hand-driven CLOCK_MONOTONIC so grace periods pass
without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from tests.fakes.clock import ManualClock
from tests.integration.plugin_harness import short_dir
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.deviceplugin.ids import parse_device_id
from vgpu_agent.deviceplugin.registration import PluginRunner
from vgpu_agent.deviceplugin.server import DevicePluginServicer, DeviceState
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kubelet.podresources import ContainerRef, PodResourcesClient
from vgpu_agent.kubelet.standin import Admission, KubeletStandIn
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import RegionStore

RESOURCE = "nvidia.com/gpu"
GIB = 1 << 30
S = 1_000_000_000
GPUS = [
    GpuInfo(0, "GPU-11111111-2222-3333-4444-555555555555", "NVIDIA A100", 80 * GIB, 0, "0:1:0.0"),
    GpuInfo(1, "GPU-66666666-7777-8888-9999-000000000000", "NVIDIA L4", 24 * GIB, 1, "0:2:0.0"),
]
SPLIT = Split(4)


@dataclass
class Node:
    root: Path
    store: RegionStore
    kubelet: KubeletStandIn
    client: PodResourcesClient
    clock: ManualClock

    async def admit(self, pod: str, count: int = 1, ns: str = "default") -> Admission:
        return await self.kubelet.admit(ns, pod, "main", RESOURCE, count)

    async def admit_ids(self, pod: str, ids: list[str]) -> Admission:
        """Admit a container on exactly these IDs (the kubelet reusing freed IDs)."""
        response = await self.kubelet.allocate(RESOURCE, ids)
        admission = Admission("default", pod, "main", RESOURCE, ids, response)
        self.kubelet.admissions.append(admission)
        return admission

    async def sync(self) -> dict[str, str]:
        """One PodResources refresh feeding the store, as the agent's refresher does."""
        removed: dict[str, str] = {}

        async def update(assignments: dict[str, ContainerRef]) -> None:
            removed.update(await self.store.reconcile(assignments))

        assert await self.client.refresh(update)
        return removed


@contextlib.asynccontextmanager
async def node(*, grace_s: float = 30.0, shim: bool = True, adopt: bool = True,
               offload_io: bool = False) -> AsyncIterator[Node]:
    with short_dir() as root:
        clock = ManualClock(1_000 * S)
        store = RegionStore(root / "state", gc_grace_s=grace_s, clock=clock,
                            offload_io=offload_io)
        if shim:
            store.shim_dir.mkdir(parents=True)
            (store.shim_dir / "libvgpu.so").write_bytes(b"\x7fELF")
            (store.shim_dir / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
        if adopt:
            store.adopt()
        plugin_dir = str(root / "dp")
        os.makedirs(plugin_dir)
        kubelet = KubeletStandIn(plugin_dir, str(root / "pr" / "kubelet.sock"))
        await kubelet.start()
        servicer = DevicePluginServicer(
            DeviceState(GPUS, SPLIT), policy="spread", strategy="envvar",
            on_grant=store.on_grant,
        )
        runner = PluginRunner(servicer, plugin_dir=plugin_dir, endpoint="vg.sock",
                              resource_name=RESOURCE)
        task = asyncio.create_task(runner.run())
        client = PodResourcesClient(str(root / "pr" / "kubelet.sock"), RESOURCE)
        try:
            await kubelet.wait_for(lambda: len(kubelet.free_devices(RESOURCE)) == 8, limit_s=15)
            yield Node(root, store, kubelet, client, clock)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()
            await kubelet.stop()
            store.close()


def expected_limits(device_ids: list[str]) -> dict[str, tuple[int, int]]:
    """uuid -> (memory bytes, core ppm) computed from the split, independently of the code."""
    per_gpu: dict[str, int] = {}
    for device_id in device_ids:
        uuid, _ = parse_device_id(device_id)
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    gpus = {g.uuid: g for g in GPUS}
    return {
        uuid: (n * (gpus[uuid].memory_total // 4), n * 250_000) for uuid, n in per_gpu.items()
    }


@pytest.mark.parametrize("offload_io", [False, True], ids=["on-loop", "in-thread"])
async def test_allocate_creates_the_region_and_answers_with_its_mounts(offload_io: bool) -> None:
    async with node(offload_io=offload_io) as n:
        admission = await n.admit("train", count=2)
        regions = n.store.regions()
        assert len(regions) == 1
        region = regions[0]
        host_dir = n.root / "state" / "regions" / region.alloc_id

        mounts = {m.container_path: (m.host_path, m.read_only) for m in admission.response.mounts}
        assert mounts == {
            # the files, never the directory: the container can create nothing in the state dir
            "/run/vgpu/control": (str(host_dir / "control"), True),
            "/run/vgpu/state": (str(host_dir / "state"), False),
            "/run/vgpu/hami.cache": (str(host_dir / "hami.cache"), False),
            "/usr/local/vgpu/libvgpu.so": (str(n.root / "state" / "shim" / "libvgpu.so"), True),
            "/etc/ld.so.preload": (str(n.root / "state" / "shim" / "ld.so.preload"), True),
        }
        envs = dict(admission.response.envs)
        assert envs["VGPU_REGION_DIR"] == "/run/vgpu"
        assert envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/run/vgpu/hami.cache"
        assert "NVIDIA_VISIBLE_DEVICES" in envs  # the servicer's own variables are still there

        control = layout.decode_control((host_dir / "control").read_bytes())
        assert control.device_ids == tuple(admission.device_ids)
        assert control.seq == 1 and control.priority == 0 and control.generation == 0
        assert control.created_ns == n.clock.ns
        limits = {d.uuid: (d.memory_limit, d.core_limit) for d in control.devices}
        assert limits == expected_limits(admission.device_ids)
        assert {d.policy for d in control.devices} == {layout.POLICY_STRICT}
        assert {(d.rate, d.burst) for d in control.devices} == {(0, 0)}  # never configured

        state = layout.decode_state((host_dir / "state").read_bytes(), len(control.devices))
        assert not state.corrupt and state.processes == ()
        assert stat.S_IMODE(os.stat(host_dir / "control").st_mode) == 0o444
        assert stat.S_IMODE(os.stat(host_dir / "state").st_mode) == 0o666
        assert os.stat(host_dir / "state").st_size == layout.STATE_SIZE

        # The region handle the controller and metrics get says the same.
        for dev, uuid in enumerate(region.device_uuids):
            memory, ppm = limits[uuid]
            assert region.memory_limit(dev) == memory
            assert region.core_limit(dev) == pytest.approx(ppm / 10_000)
            assert region.policy(dev) == "strict"
        assert n.store.counters.created == 1


async def test_each_container_gets_its_own_region_in_creation_order() -> None:
    async with node() as n:
        first = await n.admit("a")
        second = await n.admit("b")
        regions = n.store.regions()
        assert [r.seq for r in regions] == [1, 2]
        assert [r.alloc_id for r in regions] == sorted(r.alloc_id for r in regions)
        assert [r.device_ids for r in regions] == [
            tuple(first.device_ids), tuple(second.device_ids)
        ]
        dirs = {dict((m.container_path, m.host_path) for m in a.response.mounts)[
                    "/run/vgpu/state"] for a in (first, second)}
        assert len(dirs) == 2
        # the list is the caller's (the store sorts once per change, not once per call)
        regions.clear()
        assert [r.seq for r in n.store.regions()] == [1, 2]
        await n.admit("c")
        assert [r.seq for r in n.store.regions()] == [1, 2, 3]


async def test_without_an_installed_shim_the_container_still_gets_its_region() -> None:
    async with node(shim=False) as n:
        admission = await n.admit("train")
        paths = {m.container_path for m in admission.response.mounts}
        # a missing file would block the start
        assert paths == {"/run/vgpu/control", "/run/vgpu/state", "/run/vgpu/hami.cache"}
        assert n.store.counters.shim_missing == 1
        assert len(n.store.regions()) == 1


def _install_shim(store: RegionStore) -> None:
    store.shim_dir.mkdir(parents=True, exist_ok=True)
    (store.shim_dir / "libvgpu.so").write_bytes(b"\x7fELF")
    (store.shim_dir / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")


async def test_a_missing_shim_is_logged_once_per_outage_and_counted_every_time() -> None:
    async with node(shim=False) as n:
        with capture_logs() as logs:
            for pod in ("a", "b", "c"):
                await n.admit(pod)
            _install_shim(n.store)
            installed = await n.admit("d")
            (n.store.shim_dir / "libvgpu.so").unlink()  # gone again (a node cleanup, say)
            await n.admit("e")
            await n.admit("f")
        events = [e["event"] for e in logs if e["event"].startswith("shim_")]
        assert events == ["shim_not_installed", "shim_installed", "shim_not_installed"]
        assert n.store.counters.shim_missing == 5
        paths = {m.container_path for m in installed.response.mounts}
        assert "/etc/ld.so.preload" in paths
        assert len(n.store.regions()) == 6


async def test_allocate_fails_when_the_region_cannot_be_created() -> None:
    async with node(adopt=False) as n:
        (n.root / "state").mkdir(exist_ok=True)
        (n.root / "state" / "regions").write_text("not a directory")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await n.admit("train")
        assert failure.value.code() == grpc.StatusCode.INTERNAL
        assert "cannot create region" in failure.value.details()
        assert n.store.counters.create_failures == 1 and n.store.regions() == []


async def test_region_is_bound_then_collected_after_its_pod_is_gone() -> None:
    async with node(grace_s=30) as n:
        await n.admit("keeper")  # still listed: the answers that follow are evidence
        admission = await n.admit("train")
        keeper, region = n.store.regions()
        assert n.store.identity(region.alloc_id) is None  # PodResources not asked yet
        assert await n.sync() == {}
        assert n.store.identity(region.alloc_id) == ("default", "train", "main")

        n.kubelet.remove_pod("default", "train")
        n.clock.advance(60)
        assert await n.sync() == {}  # first seen unheld now: the grace period starts
        assert region.path.exists()
        assert n.store.identity(region.alloc_id) == ("default", "train", "main")  # last known
        n.clock.advance(29)
        assert await n.sync() == {}
        n.clock.advance(1)
        removed = await n.sync()
        assert removed == {region.alloc_id: "no container holds its device IDs"}
        assert not region.path.exists() and region.closed
        assert region not in n.store.regions() and n.store.identity(region.alloc_id) is None
        assert n.store.counters.removed == 1
        left = os.listdir(n.root / "state" / "regions")
        # no .gc- leftover; only spare directories prepared for the next Allocate
        assert [e for e in left if not e.startswith(".new-spare-")] == [keeper.alloc_id]
        del admission


async def test_ids_reused_by_a_new_container_go_to_the_new_region() -> None:
    async with node(grace_s=30) as n:
        first = await n.admit("old")
        await n.sync()
        old_region = n.store.regions()[0]

        n.kubelet.remove_pod("default", "old")
        n.clock.advance(5)  # the same IDs come back before the old region was collected
        await n.admit_ids("new", list(first.device_ids))
        new_region = max(n.store.regions(), key=lambda r: r.seq)
        assert new_region.device_ids == old_region.device_ids
        assert new_region.seq > old_region.seq

        n.clock.advance(40)
        removed = await n.sync()
        assert n.store.identity(new_region.alloc_id) == ("default", "new", "main")
        assert removed == {
            old_region.alloc_id: "superseded by a newer region of the same device IDs"
        }
        assert [r.alloc_id for r in n.store.regions()] == [new_region.alloc_id]
        assert new_region.path.exists() and not old_region.path.exists()


async def test_region_not_yet_listed_is_kept_through_the_lag() -> None:
    async with node(grace_s=30) as n:
        await n.admit_ids("keeper", [f"{GPUS[0].uuid}::0"])
        # Allocate happened but the container never shows up in PodResources.
        await n.kubelet.allocate(RESOURCE, [f"{GPUS[1].uuid}::3"])
        region = n.store.regions()[1]
        n.clock.advance(10)
        assert await n.sync() == {}  # first seen unheld 10 s after Allocate
        n.clock.advance(20)
        assert await n.sync() == {}  # 30 s old, but unheld for 20 s only
        n.clock.advance(9)
        assert await n.sync() == {}
        n.clock.advance(1)
        assert await n.sync() == {region.alloc_id: "no container holds its device IDs"}


async def test_nothing_is_collected_while_pod_resources_is_unavailable() -> None:
    async with node(grace_s=1) as n:
        await n.admit("train")
        await n.sync()
        n.kubelet.remove_pod("default", "train")
        await n.kubelet.stop()  # the PodResources socket goes away with it
        n.clock.advance(3600)
        assert not await n.client.refresh(n.store.reconcile)
        assert n.client.failures == 1
        assert len(n.store.regions()) == 1
        assert n.client.assignments  # the last good map is kept


async def test_spare_directories_take_the_block_reservation_off_later_allocates(tmp_path):
    from vgpu_agent.deviceplugin.allocation import Split, grant
    from vgpu_agent.gpu.sim import build_inventory
    from vgpu_agent.shm import layout
    from vgpu_agent.shm.regions import SPARES_PER_SHAPE, RegionStore

    gpus = {g.uuid: g for g in build_inventory("2xA100-80GB")}
    one, two = (grant([f"{u}::{n}" for u in list(gpus)[:k]], gpus, Split(4)) for k, n in ((1, 0), (2, 1)))
    store = RegionStore(str(tmp_path))
    root = tmp_path / "regions"
    first = await store.on_grant(one)
    for _ in range(50):  # spares are made in a thread after the Allocate
        if len([e for e in os.listdir(root) if e.startswith(".new-spare-")]) == SPARES_PER_SHAPE:
            break
        await asyncio.sleep(0.02)
    spares = sorted(e for e in os.listdir(root) if e.startswith(".new-spare-"))
    assert len(spares) == SPARES_PER_SHAPE
    await store.on_grant(one)  # takes a spare of its shape
    regions = store.regions()
    assert len(regions) == 2
    assert len(set(spares) & set(os.listdir(root))) == SPARES_PER_SHAPE - 1
    # a region made from a spare is a complete region: its state header says its device count
    usage = regions[1].usage()
    assert not usage.corrupt and usage.memory_used == (0,)
    assert os.stat(regions[1].path / "state").st_size == layout.STATE_SIZE
    # another shape never takes a one-device spare
    await store.on_grant(two)
    assert store.regions()[2].usage().memory_used == (0, 0)
    assert first.envs["VGPU_REGION_DIR"]
    store.close()
    assert not [e for e in os.listdir(root) if e.startswith(".new-spare-")]
    # leftovers of a crash are removed when the next agent adopts
    os.mkdir(root / ".new-spare-999-0")
    RegionStore(str(tmp_path)).adopt()
    assert not (root / ".new-spare-999-0").exists()


async def test_closing_while_a_spare_is_being_written_leaves_no_directory_behind(
    tmp_path, monkeypatch
):
    """`close` cannot wait for the worker thread writing a spare: whatever that thread
    finishes after the close is deleted by the thread itself, and nothing new is started."""
    import threading

    from vgpu_agent.deviceplugin.allocation import Split, grant
    from vgpu_agent.gpu.sim import build_inventory

    gpus = {g.uuid: g for g in build_inventory("1xA100-80GB")}
    one = grant([f"{next(iter(gpus))}::0"], gpus, Split(4))
    store = RegionStore(str(tmp_path))
    root = tmp_path / "regions"
    writing, release = threading.Event(), threading.Event()
    write_state = store._write_state

    def slow_write(path, device_count):
        if path.parent.name.startswith(".new-spare-"):
            writing.set()
            assert release.wait(5)
        write_state(path, device_count)

    monkeypatch.setattr(store, "_write_state", slow_write)
    await store.on_grant(one)  # starts spares in worker threads
    assert await asyncio.to_thread(writing.wait, 5)
    with capture_logs() as logs:
        store.close()  # while a spare's state file is half-written
        release.set()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not [e for e in os.listdir(root) if e.startswith(".new-spare-")]:
                break
    assert not [e for e in os.listdir(root) if e.startswith(".new-spare-")]
    assert not [e for e in logs if e["event"] == "region_spare_failed"]
    # a closed store makes no more spares
    with pytest.raises(OSError, match="closed"):
        store._make_spare(1)
    assert not [e for e in os.listdir(root) if e.startswith(".new-spare-")]


async def test_the_store_tells_of_every_region_added_created_or_adopted(tmp_path):
    """The throttle controller sleeps while there are no regions: every way a region comes to
    exist (Allocate, DRA's create, adoption after a restart) must tell it."""
    from vgpu_agent.deviceplugin.allocation import Split, grant
    from vgpu_agent.gpu.sim import build_inventory

    gpus = {g.uuid: g for g in build_inventory("1xA100-80GB")}
    uuid = next(iter(gpus))
    store = RegionStore(str(tmp_path))
    added: list[int] = []
    store.on_added = lambda: added.append(len(store.regions()))
    await store.on_grant(grant([f"{uuid}::0"], gpus, Split(4)))
    store.create(grant([f"{uuid}::1"], gpus, Split(4)))
    assert added == [1, 2]  # told after the region is listed, so a tick woken by it sees it
    store.close()
    again = RegionStore(str(tmp_path))
    adopted: list[int] = []
    again.on_added = lambda: adopted.append(len(again.regions()))
    assert len(again.adopt()) == 2
    assert adopted == [1, 2]
    again.close()

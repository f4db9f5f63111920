"""The ResourceSlice publisher against the fake API server: publishes, follows GPU health,
repairs what others change, never duplicates, survives restarts and API failures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.dra_allocator import allocate_in
from tests.fakes.kubeapi import NODE, FakeKubeAPI, gpu
from vgpu_agent.config import Config
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.slices import slice_name
from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.healthstate import HealthChange
from vgpu_agent.gpu.sim import SimBackend, build_inventory
from vgpu_agent.kube.node import KubeConfigError
from vgpu_agent.kube.resourceslices import DEFAULT_DRIVER, ResourceSlicePublisher

DRIVER = "gpu.vgpu.io"
NAME = slice_name(NODE, DRIVER)
GPUS = [gpu(0), gpu(1)]


@dataclass
class Feed:
    """A health feed with the monitor's interface."""

    state: dict[str, bool] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    queues: list[asyncio.Queue[Any]] = field(default_factory=list)

    def subscribe(self) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Any]) -> None:
        self.queues.remove(queue)

    def healthy(self) -> dict[str, bool]:
        return dict(self.state)

    def reason(self, uuid: str) -> str:
        return self.reasons.get(uuid, "")

    def report(self, change: HealthChange) -> None:
        self.state[change.uuid] = change.healthy
        self.reasons[change.uuid] = change.reason
        for queue in self.queues:
            queue.put_nowait(change)


@dataclass
class Running:
    api: FakeKubeAPI
    feed: Feed
    publisher: ResourceSlicePublisher
    task: asyncio.Task[None]
    kubeconfig: Path

    def slices(self) -> list[dict[str, Any]]:
        return self.api.resources.slices(node=NODE)

    def mine(self) -> dict[str, Any]:
        return self.api.resources.get("resourceslices", NAME)

    def writes(self) -> list[str]:
        return [
            f"{r.method} {r.path}"
            for r in self.api.requests
            if r.method in ("POST", "PUT", "PATCH", "DELETE") and "resourceslices" in r.path
        ]

    async def settled(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until the stored state satisfies predicate and the publisher is idle."""
        async with asyncio.timeout(within):
            while True:
                await asyncio.sleep(0.02)
                try:
                    if predicate():
                        return
                except KeyError:
                    pass


def publisher_for(kubeconfig: Path, feed: Feed | None, **options: Any) -> ResourceSlicePublisher:
    settings: dict[str, Any] = {
        "kubeconfig": str(kubeconfig),
        "health": feed,
        "driver_version": "550.54.15",
        "request_timeout": 0.5,
        "backoff_initial": 0.02,
        "backoff_cap": 0.1,
        "resync_seconds": 60.0,
        **options,
    }
    return ResourceSlicePublisher(NODE, DRIVER, GPUS, Split(4), **settings)


@contextlib.asynccontextmanager
async def started(publisher: ResourceSlicePublisher) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(publisher.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    feed = Feed()
    publisher = publisher_for(kubeconfig, feed)
    async with started(publisher) as task:
        run = Running(api, feed, publisher, task, kubeconfig)
        await run.settled(lambda: len(run.slices()) == 1)
        # the watch is open: from now on every GET of the slices is a reconcile's list
        await run.settled(lambda: len(api.resources.watchers) == 1)
        yield run
    await api.stop()


def taints_of(item: dict[str, Any]) -> dict[str, list[str]]:
    return {
        d["name"]: [f"{t['key']}={t['value']}:{t['effect']}" for t in d.get("taints", [])]
        for d in item["spec"]["devices"]
    }


async def test_publishes_one_slice_owned_by_the_node(running: Running) -> None:
    item = running.mine()
    node_uid = running.api.nodes[NODE]["metadata"]["uid"]
    assert item["metadata"]["ownerReferences"][0]["uid"] == node_uid
    assert item["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "vgpu-agent"
    assert item["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in item["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert item["spec"]["devices"][0]["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert running.writes() == ["POST /apis/resource.k8s.io/v1/resourceslices"]
    # nothing changes, so a resync writes nothing
    before = running.publisher.reconciles
    running.publisher._wake.set()
    await running.settled(lambda: running.publisher.reconciles > before)
    assert len(running.writes()) == 1


async def test_a_critical_xid_taints_the_device_and_recovery_removes_it(running: Running) -> None:
    uuid = GPUS[1].uuid
    running.feed.report(HealthChange(uuid, False, "critical XID 48", 48))
    await running.settled(lambda: taints_of(running.mine())["gpu-1"] != [])
    item = running.mine()
    assert taints_of(item) == {"gpu-0": [], "gpu-1": [f"{DRIVER}/xid=48:NoSchedule"]}
    assert item["spec"]["pool"]["generation"] == 2
    added = item["spec"]["devices"][1]["taints"][0]["timeAdded"]

    # another GPU gets lost: the first taint keeps its time
    running.feed.report(HealthChange(GPUS[0].uuid, False,
                                     "NVML query failed: check on x failed: GPU is lost"))
    await running.settled(lambda: taints_of(running.mine())["gpu-0"] != [])
    item = running.mine()
    assert taints_of(item)["gpu-0"] == [f"{DRIVER}/gpu-lost=true:NoExecute"]
    assert item["spec"]["devices"][1]["taints"][0]["timeAdded"] == added
    assert item["spec"]["pool"]["generation"] == 3

    for g in GPUS:
        running.feed.report(HealthChange(g.uuid, True, "recovered"))
    await running.settled(lambda: taints_of(running.mine()) == {"gpu-0": [], "gpu-1": []})
    assert running.mine()["spec"]["pool"]["generation"] >= 4


async def test_a_tainted_gpu_gets_no_new_claims(running: Running) -> None:
    running.api.resources.create("deviceclasses", "", {
        "metadata": {"name": "vgpu"},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    })
    running.feed.report(HealthChange(GPUS[0].uuid, False, "critical XID 48", 48))
    await running.settled(lambda: taints_of(running.mine())["gpu-0"] != [])
    running.api.resources.create("resourceclaims", "team", {
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "vgpu", "capacity": {"requests": {"memory": "10Gi"}}}}]}},
    })
    claim = allocate_in(running.api.resources, "team", "c")
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"


async def test_edits_by_others_are_repaired_with_a_new_generation(running: Running) -> None:
    def vandalise(item: dict[str, Any]) -> None:
        item["spec"]["devices"] = item["spec"]["devices"][:1]
        item["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Ti"
        item["metadata"]["labels"] = {"someone": "else"}

    running.api.resources.edit("resourceslices", NAME, vandalise)
    await running.settled(lambda: len(running.mine()["spec"]["devices"]) == 2)
    item = running.mine()
    assert item["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"
    assert item["spec"]["pool"]["generation"] == 2
    # labels of others are kept, ours restored
    assert item["metadata"]["labels"] == {
        "someone": "else", "app.kubernetes.io/managed-by": "vgpu-agent"
    }


async def test_a_deleted_slice_comes_back_with_a_higher_generation(running: Running) -> None:
    running.feed.report(HealthChange(GPUS[0].uuid, False, "critical XID 48", 48))
    await running.settled(lambda: running.mine()["spec"]["pool"]["generation"] == 2)
    running.api.resources.delete("resourceslices", "", NAME)
    await running.settled(lambda: len(running.slices()) == 1)
    assert running.mine()["spec"]["pool"]["generation"] == 3


async def test_duplicates_and_slices_of_a_driver_no_longer_served_are_removed(
    running: Running,
) -> None:
    store = running.api.resources
    mine = running.mine()
    duplicate = {"metadata": {"generateName": f"{NODE}-{DRIVER}-"}, "spec": {
        **mine["spec"], "pool": {**mine["spec"]["pool"], "generation": 5}}}
    store.create("resourceslices", "", duplicate)
    stale = {
        "metadata": {"name": "old-driver", "labels": {"app.kubernetes.io/managed-by": "vgpu-agent"}},
        "spec": {**mine["spec"], "driver": "old.vgpu.io"},
    }
    store.create("resourceslices", "", stale)
    foreign = {"metadata": {"name": "nvidia"}, "spec": {**mine["spec"], "driver": "gpu.nvidia.com"}}
    store.create("resourceslices", "", foreign)
    elsewhere = {"metadata": {"name": "node-b"}, "spec": {
        **mine["spec"], "nodeName": "node-b", "pool": {**mine["spec"]["pool"], "name": "node-b"}}}
    store.create("resourceslices", "", elsewhere)

    await running.settled(
        lambda: sorted(s["metadata"]["name"] for s in store.slices()) == [NAME, "node-b", "nvidia"]
    )
    # the survivor's generation passes the duplicate's, so the scheduler trusts it
    await running.settled(lambda: running.mine()["spec"]["pool"]["generation"] == 6)


async def test_a_restarted_agent_adopts_its_slice_without_writing(running: Running) -> None:
    running.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running.task
    before = len(running.writes())
    rv = running.mine()["metadata"]["resourceVersion"]
    again = publisher_for(running.kubeconfig, Feed())
    async with started(again):
        await again.wait_for(lambda p: p.reconciles >= 1)
    assert len(running.writes()) == before
    assert running.mine()["metadata"]["resourceVersion"] == rv
    assert len(running.slices()) == 1


async def test_a_restart_with_an_unhealthy_gpu_taints_at_once(running: Running) -> None:
    running.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running.task
    feed = Feed(state={GPUS[0].uuid: False}, reasons={GPUS[0].uuid: "critical XID 31"})
    again = publisher_for(running.kubeconfig, feed)
    async with started(again):
        await again.wait_for(lambda p: p.reconciles >= 1)
    assert taints_of(running.mine())["gpu-0"] == [f"{DRIVER}/xid=31:NoSchedule"]
    assert running.mine()["spec"]["pool"]["generation"] == 2


async def test_a_conflicting_write_is_retried_at_once(running: Running) -> None:
    store = running.api.resources
    # between the publisher's list and its update, someone else changes the slice
    running.api.before(
        "PUT",
        lambda: store.edit("resourceslices", NAME,
                           lambda s: s["metadata"].setdefault("annotations", {}).update(x="y")),
        path="/resourceslices/",
    )
    running.feed.report(HealthChange(GPUS[0].uuid, False, "critical XID 48", 48))
    await running.settled(lambda: taints_of(running.mine())["gpu-0"] != [])
    statuses = [r.status for r in running.api.requests if r.method == "PUT"]
    assert 409 in statuses and statuses[-1] == 200
    assert running.mine()["metadata"]["annotations"] == {"x": "y"}


async def test_api_errors_and_timeouts_are_retried(running: Running) -> None:
    running.api.fail(500, times=3, method="PUT", path="/resourceslices/")
    running.api.stall(2.0, times=1, method="PUT", path="/resourceslices/")
    running.feed.report(HealthChange(GPUS[0].uuid, False, "critical XID 48", 48))
    await running.publisher.wait_for(
        lambda p: p.last_error is not None and "500" in p.last_error
    )
    await running.publisher.wait_for(
        lambda p: p.last_error is None and p.published is not None
        and bool(p.published.spec["devices"][0].get("taints")),
        within=10,
    )
    assert taints_of(running.mine())["gpu-0"] == [f"{DRIVER}/xid=48:NoSchedule"]
    failed = [r.status for r in running.api.requests if "resourceslices" in r.path]
    assert failed.count(500) == 3


async def test_an_api_server_down_at_start_and_restarted(tmp_path: Path) -> None:
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    await api.stop()
    publisher = publisher_for(kubeconfig, None)
    async with started(publisher):
        await publisher.wait_for(lambda p: p.last_error is not None)
        assert publisher.published is None
        await api.start()
        await publisher.wait_for(lambda p: p.published is not None)
        # the server restarts (watches dropped); a later deletion is still noticed
        await api.stop()
        await api.start()
        await asyncio.sleep(0.3)
        api.resources.delete("resourceslices", "", NAME)
        async with asyncio.timeout(5):
            while not api.resources.slices():
                await asyncio.sleep(0.02)
    await api.stop()


async def test_missing_api_configuration_is_named(tmp_path: Path) -> None:
    publisher = ResourceSlicePublisher(NODE, DRIVER, GPUS, Split(2), environ={})
    with pytest.raises(KubeConfigError, match="no Kubernetes API configuration"):
        await publisher.run()
    broken = ResourceSlicePublisher(
        NODE, DRIVER, GPUS, Split(2), kubeconfig=str(tmp_path / "missing"), environ={}
    )
    with pytest.raises(KubeConfigError, match="missing"):
        await broken.run()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="node_name"):
        ResourceSlicePublisher("", DRIVER, GPUS, Split(2))
    with pytest.raises(ValueError, match="resync_seconds"):
        ResourceSlicePublisher(NODE, DRIVER, GPUS, Split(2), resync_seconds=0)
    with pytest.raises(ValueError, match="driver name 'GPU_io'"):
        ResourceSlicePublisher(NODE, "GPU_io", GPUS, Split(2))


async def test_withdraw_deletes_only_this_agents_slices(running: Running) -> None:
    store = running.api.resources
    mine = running.mine()
    store.create("resourceslices", "", {"metadata": {"name": "nvidia"},
                                        "spec": {**mine["spec"], "driver": "gpu.nvidia.com"}})
    running.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running.task
    leaving = publisher_for(running.kubeconfig, None)
    assert await leaving.withdraw() == 1
    await leaving.close()
    assert [s["metadata"]["name"] for s in store.slices()] == ["nvidia"]


async def test_the_health_monitor_feeds_it(tmp_path: Path) -> None:
    """With the agent's own health monitor over the simulated backend."""
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    backend = SimBackend("2xA100-80GB")
    backend.start()
    gpus = build_inventory("2xA100-80GB")
    monitor = HealthMonitor(backend, gpus, frozenset(), recovery_period_s=0,
                            check_interval_s=0.05, xid_wait_ms=20)
    publisher = ResourceSlicePublisher(
        NODE, DRIVER, gpus, Split(4), kubeconfig=str(api.write_kubeconfig(tmp_path / "k")),
        health=monitor, backoff_initial=0.02, backoff_cap=0.1,
    )
    watcher = asyncio.create_task(monitor.run())
    try:
        async with started(publisher):
            await publisher.wait_for(lambda p: p.published is not None)
            backend.inject_xid(gpus[1].uuid, 48)
            await publisher.wait_for(
                lambda p: p.published is not None
                and bool(p.published.spec["devices"][1].get("taints"))
            )
            backend.set_lost(gpus[0].uuid)
            await publisher.wait_for(
                lambda p: p.published is not None
                and bool(p.published.spec["devices"][0].get("taints"))
            )
        stored = api.resources.get("resourceslices", NAME)
        assert taints_of(stored) == {
            "gpu-0": [f"{DRIVER}/gpu-lost=true:NoExecute"],
            "gpu-1": [f"{DRIVER}/xid=48:NoSchedule"],
        }
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await api.stop()


async def test_run_again_after_it_ended_works_with_one_subscription(running: Running) -> None:
    """As the agent's supervisor does after a failure: the same publisher runs again."""
    assert len(running.feed.queues) == 1
    running.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running.task
    assert running.feed.queues == []
    async with started(running.publisher):
        await running.publisher.wait_for(lambda p: len(running.feed.queues) == 1)
        running.feed.report(HealthChange(GPUS[1].uuid, False, "critical XID 48", 48))
        await running.settled(lambda: taints_of(running.mine())["gpu-1"] != [])
        assert len(running.feed.queues) == 1
    assert len(running.slices()) == 1


def test_from_config_takes_the_split_driver_and_driver_version() -> None:
    config = Config(node_name=NODE, kubeconfig="/k", split_count=2, memory_scaling=0.5)
    monitor = types.SimpleNamespace(backend=types.SimpleNamespace(driver_version="550.54.15"))
    publisher = ResourceSlicePublisher.from_config(config, GPUS, health=monitor)  # type: ignore[arg-type]
    assert (publisher.node_name, publisher.driver) == (NODE, DEFAULT_DRIVER)
    assert publisher.split == Split(2, 0.5, 1.0)
    assert publisher.driver_version == "550.54.15"
    named = dataclasses.replace(config, dra_driver_name="other.vgpu.io")
    other = ResourceSlicePublisher.from_config(named, GPUS, driver_version="1.2.3")
    assert (other.driver, other.driver_version) == ("other.vgpu.io", "1.2.3")

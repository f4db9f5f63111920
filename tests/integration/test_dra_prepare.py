"""NodePrepareResources / NodeUnprepareResources through the real gRPC sockets and stand-in.

The driver runs with real regions, CDI spec files and checkpoint under a temporary root; the
kubelet DRA stand-in registers it through the plugin watcher and calls it as the kubelet does.
Claims are read through `read_claim`, here a dict of claim objects with faults on demand (the
fake API server's path is covered by the end-to-end test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.integration.plugin_harness import short_dir
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra import cdi
from vgpu_agent.dra.checkpoint import Checkpoint
from vgpu_agent.dra.claims import ClaimReadError
from vgpu_agent.dra.driver import DraDriver
from vgpu_agent.dra.grant import ClaimPriorityBound, device_table
from vgpu_agent.dra.server import DraPluginRunner
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kubelet.drastandin import DraKubeletStandIn
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import RegionStore

DRIVER = "gpu.vgpu.io"
NODE = "node-a"
GIB = 1 << 30
GPUS = [
    GpuInfo(0, "GPU-11111111-2222-3333-4444-555555555555", "NVIDIA A100", 80 * GIB, 0, "0:1:0.0"),
    GpuInfo(1, "GPU-66666666-7777-8888-9999-000000000000", "NVIDIA L4", 24 * GIB, 1, "0:2:0.0"),
]


def uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def claim_obj(n, memory="10Gi", cores="30", device="gpu-0", config=(), share="s1", pool=NODE):
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": pool,
        "device": device,
        "shareID": share,
        "consumedCapacity": {"memory": memory, "cores": cores},
    }
    return {
        "metadata": {"namespace": "ns", "name": f"claim-{n}", "uid": uid(n)},
        "status": {"allocation": {"devices": {"results": [result], "config": list(config)}}},
    }


@dataclass
class Api:
    """Claims by name, with faults: `down` raises as an unreachable server does."""

    claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    reads: int = 0
    down: bool = False
    delay_s: float = 0.0

    def add(self, obj: dict[str, Any]) -> tuple[str, str, str]:
        meta = obj["metadata"]
        self.claims[meta["name"]] = obj
        return meta["namespace"], meta["name"], meta["uid"]

    async def read(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise ClaimReadError(
                f"ResourceClaim {namespace}/{name}: Kubernetes API unreachable; the kubelet retries"
            )
        if name not in self.claims:
            raise ClaimReadError(f"ResourceClaim {namespace}/{name} not found: deleted")
        return json.loads(json.dumps(self.claims[name]))


@dataclass
class Node:
    root: Path
    api: Api
    store: RegionStore
    driver: DraDriver
    runner: DraPluginRunner
    kubelet: DraKubeletStandIn
    task: asyncio.Task[None]

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"


def build_driver(root: Path, api: Api, store: RegionStore) -> DraDriver:
    return DraDriver(
        driver=DRIVER,
        node=NODE,
        devices=lambda: device_table(GPUS, Split(4)),
        read_claim=api.read,
        regions=store,
        cdi_dir=str(root / "cdi"),
        checkpoint=Checkpoint(root / "plugins" / DRIVER / "checkpoint.json"),
    )


@contextlib.asynccontextmanager
async def running(root: Path, api: Api, kubelet: DraKubeletStandIn | None = None):
    store = RegionStore(root / "state", gc_grace_s=0)
    await asyncio.to_thread(store.adopt)
    driver = build_driver(root, api, store)
    driver.restore()
    runner = DraPluginRunner(
        driver,
        driver_name=DRIVER,
        dra_socket=str(root / "plugins" / DRIVER / "dra.sock"),
        registration_socket=str(root / "registry" / f"{DRIVER}-reg.sock"),
        check_interval_s=0.05,
    )
    own_kubelet = kubelet is None
    if kubelet is None:
        kubelet = DraKubeletStandIn(str(root / "registry"), str(root / "plugins"))
        await kubelet.start()
    seen = kubelet.registrations  # a shared kubelet may still hold an earlier agent's driver
    node = Node(root, api, store, driver, runner, kubelet, asyncio.create_task(runner.run()))
    try:
        await kubelet.wait_registered(DRIVER, after=seen)
        yield node
    finally:
        node.task.cancel()  # the test may have replaced it
        with contextlib.suppress(asyncio.CancelledError):
            await node.task
        if own_kubelet:
            await kubelet.stop()
        store.close()


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    with short_dir() as root:
        async with running(root, Api()) as n:
            yield n


def region_of(node: Node, claim_uid: str):
    prepared = node.driver.prepared[claim_uid]
    return node.store.get(prepared.alloc_id)


async def test_a_claim_setting_itself_a_priority_beyond_the_nodes_rules_is_refused(node):
    # as the agent builds its driver: a claim's own priority is held to pod_priority_max and,
    # above 0, to pod_priority_namespaces; its DeviceClass's is not
    node.driver.priority_bound = ClaimPriorityBound(most=100, namespaces=frozenset())
    ref = node.api.add(claim_obj(1, config=[_opaque({"priority": 2**31 - 1})]))
    result = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    assert "priority is 2147483647" in result.error and "up to 100" in result.error
    assert "ns/claim-1" in result.error and uid(1) not in node.driver.prepared
    class_set = {**_opaque({"priority": 2**31 - 1}), "source": "FromClass"}
    ref = node.api.add(claim_obj(2, config=[class_set]))
    result = (await node.kubelet.prepare(DRIVER, [ref]))[uid(2)]
    assert result.error == "" and region_of(node, uid(2)).priority == 2**31 - 1


async def test_registration_answers_what_the_plugin_watcher_checks(node):
    plugin = node.kubelet.plugins[DRIVER]
    assert plugin.endpoint == str(node.root / "plugins" / DRIVER / "dra.sock")
    assert plugin.version == "v1.DRAPlugin"
    assert node.runner.status.registered is True and node.runner.status.error == ""


async def test_prepare_makes_the_region_spec_and_answer_of_exactly_the_grant(node):
    ref = node.api.add(claim_obj(1, config=[_opaque({"corePolicy": "off", "priority": 7})]))
    results = await node.kubelet.prepare(DRIVER, [ref])
    result = results[uid(1)]
    assert result.error == ""
    (device,) = result.devices
    assert (device.pool_name, device.device_name, device.share_id) == (NODE, "gpu-0", "s1")
    assert list(device.request_names) == ["gpu"]
    assert list(device.cdi_device_ids) == [
        f"nvidia.com/gpu={GPUS[0].uuid}",
        f"{DRIVER}/claim={uid(1)}",
    ]
    region = region_of(node, uid(1))
    assert region.memory_limit(0) == 10 * GIB
    assert region.core_limit(0) == pytest.approx(30.0)
    assert region.policy(0) == "off" and region.priority == 7
    assert region.device_ids == (f"{uid(1)}-gpu-0",)
    spec = json.loads((node.cdi_dir / cdi.spec_name(DRIVER, uid(1))).read_text())
    assert spec["kind"] == f"{DRIVER}/claim"
    (cdi_device,) = spec["devices"]
    assert cdi_device["name"] == uid(1)
    env = dict(e.split("=", 1) for e in cdi_device["containerEdits"]["env"])
    assert env["VGPU_MEMORY_LIMIT_0"] == "10240m" and env["VGPU_CORE_LIMIT_0"] == "30"
    assert env["VGPU_REGION_DIR"] == "/run/vgpu"
    mounts = {m["containerPath"]: m for m in cdi_device["containerEdits"]["mounts"]}
    # the region's files, never its directory; `control` read-only, the others writable
    assert "/run/vgpu" not in mounts
    assert mounts["/run/vgpu/state"]["hostPath"] == str(region.path / "state")
    assert "ro" in mounts["/run/vgpu/control"]["options"]
    assert "ro" not in mounts["/run/vgpu/state"]["options"]
    assert "ro" not in mounts["/run/vgpu/hami.cache"]["options"]
    assert not list(node.cdi_dir.glob(".*"))  # no temporary file left behind
    saved = json.loads((node.root / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert saved["claims"][uid(1)]["allocId"] == region.alloc_id


async def test_v1beta1_kubelet_gets_the_same_answer_without_share_id():
    with short_dir() as root:
        kubelet = DraKubeletStandIn(
            str(root / "registry"), str(root / "plugins"), speak=("v1beta1.DRAPlugin",)
        )
        await kubelet.start()
        try:
            async with running(root, Api(), kubelet) as node:
                assert node.kubelet.plugins[DRIVER].version == "v1beta1.DRAPlugin"
                ref = node.api.add(claim_obj(1))
                result = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
                assert result.error == ""
                assert not hasattr(result.devices[0], "share_id")
                assert list(result.devices[0].cdi_device_ids)[1] == f"{DRIVER}/claim={uid(1)}"
                assert (await node.kubelet.unprepare(DRIVER, [ref])) == {uid(1): ""}
        finally:
            await kubelet.stop()


async def test_prepare_again_is_the_same_answer_without_reading_or_creating(node):
    ref = node.api.add(claim_obj(1))
    first = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    reads, regions = node.api.reads, len(node.store.regions())
    again = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    assert again == first
    assert node.api.reads == reads and len(node.store.regions()) == regions


async def test_concurrent_prepares_of_one_claim_make_one_region(node):
    ref = node.api.add(claim_obj(1))
    node.api.delay_s = 0.05
    answers = await asyncio.gather(*(node.kubelet.prepare(DRIVER, [ref]) for _ in range(5)))
    assert len({a[uid(1)].SerializeToString() for a in answers}) == 1
    assert len(node.store.regions()) == 1
    assert node.api.reads == 1


async def test_concurrent_claims_cannot_both_take_the_last_of_a_gpu(node):
    node.api.delay_s = 0.02
    refs = [node.api.add(claim_obj(n, memory="50Gi", cores="10", share=f"s{n}")) for n in (1, 2)]
    answers = await asyncio.gather(*(node.kubelet.prepare(DRIVER, [r]) for r in refs))
    errors = [a[r[2]].error for a, r in zip(answers, refs, strict=True)]
    assert sorted(bool(e) for e in errors) == [False, True]
    assert "already hold" in next(e for e in errors if e)
    assert len(node.store.regions()) == 1


async def test_per_claim_errors_never_fail_the_others(node):
    good = node.api.add(claim_obj(1))
    deleted = ("ns", "claim-2", uid(2))  # allocated, then deleted before Prepare
    other_node = node.api.add(claim_obj(3, pool="node-b"))
    bad_params = node.api.add(claim_obj(4, config=[_opaque({"corePolicy": "x", "cores": 3})]))
    too_big = node.api.add(claim_obj(5, memory="81Gi"))
    recreated = node.api.add(claim_obj(6))
    node.api.claims["claim-6"]["metadata"]["uid"] = "another-uid"
    refs = [good, deleted, other_node, bad_params, too_big, recreated]
    results = await node.kubelet.prepare(DRIVER, refs)
    assert set(results) == {r[2] for r in refs}
    assert results[uid(1)].error == ""
    assert "not found: deleted" in results[uid(2)].error
    assert "pool 'node-b'" in results[uid(3)].error
    assert "unknown field(s) cores" in results[uid(4)].error
    assert "consumedCapacity.memory" in results[uid(5)].error
    assert "uid 'another-uid'" in results[uid(6)].error
    assert len(node.store.regions()) == 1
    assert set(node.driver.prepared) == {uid(1)}
    assert [p.name for p in node.cdi_dir.iterdir()] == [cdi.spec_name(DRIVER, uid(1))]


async def test_api_down_is_a_clear_claim_error_and_the_retry_succeeds(node):
    ref = node.api.add(claim_obj(1))
    node.api.down = True
    failed = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    assert "unreachable" in failed.error and not failed.devices
    assert node.store.regions() == []
    node.api.down = False
    assert (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)].error == ""


async def test_unprepare_removes_region_and_spec_and_is_idempotent(node):
    ref = node.api.add(claim_obj(1))
    await node.kubelet.prepare(DRIVER, [ref])
    path = region_of(node, uid(1)).path
    assert (await node.kubelet.unprepare(DRIVER, [ref])) == {uid(1): ""}
    assert not path.exists() and node.store.regions() == []
    assert list(node.cdi_dir.iterdir()) == []
    assert node.driver.prepared == {}
    assert (await node.kubelet.unprepare(DRIVER, [ref])) == {uid(1): ""}  # unknown: done


async def test_prepared_region_survives_reconcile_until_unprepare(node):
    ref = node.api.add(claim_obj(1))
    await node.kubelet.prepare(DRIVER, [ref])
    someone = {"GPU-x::0": ("ns", "other", "main")}
    assert await node.store.reconcile(someone) == {}  # nobody holds it yet (image pull): kept
    assert len(node.store.regions()) == 1


async def test_agent_restart_keeps_claims_and_unprepares_them_later():
    with short_dir() as root:
        api = Api()
        ref = api.add(claim_obj(1))
        kubelet = DraKubeletStandIn(str(root / "registry"), str(root / "plugins"))
        await kubelet.start()
        try:
            async with running(root, api, kubelet) as node:
                first = (await kubelet.prepare(DRIVER, [ref]))[uid(1)]
                alloc_id = node.driver.prepared[uid(1)].alloc_id
            api.down = True  # a restarted agent needs no API for claims it prepared
            async with running(root, api, kubelet) as node:
                assert (await kubelet.prepare(DRIVER, [ref]))[uid(1)] == first
                region = node.store.get(alloc_id)
                assert region is not None and region.memory_limit(0) == 10 * GIB
                someone = {"GPU-x::0": ("ns", "other", "main")}
                assert await node.store.reconcile(someone) == {}  # still pinned after adoption
                assert (await kubelet.unprepare(DRIVER, [ref])) == {uid(1): ""}
                assert node.store.get(alloc_id) is None
                assert not (node.cdi_dir / cdi.spec_name(DRIVER, uid(1))).exists()
        finally:
            await kubelet.stop()


async def test_corrupt_checkpoint_is_set_aside_and_its_leftovers_cleaned():
    with short_dir() as root:
        api = Api()
        ref = api.add(claim_obj(1))
        async with running(root, api) as node:
            await node.kubelet.prepare(DRIVER, [ref])
        checkpoint = root / "plugins" / DRIVER / "checkpoint.json"
        doc = json.loads(checkpoint.read_text())
        doc["claims"][uid(1)]["consumed"] = {}  # edited by hand: the checksum no longer fits
        checkpoint.write_text(json.dumps(doc))
        (root / "cdi" / f".{cdi.spec_name(DRIVER, uid(9))}.tmp").write_text("{")
        with capture_logs() as logs:
            async with running(root, api) as node:
                assert node.driver.prepared == {}
                assert list(node.cdi_dir.iterdir()) == []  # unowned specs and temp files gone
                # no longer pinned: collected once PodResources shows it held by nobody
                someone = {"GPU-x::0": ("ns", "other", "main")}
                removed = await node.store.reconcile(someone)
                assert len(removed) == 1
                # the kubelet prepares it again: a fresh region from the API's allocation
                assert (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)].error == ""
        assert any(e["event"] == "dra_checkpoint_corrupt" for e in logs)
        assert list(checkpoint.parent.glob("checkpoint.json.corrupt-*"))


async def test_unusable_cdi_dir_fails_the_claim_and_leaves_nothing(node):
    node.cdi_dir.write_text("not a directory")
    ref = node.api.add(claim_obj(1))
    result = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    assert "File exists" in result.error or "Not a directory" in result.error
    assert result.error.startswith(f"claim ns/claim-1 ({uid(1)}): ")  # the claim is named
    assert node.store.regions() == [] and node.driver.prepared == {}


async def test_failed_checkpoint_write_rolls_the_claim_back(node, monkeypatch):
    def broken_save() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(node.driver._checkpoint, "save", broken_save)
    ref = node.api.add(claim_obj(1))
    result = (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)]
    assert "No space left" in result.error
    assert node.store.regions() == [] and list(node.cdi_dir.iterdir()) == []
    assert node.driver.prepared == {}


async def test_kubelet_restart_wipes_sockets_and_the_driver_registers_again(node):
    before = node.api.add(claim_obj(2, memory="1Gi", share="s2"))
    first = (await node.kubelet.prepare(DRIVER, [before]))[uid(2)]
    serves = node.runner.serves
    await node.kubelet.restart()
    await node.kubelet.wait_registered(DRIVER)  # restart() forgot every plugin
    assert node.runner.serves == serves + 1
    assert node.runner.status.registrations >= 2
    assert node.runner.kubelet_restarts == 1
    ref = node.api.add(claim_obj(1))
    assert (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)].error == ""
    # a claim prepared before the restart: the kubelet prepares it again, then unprepares it
    assert (await node.kubelet.prepare(DRIVER, [before]))[uid(2)] == first
    alloc_id = node.driver.prepared[uid(2)].alloc_id
    assert (await node.kubelet.unprepare(DRIVER, [before])) == {uid(2): ""}
    assert node.store.get(alloc_id) is None


async def test_a_refused_registration_is_an_error_with_the_kubelets_reason():
    with short_dir() as root:
        kubelet = DraKubeletStandIn(str(root / "registry"), str(root / "plugins"))
        kubelet.refuse[DRIVER] = "driver gpu.vgpu.io is already registered by another plugin"
        await kubelet.start()
        store = RegionStore(root / "state")
        runner = DraPluginRunner(
            build_driver(root, Api(), store),
            driver_name=DRIVER,
            dra_socket=str(root / "plugins" / DRIVER / "dra.sock"),
            registration_socket=str(root / "registry" / f"{DRIVER}-reg.sock"),
        )
        with capture_logs() as logs:
            task = asyncio.create_task(runner.run())
            try:
                async with asyncio.timeout(5):
                    while runner.status.registered is None:
                        await asyncio.sleep(0.02)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await kubelet.stop()
                store.close()
        assert runner.status.registered is False
        assert "already registered" in runner.status.error
        (event,) = [e for e in logs if e["event"] == "dra_registration_rejected"]
        assert event["log_level"] == "error" and "already registered" in event["reason"]
        # the sockets are gone after shutdown
        assert not (root / "registry" / f"{DRIVER}-reg.sock").exists()


def _opaque(params):
    return {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}}


def test_region_layout_holds_the_claim_device_ids():
    assert len(f"{uid(1)}-gpu-15".encode()) < layout.DEVICE_ID_LEN


async def test_a_container_holding_two_claims_labels_both_regions(node):
    from vgpu_agent.kubelet.podresources import ContainerRef

    refs = [node.api.add(claim_obj(n, memory="1Gi", cores="5", share=f"s{n}")) for n in (1, 2)]
    await node.kubelet.prepare(DRIVER, refs)
    ctr = ContainerRef("ns", "pod", "main")
    other = ContainerRef("ns", "other", "main")
    held = {f"{uid(1)}-gpu-0": ctr, f"{uid(2)}-gpu-0": ctr, "GPU-x::0": other}
    assert await node.store.reconcile(held) == {}
    for n in (1, 2):
        assert node.store.identity(node.driver.prepared[uid(n)].alloc_id) == tuple(ctr)
    # the container is gone: the regions stay (pinned) and keep their last labels
    assert await node.store.reconcile({"GPU-x::0": other}) == {}
    assert node.store.identity(node.driver.prepared[uid(1)].alloc_id) == tuple(ctr)


async def test_unusable_registry_dir_is_retried_until_it_works():
    with short_dir() as root:
        (root / "registry").write_text("a file where the kubelet's directory should be")
        store = RegionStore(root / "state")
        runner = DraPluginRunner(
            build_driver(root, Api(), store),
            driver_name=DRIVER,
            dra_socket=str(root / "plugins" / DRIVER / "dra.sock"),
            registration_socket=str(root / "registry" / f"{DRIVER}-reg.sock"),
            check_interval_s=0.05,
        )
        with capture_logs() as logs:
            task = asyncio.create_task(runner.run())
            try:
                for _ in range(100):
                    if any(e["event"] == "dra_serve_failed" for e in logs):
                        break
                    await asyncio.sleep(0.02)
                assert not runner.serving.is_set()
                (root / "registry").unlink()  # the kubelet comes up and makes its directory
                (root / "registry").mkdir()
                kubelet = DraKubeletStandIn(str(root / "registry"), str(root / "plugins"))
                await kubelet.start()
                try:
                    await kubelet.wait_registered(DRIVER)
                finally:
                    await kubelet.stop()
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                store.close()
        failed = [e for e in logs if e["event"] == "dra_serve_failed"]
        assert failed and "retry_in_s" in failed[0]
        assert not (root / "plugins" / DRIVER / "dra.sock").exists()  # removed on the way out


async def test_a_stopped_driver_is_deregistered_until_it_serves_again(node):
    node.task.cancel()  # the agent stops: it removes its sockets on the way out
    with contextlib.suppress(asyncio.CancelledError):
        await node.task
    for _ in range(100):
        if DRIVER not in node.kubelet.plugins:
            break
        await asyncio.sleep(0.02)
    assert DRIVER not in node.kubelet.plugins  # as the kubelet's watcher does on deletion
    with pytest.raises(RuntimeError, match="not registered"):
        await node.kubelet.prepare(DRIVER, [("ns", "claim-1", uid(1))])
    seen = node.kubelet.registrations
    node.task = asyncio.create_task(node.runner.run())  # the agent is back
    await node.kubelet.wait_registered(DRIVER, after=seen)
    ref = node.api.add(claim_obj(1))
    assert (await node.kubelet.prepare(DRIVER, [ref]))[uid(1)].error == ""

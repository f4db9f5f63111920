"""Publishes and keeps this node's DRA ResourceSlice (kubernetes_asyncio, resource.k8s.io/v1).

Usage (DRA mode; the composition runs `run()` as a supervised task):

    publisher = ResourceSlicePublisher.from_config(config, gpus, health=health_monitor)
    group.create_task(publisher.run())        # or supervise it; it runs until cancelled

or with explicit arguments:

    ResourceSlicePublisher(node_name, driver_name, gpus, split, kubeconfig=...,
                           health=feed, driver_version="550.54.15")

`health` is anything with `subscribe() -> asyncio.Queue` of health changes (`uuid`, `healthy`,
`reason`, `xid`, optionally `lost`), `healthy() -> {uuid: bool}` and `reason(uuid) -> str`:
`gpu.health.HealthMonitor` is one. Instead (or as well), `on_health_change(change)` may be
registered as a listener; it never blocks and may be called from any thread.

What `run()` does, until cancelled:
- loads the API configuration (an explicit kubeconfig, else in-cluster); DRA mode cannot work
  without the API, so an unusable or missing configuration raises `KubeConfigError`;
- reconciles: lists the ResourceSlices of this node (`fieldSelector=spec.nodeName=<node>`),
  keeps the one named `slice_name(node, driver)`, deletes any other slice of this node for this
  driver (a duplicate) and any slice of this node that this agent labelled for another driver
  (one it no longer serves), then creates the slice if missing, or replaces it (with its
  resourceVersion as precondition; a 409 re-reads at once) when the devices, labels or owner
  differ; `pool.generation` goes one past the highest seen whenever the devices change, so it
  never goes back across restarts;
- reconciles again on a health change (a critical XID taints the GPU's device within one
  round trip), on a watch event showing someone else changed or deleted a slice of this node,
  and every `resync_seconds`;
- retries every API failure with the shared backoff, without blocking anything else.
`withdraw()` deletes this agent's slices of this node (for leaving DRA mode).

API calls made (the DaemonSet's RBAC grants exactly these):
    GET    /api/v1/nodes/{node}                                  nodes: get (the owner's uid)
    GET    /apis/resource.k8s.io/v1/resourceslices               resourceslices: list, watch
    POST   /apis/resource.k8s.io/v1/resourceslices               resourceslices: create
    PUT    /apis/resource.k8s.io/v1/resourceslices/{name}        resourceslices: update
    DELETE /apis/resource.k8s.io/v1/resourceslices/{name}        resourceslices: delete
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
from kubernetes_asyncio import client

from vgpu_agent.backoff import Backoff
from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.slices import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    DeviceHealth,
    build_spec,
    carry_taint_times,
    classify_health,
    metadata_current,
    same_devices,
    slice_name,
    slice_object,
)
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kube.apiclient import (
    SERVICE_ACCOUNT_DIR,
    ApiException,
    call_json,
    describe,
    load_configuration,
    status_of,
)
from vgpu_agent.kube.coreapi import CoreApi

log = structlog.get_logger(__name__)

DEFAULT_DRIVER = "gpu.vgpu.io"
_REJECTED = frozenset({400, 403, 413, 415, 422})
_RACES = frozenset({404, 409})  # someone else wrote in between: re-read at once
_FREE_RETRIES = 3


class HealthFeed(Protocol):
    def subscribe(self) -> asyncio.Queue[Any]: ...

    def healthy(self) -> dict[str, bool]: ...

    def reason(self, uuid: str) -> str: ...


@dataclass(frozen=True)
class Published:
    """What the API server holds after the latest successful reconcile."""

    name: str
    generation: int
    resource_version: str
    spec: dict[str, Any]


class ResourceSlicePublisher:
    """Keeps this node's ResourceSlice equal to the GPUs and their health."""

    def __init__(
        self,
        node_name: str,
        driver_name: str,
        gpus: Sequence[GpuInfo],
        split: Split,
        *,
        kubeconfig: str | None = None,
        in_cluster: bool | None = None,
        health: HealthFeed | None = None,
        driver_version: str | None = None,
        request_timeout: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_cap: float = 60.0,
        resync_seconds: float = 300.0,
        watch_seconds: int = 300,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ):
        if not node_name:
            raise ValueError("node_name is empty: DRA mode needs the node's name (NODE_NAME)")
        if not driver_name:
            raise ValueError("driver_name is empty: name the DRA driver, e.g. gpu.vgpu.io")
        if resync_seconds <= 0 or watch_seconds < 1:
            raise ValueError(
                f"resync_seconds {resync_seconds!r} must be > 0 and watch_seconds "
                f"{watch_seconds!r} >= 1"
            )
        Backoff(backoff_initial, backoff_cap)  # bad pacing fails here, not inside run()
        self.node_name = node_name
        self.driver = driver_name
        self.gpus = list(gpus)
        self.split = split
        self.driver_version = driver_version
        self._kubeconfig = kubeconfig
        self._in_cluster = in_cluster
        self._feed = health
        self._timeout = request_timeout
        self._backoff = (backoff_initial, backoff_cap)
        self._resync = resync_seconds
        self._watch_seconds = watch_seconds
        self._environ = dict(os.environ if environ is None else environ)
        self._sa_dir = service_account_dir
        # check the inventory can be published at all before anything runs
        build_spec(node_name, driver_name, self.gpus, split, {}, 1, driver_version)

        self._health: dict[str, DeviceHealth] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._api_client: client.ApiClient | None = None
        self._api: client.ResourceV1Api | None = None
        self._core_api: CoreApi | None = None
        self._node_uid: str | None = None
        self._generation = 0  # the highest pool generation seen or written
        self._written: set[str] = set()  # resourceVersions of our own writes
        # what the write in flight stores: its watch event may come before its answer
        self._expected: dict[str, Any] | None = None
        self._deleted: set[str] = set()  # uids of slices we deleted
        self.published: Published | None = None
        self.reconciles = 0
        self.last_error: str | None = None
        self._changed = asyncio.Condition()

    @classmethod
    def from_config(
        cls,
        config: Any,
        gpus: Sequence[GpuInfo],
        health: HealthFeed | None = None,
        driver_version: str | None = None,
        **options: Any,
    ) -> ResourceSlicePublisher:
        """From the agent's Config: node_name, kubeconfig, split_count, memory_scaling,
        cores_scaling and dra_driver_name (default gpu.vgpu.io). Without `driver_version`, the
        health feed's backend is asked (the NVML backend knows it once started)."""
        if driver_version is None:
            backend = getattr(health, "backend", None)
            driver_version = getattr(backend, "driver_version", None)
        return cls(
            config.node_name,
            getattr(config, "dra_driver_name", None) or DEFAULT_DRIVER,
            gpus,
            Split(config.split_count, config.memory_scaling, config.cores_scaling),
            kubeconfig=config.kubeconfig,
            health=health,
            driver_version=driver_version if isinstance(driver_version, str) else None,
            **options,
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the API configuration; KubeConfigError if there is none or it is unusable."""
        self._loop = asyncio.get_running_loop()
        configuration = await load_configuration(
            self._kubeconfig, self._in_cluster, self._environ, self._sa_dir
        )
        self._api_client = client.ApiClient(configuration=configuration)
        self._api = client.ResourceV1Api(self._api_client)
        self._core_api = CoreApi(self._api_client)
        log.info(
            "resourceslice_publisher_started",
            node=self.node_name,
            driver=self.driver,
            server=configuration.host,
            gpus=len(self.gpus),
        )

    async def run(self) -> None:
        """Publish and keep the slice until cancelled."""
        if self._api is None:
            await self.start()
        queue = self._feed.subscribe() if self._feed is not None else None
        try:
            if self._feed is not None:
                for uuid, ok in self._feed.healthy().items():
                    if not ok:
                        self._health[uuid] = classify_health(False, self._feed.reason(uuid))
            self._wake.set()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._reconcile_loop(), name="dra-slices-reconcile")
                group.create_task(self._watch_loop(), name="dra-slices-watch")
                group.create_task(self._resync_loop(), name="dra-slices-resync")
                if queue is not None:
                    group.create_task(self._health_loop(queue), name="dra-slices-health")
        finally:
            unsubscribe = getattr(self._feed, "unsubscribe", None)
            if queue is not None and unsubscribe is not None:
                unsubscribe(queue)  # a supervisor may run() again: one queue per run
            await self.close()

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
            self._api = None
            self._core_api = None

    async def withdraw(self) -> int:
        """Delete this agent's slices of this node (any driver); returns how many."""
        if self._api is None:
            await self.start()
        assert self._api is not None
        items = await self._list()
        doomed = [s for s in items if self._ours(s)]
        for item in doomed:
            await self._delete(item, why="withdrawn")
        return len(doomed)

    # --- what callers use -----------------------------------------------------------------

    def on_health_change(self, change: Any) -> None:
        """Record a GPU health change and reconcile soon. Never blocks; any thread."""
        health = classify_health(
            change.healthy, change.reason, change.xid, getattr(change, "lost", None)
        )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is not None and running is not self._loop:
            self._loop.call_soon_threadsafe(self._set_health, change.uuid, health)
        else:
            self._set_health(change.uuid, health)

    async def wait_for(self, predicate: Any, within: float = 5.0) -> None:
        """Wait until predicate(publisher) holds after a reconcile, successful or not (tests,
        benchmarks)."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    # --- workers --------------------------------------------------------------------------

    def _set_health(self, uuid: str, health: DeviceHealth) -> None:
        if self._health.get(uuid, DeviceHealth()) == health:
            return
        self._health[uuid] = health
        self._wake.set()

    async def _health_loop(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            self.on_health_change(await queue.get())

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self._resync)
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        backoff = Backoff(*self._backoff)
        races = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._reconcile()
            except Exception as exc:
                status = status_of(exc)
                self.last_error = describe(exc)
                if status in _RACES and races < _FREE_RETRIES:
                    races += 1
                    log.info("resourceslice_race_retrying", node=self.node_name,
                             error=self.last_error)
                    self._wake.set()
                    continue
                delay = backoff.next_delay()
                emit = log.error if status in _REJECTED else log.warning
                emit(
                    "resourceslice_publish_failed",
                    node=self.node_name,
                    driver=self.driver,
                    error=self.last_error,
                    attempt=backoff.failures,
                    retry_in_s=round(delay, 3),
                )
                async with self._changed:
                    self._changed.notify_all()
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            races = 0
            backoff.reset()
            self.last_error = None
            self.reconciles += 1
            async with self._changed:
                self._changed.notify_all()

    async def _reconcile(self) -> None:
        assert self._api is not None
        if self._node_uid is None:
            await self._learn_node_uid()
        items = await self._list()
        name = slice_name(self.node_name, self.driver)
        keeper = None
        for item in items:
            if item["spec"].get("driver") == self.driver:
                self._generation = max(self._generation, _generation_of(item))
                if item["metadata"]["name"] == name:
                    keeper = item
        for item in items:
            if item is not keeper and self._ours(item):
                why = "duplicate" if item["spec"].get("driver") == self.driver else (
                    "driver no longer served"
                )
                await self._delete(item, why=why)

        health = dict(self._health)
        spec = build_spec(
            self.node_name, self.driver, self.gpus, self.split, health, 0, self.driver_version
        )
        wanted = slice_object(self.node_name, self.driver, spec, self._node_uid)
        if keeper is None:
            spec["pool"]["generation"] = self._generation + 1
            self._expected = wanted
            stored = await call_json(self._api.create_resource_slice, wanted,
                                     request_timeout=self._timeout)
            self._remember(stored, "created")
            return
        devices_current = same_devices(keeper["spec"], spec)
        if devices_current and _generation_of(keeper) >= self._generation and metadata_current(
            keeper, wanted
        ):
            self._remember(keeper, None)
            return
        spec["pool"]["generation"] = (
            _generation_of(keeper) if devices_current and _generation_of(keeper) >= self._generation
            else self._generation + 1
        )
        carry_taint_times(spec, keeper["spec"])
        meta = wanted["metadata"]
        meta["resourceVersion"] = keeper["metadata"]["resourceVersion"]
        meta["labels"] = {**(keeper["metadata"].get("labels") or {}), **meta["labels"]}
        if keeper["metadata"].get("annotations"):
            meta["annotations"] = keeper["metadata"]["annotations"]
        if "ownerReferences" not in meta and keeper["metadata"].get("ownerReferences"):
            meta["ownerReferences"] = keeper["metadata"]["ownerReferences"]
        self._expected = wanted
        stored = await call_json(
            self._api.replace_resource_slice, name, wanted, request_timeout=self._timeout
        )
        self._remember(stored, "updated")

    def _remember(self, stored: dict[str, Any], action: str | None) -> None:
        generation = _generation_of(stored)
        self._generation = max(self._generation, generation)
        rv = stored["metadata"]["resourceVersion"]
        self._written.add(rv)
        if len(self._written) > 1000:
            self._written = {rv}
        self.published = Published(stored["metadata"]["name"], generation, rv, stored["spec"])
        if action is not None:
            tainted = {
                d["name"]: [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in d["taints"]]
                for d in stored["spec"].get("devices") or []
                if d.get("taints")
            }
            log.info(
                "resourceslice_published",
                action=action,
                name=stored["metadata"]["name"],
                node=self.node_name,
                driver=self.driver,
                pool_generation=generation,
                devices=len(stored["spec"].get("devices") or []),
                tainted=tainted,
            )

    async def _learn_node_uid(self) -> None:
        assert self._core_api is not None
        try:
            node = await call_json(
                self._core_api.read_node, self.node_name, request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            log.warning(
                "resourceslice_owner_unknown",
                node=self.node_name,
                reason="the Node object does not exist; the slice is published without owner",
            )
            return
        self._node_uid = node["metadata"]["uid"]

    async def _list(self) -> list[dict[str, Any]]:
        assert self._api is not None
        listed = await call_json(
            self._api.list_resource_slice,
            field_selector=f"spec.nodeName={self.node_name}",
            request_timeout=self._timeout,
        )
        items: list[dict[str, Any]] = listed.get("items") or []
        return items

    def _ours(self, item: dict[str, Any]) -> bool:
        """A slice of this node this agent answers for: its driver's, or labelled by it."""
        labels = item["metadata"].get("labels") or {}
        return item["spec"].get("driver") == self.driver or (
            labels.get(MANAGED_BY_LABEL) == MANAGED_BY
        )

    async def _delete(self, item: dict[str, Any], why: str) -> None:
        assert self._api is not None
        meta = item["metadata"]
        body = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=meta["uid"])
        )
        self._deleted.add(meta["uid"])
        try:
            await call_json(
                self._api.delete_resource_slice,
                meta["name"],
                body=body,
                request_timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        log.info(
            "resourceslice_deleted",
            name=meta["name"],
            node=self.node_name,
            driver=item["spec"].get("driver"),
            reason=why,
        )

    # --- noticing other writers -----------------------------------------------------------

    async def _watch_loop(self) -> None:
        backoff = Backoff(*self._backoff)
        version: str | None = None
        while True:
            try:
                if version is None:
                    assert self._api is not None
                    listed = await call_json(
                        self._api.list_resource_slice,
                        field_selector=f"spec.nodeName={self.node_name}",
                        request_timeout=self._timeout,
                    )
                    version = listed["metadata"]["resourceVersion"]
                    self._wake.set()  # changes before the watch began are not seen otherwise
                version = await self._watch_from(version)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if status_of(exc) == 410:
                    version = None  # too old: list again
                    continue
                delay = backoff.next_delay()
                log.warning(
                    "resourceslice_watch_failed",
                    node=self.node_name,
                    error=describe(exc),
                    retry_in_s=round(delay, 3),
                )
                version = None
                await asyncio.sleep(delay)

    async def _watch_from(self, version: str) -> str:
        """Follow changes from `version` until the server ends the watch; returns the last
        resourceVersion seen."""
        assert self._api is not None
        response: Any = await self._api.list_resource_slice(
            watch=True,
            field_selector=f"spec.nodeName={self.node_name}",
            resource_version=version,
            timeout_seconds=self._watch_seconds,
            allow_watch_bookmarks=True,
            _preload_content=False,
            _request_timeout=(self._timeout, self._watch_seconds + self._timeout),
        )
        try:
            if response.status != 200:
                body = await response.read()
                error = ApiException(status=response.status, reason=response.reason)
                error.body = body.decode(errors="replace")
                raise error
            while True:
                line = await response.content.readline()
                if not line:
                    return version
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    error = ApiException(status=obj.get("code"), reason=obj.get("reason"))
                    error.body = json.dumps(obj).encode()
                    raise error
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if event.get("type") != "BOOKMARK" and self._foreign(event["type"], obj):
                    log.info(
                        "resourceslice_changed_elsewhere",
                        event=event["type"],
                        name=(obj.get("metadata") or {}).get("name"),
                        node=self.node_name,
                    )
                    self._wake.set()
        finally:
            response.release()

    def _foreign(self, kind: str, obj: dict[str, Any]) -> bool:
        """Whether a watch event is someone else's doing on a slice this agent answers for."""
        if not obj.get("spec") or not self._ours(obj):
            return False
        meta = obj["metadata"]
        if kind == "DELETED":
            return meta.get("uid") not in self._deleted
        if meta.get("resourceVersion") in self._written:
            return False
        expected = self._expected
        return not (
            expected is not None
            and meta.get("name") == expected["metadata"]["name"]
            and _generation_of(obj) == _generation_of(expected)
            and same_devices(obj["spec"], expected["spec"])
            and metadata_current(obj, expected)
        )


def _generation_of(item: Mapping[str, Any]) -> int:
    generation = ((item.get("spec") or {}).get("pool") or {}).get("generation", 0)
    return generation if isinstance(generation, int) else 0

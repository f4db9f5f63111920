"""Node labels and GPU health Events through the Kubernetes API (kubernetes_asyncio).

Callers never wait on the API: `publish_labels` records the labels wanted and `on_health_change`
queues an event; `run()` does the API work in two tasks of its own (labels, events), each retrying
with exponential backoff, so an unreachable or failing API server never stops or slows the
device plugin. Without a kubeconfig or in-cluster config the agent says so once and does nothing.

API calls made (the DaemonSet's RBAC grants exactly these):
    GET   /api/v1/nodes/{node}                    nodes: get
    PATCH /api/v1/nodes/{node}                    nodes: patch
    POST  /api/v1/namespaces/{ns}/events          events: create (in the agent's namespace only)
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import functools
import itertools
import json
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.kube.backoff import Backoff, TokenBucket
from vgpu_agent.kube.coreapi import CoreApi
from vgpu_agent.kube.events import (
    REASON_BACKSTOP,
    REASON_EVICTED,
    HealthChangeLike,
    NodeRef,
    PodRef,
    eviction,
    health_event,
    pod_event,
)
from vgpu_agent.kube.labels import labels_patch, node_labels
from vgpu_agent.kube.paced import send_in_turn

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Statuses that a retry cannot fix: the request itself is wrong. Everything else is retried.
_REJECTED = frozenset({400, 413, 422})
_CONFLICT = 409
_FREE_CONFLICT_RETRIES = 3  # a 409 means another writer won; re-read at once a few times

Source = Literal["kubeconfig", "in-cluster"]


class KubeConfigError(Exception):
    """An explicitly requested API configuration (a kubeconfig, in_cluster=True) is unusable."""


@dataclass(frozen=True)
class HealthSnapshot:
    """A copy of a health change taken when it was reported (the caller may reuse its object)."""

    uuid: str
    healthy: bool
    reason: str
    xid: int | None


@dataclass(frozen=True)
class _PodNotice:
    """A container over its limits: an Event on its pod, and the pod's eviction if asked."""

    namespace: str
    pod: str
    uid: str
    container: str
    message: str
    evict: bool
    at: dt.datetime
    seq: int


@dataclass(frozen=True)
class _QueuedEvent:
    change: HealthSnapshot
    at: dt.datetime
    seq: int


class NodeIntegration:
    """Keeps this agent's labels on its Node and reports GPU health changes as Node Events."""

    def __init__(
        self,
        node_name: str,
        kubeconfig: str | None,
        in_cluster: bool | None = None,
        *,
        namespace: str | None = None,
        request_timeout: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_cap: float = 60.0,
        max_queued_events: int = 256,
        events_per_second: float = 1.0,
        event_burst: int = 20,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ):
        if not node_name:
            raise ValueError("node_name is empty: set NODE_NAME (downward API) or --node-name")
        self.node_name = node_name
        self._kubeconfig = kubeconfig
        self._in_cluster = in_cluster
        self._namespace = namespace
        self._timeout = request_timeout
        self._backoff_initial = backoff_initial
        self._backoff_cap = backoff_cap
        self._environ = dict(os.environ if environ is None else environ)
        self._sa_dir = service_account_dir

        self.enabled = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._api_client: client.ApiClient | None = None
        self._api: CoreApi | None = None
        self._node_ref: NodeRef | None = None

        self._desired: dict[str, str] | None = None
        self._generation = 0
        self._labels_wake = asyncio.Event()
        self._events: collections.deque[_QueuedEvent] = collections.deque()
        self._max_events = max_queued_events
        # A flapping GPU must not turn into an event storm (each event costs API server writes and
        # CPU on this event loop); beyond the burst, events wait and the oldest queued are dropped.
        self._event_rate = (events_per_second, event_burst)
        # bad pacing parameters fail here, not later inside run()
        TokenBucket(events_per_second, event_burst, now=0.0)
        Backoff(backoff_initial, backoff_cap)
        self._events_wake = asyncio.Event()
        self._seq = itertools.count()
        self._pod_notices: collections.deque[_PodNotice] = collections.deque()
        self._pod_wake = asyncio.Event()
        self.evictions = 0
        self._configured = asyncio.Event()  # start() has decided: a configuration, or no API
        self._configuration: Any = None  # a kubernetes_asyncio Configuration once loaded

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """Where Events are created: the agent's own namespace."""
        if self._namespace is None:
            self._namespace = self._resolve_namespace()
        return self._namespace

    async def start(self) -> None:
        """Load the API configuration. Raises KubeConfigError only for an explicit request."""
        self._loop = asyncio.get_running_loop()
        self._started = True
        source = self._source()
        if source is None:
            log.info(
                "kube_api_disabled",
                reason="no kubeconfig given and not running in a cluster",
                effect="node labels and GPU health events are not published",
            )
            self._events.clear()
            self._configured.set()
            return
        configuration = client.Configuration()
        try:
            if source == "kubeconfig":
                await config.load_kube_config(
                    config_file=self._kubeconfig, client_configuration=configuration
                )
            else:
                InClusterConfigLoader(
                    token_filename=str(self._sa_dir / "token"),
                    cert_filename=str(self._sa_dir / "ca.crt"),
                    environ=self._environ,  # type: ignore[arg-type]
                ).load_and_set(configuration)
        except Exception as exc:
            what = f"kubeconfig {self._kubeconfig}" if source == "kubeconfig" else "in-cluster"
            if source == "kubeconfig" or self._in_cluster:
                raise KubeConfigError(f"cannot load {what} configuration: {exc}") from exc
            log.warning("kube_api_disabled", reason=f"in-cluster configuration unusable: {exc}")
            self._events.clear()
            self._configured.set()
            return
        self._api_client = client.ApiClient(configuration=configuration)
        self._api = CoreApi(self._api_client)
        self.enabled = True
        self._configuration = configuration
        self._configured.set()
        log.info(
            "kube_api_enabled",
            source=source,
            server=configuration.host,
            node=self.node_name,
            event_namespace=self.namespace,
        )

    async def run(self) -> None:
        """Do the API work until cancelled (also when disabled, so supervisors see no exit)."""
        if not self._started:
            await self.start()
        try:
            if not self.enabled:
                await asyncio.Event().wait()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._label_loop(), name="kube-node-labels")
                group.create_task(self._event_loop(), name="kube-node-events")
                group.create_task(self._pod_loop(), name="kube-pod-notices")
        finally:
            await self.close()

    async def api_configuration(self) -> Any:
        """The API configuration once `start()` has loaded it (None: no API is used), for other
        parts of the agent that talk to the API with clients of their own."""
        await self._configured.wait()
        return self._configuration

    async def close(self) -> None:
        self._configured.clear()
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
            self._api = None

    # --- what callers use -------------------------------------------------------------------

    async def publish_labels(self, gpus: Sequence[GpuInfo], split_count: int, version: str) -> None:
        """Ask for the node's labels to describe these GPUs. Returns at once."""
        desired = node_labels(gpus, split_count, version)
        if self._started and not self.enabled:
            return
        self._desired = desired
        self._generation += 1
        self._labels_wake.set()

    def on_health_change(self, change: HealthChangeLike) -> None:
        """Queue a Node Event for a GPU turning unhealthy or healthy. Never blocks; callable
        from any thread."""
        if self._started and not self.enabled:
            return
        item = _QueuedEvent(
            HealthSnapshot(change.uuid, change.healthy, change.reason, change.xid),
            dt.datetime.now(dt.UTC),
            next(self._seq),
        )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is not None and running is not self._loop:
            self._loop.call_soon_threadsafe(self._enqueue, item)
        else:
            self._enqueue(item)

    @property
    def queued_events(self) -> int:
        return len(self._events)

    def on_container_breach(
        self, namespace: str, pod: str, uid: str, container: str, message: str,
        evict: bool = False,
    ) -> None:
        """Queue a Warning Event on the pod (and its eviction, with `evict`), whose UID the
        node's pod watch gave. Never blocks; call on the event loop."""
        if self._started and not self.enabled:
            return
        if len(self._pod_notices) >= self._max_events:
            dropped = self._pod_notices.popleft()
            log.warning("pod_notice_dropped", namespace=dropped.namespace, pod=dropped.pod,
                        reason="notice queue full while the API is unreachable")
        self._pod_notices.append(_PodNotice(namespace, pod, uid, container, message, evict,
                                            dt.datetime.now(dt.UTC), next(self._seq)))
        self._pod_wake.set()

    # --- workers ----------------------------------------------------------------------------

    def _enqueue(self, item: _QueuedEvent) -> None:
        if len(self._events) >= self._max_events:
            dropped = self._events.popleft()
            log.warning(
                "gpu_health_event_dropped",
                uuid=dropped.change.uuid,
                healthy=dropped.change.healthy,
                reason="event queue full while the API is unreachable",
            )
        self._events.append(item)
        self._events_wake.set()

    async def _label_loop(self) -> None:
        backoff = Backoff(self._backoff_initial, self._backoff_cap)
        conflicts = 0
        while True:
            await self._labels_wake.wait()
            self._labels_wake.clear()
            while self._desired is not None:
                generation, desired = self._generation, self._desired
                try:
                    await self._sync_labels(desired)
                except Exception as exc:
                    status = status_of(exc)
                    if status in _REJECTED:
                        log.error("node_labels_rejected", node=self.node_name, error=describe(exc))
                    elif status == _CONFLICT and conflicts < _FREE_CONFLICT_RETRIES:
                        conflicts += 1
                        log.info("node_labels_conflict_retrying", node=self.node_name)
                        continue
                    else:
                        await self._retry_later("node_labels", exc, backoff)
                        continue
                else:
                    backoff.reset()
                conflicts = 0
                if self._generation == generation:
                    self._desired = None

    async def _sync_labels(self, desired: dict[str, str]) -> None:
        assert self._api is not None
        meta = (await self._call(self._api.read_node, self.node_name))["metadata"]
        self._node_ref = NodeRef(meta["name"], meta["uid"])
        patch = labels_patch(meta.get("labels") or {}, desired)
        if not patch:
            log.debug("node_labels_current", node=self.node_name)
            return
        body = {"metadata": {"labels": patch, "resourceVersion": meta["resourceVersion"]}}
        await self._call(self._api.patch_node, self.node_name, body)
        log.info(
            "node_labels_published",
            node=self.node_name,
            set={k: v for k, v in patch.items() if v is not None},
            removed=sorted(k for k, v in patch.items() if v is None),
        )

    async def _event_loop(self) -> None:
        await send_in_turn(self._events, self._events_wake, self._event_rate,
                           Backoff(self._backoff_initial, self._backoff_cap), self._send_event,
                           self._event_settled,
                           functools.partial(self._retry_later, "gpu_health_event"))

    def _event_settled(self, item: _QueuedEvent, exc: Exception) -> bool:
        status = status_of(exc)
        if status == _CONFLICT:
            # Same name: an earlier try was created but its answer was lost.
            log.info("gpu_health_event_already_sent", uuid=item.change.uuid)
        elif status in _REJECTED:
            log.error("gpu_health_event_rejected", uuid=item.change.uuid, error=describe(exc))
        else:
            return False
        return True

    async def _pod_loop(self) -> None:
        await send_in_turn(self._pod_notices, self._pod_wake, self._event_rate,
                           Backoff(self._backoff_initial, self._backoff_cap),
                           self._send_pod_notice, self._pod_notice_settled,
                           functools.partial(self._retry_later, "pod_notice"))

    def _pod_notice_settled(self, item: _PodNotice, exc: Exception) -> bool:
        status = status_of(exc)
        if status == 404:
            log.info("pod_notice_pod_gone", namespace=item.namespace, pod=item.pod)
        elif status == _CONFLICT or status in _REJECTED:
            log.error("pod_notice_rejected", namespace=item.namespace, pod=item.pod,
                      error=describe(exc))
        else:
            return False
        return True

    async def _send_pod_notice(self, item: _PodNotice) -> None:
        assert self._api is not None
        pod = PodRef(item.namespace, item.pod, item.uid)
        body = pod_event(pod, REASON_BACKSTOP, item.message, self.node_name, item.at, item.seq,
                         container=item.container)
        try:
            await self._call(self._api.create_namespaced_event, item.namespace, body)
        except Exception as exc:
            if status_of(exc) != _CONFLICT:  # a 409: sent before, its answer lost
                raise
        log.info("pod_notice_sent", namespace=item.namespace, pod=item.pod,
                 container=item.container, evict=item.evict)
        if not item.evict:
            return
        await self._call(self._api.create_namespaced_pod_eviction, item.pod, item.namespace,
                         eviction(pod))
        self.evictions += 1
        log.warning("pod_evicted", namespace=item.namespace, pod=item.pod,
                    container=item.container, reason=item.message)
        body = pod_event(pod, REASON_EVICTED, "evicted: " + item.message, self.node_name,
                         item.at, item.seq + 1_000_000, container=item.container)
        try:
            await self._call(self._api.create_namespaced_event, item.namespace, body)
        except Exception as exc:  # the eviction is done; its note is best effort
            log.warning("pod_eviction_event_failed", pod=item.pod, error=describe(exc))

    async def _send_event(self, item: _QueuedEvent) -> None:
        assert self._api is not None
        if self._node_ref is None:
            meta = (await self._call(self._api.read_node, self.node_name))["metadata"]
            self._node_ref = NodeRef(meta["name"], meta["uid"])
        body = health_event(item.change, self._node_ref, self.namespace, item.at, item.seq)
        await self._call(self._api.create_namespaced_event, self.namespace, body)
        log.info(
            "gpu_health_event_sent",
            node=self.node_name,
            uuid=item.change.uuid,
            healthy=item.change.healthy,
            xid=item.change.xid,
        )

    async def _call(self, method: Callable[..., Awaitable[Any]], *args: Any) -> dict[str, Any]:
        return await call_json(method, *args, request_timeout=self._timeout)

    async def _retry_later(self, operation: str, exc: Exception, backoff: Backoff) -> None:
        delay = backoff.next_delay()
        log.warning(
            "kube_api_retry",
            operation=operation,
            node=self.node_name,
            error=describe(exc),
            attempt=backoff.failures,
            retry_in_s=round(delay, 3),
        )
        await asyncio.sleep(delay)

    # --- configuration ----------------------------------------------------------------------

    def _source(self) -> Source | None:
        if self._kubeconfig:
            return "kubeconfig"
        if self._in_cluster is True:
            return "in-cluster"
        if self._in_cluster is None and self._environ.get("KUBERNETES_SERVICE_HOST"):
            return "in-cluster"
        return None

    def _resolve_namespace(self) -> str:
        if self._environ.get("POD_NAMESPACE"):
            return self._environ["POD_NAMESPACE"]
        try:
            text = (self._sa_dir / "namespace").read_text().strip()
        except OSError:
            text = ""
        return text or "default"


async def call_json(
    method: Callable[..., Awaitable[Any]], *args: Any, request_timeout: float, **kwargs: Any
) -> dict[str, Any]:
    """Call an API method and return the JSON body, without building the client's model
    objects (a Node with its image list takes milliseconds to turn into models, on the event
    loop the device plugin shares); ApiException on a non-2xx answer."""
    response = await method(
        *args, _preload_content=False, _request_timeout=request_timeout, **kwargs
    )
    try:
        body = await response.read()
    finally:
        response.release()
    if not 200 <= response.status <= 299:
        error = ApiException(status=response.status, reason=response.reason)
        error.body = body.decode(errors="replace")
        raise error
    result: dict[str, Any] = json.loads(body) if body else {}
    return result


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API error, None for any other failure."""
    return exc.status if isinstance(exc, ApiException) else None


def describe(exc: BaseException) -> str:
    """An API failure in one line: the status and the server's message, or what went wrong."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}: {_message(exc.body)}"
    if isinstance(exc, TimeoutError):
        return "request timed out"
    return f"{type(exc).__name__}: {exc}"


def _message(body: Any) -> str:
    try:
        return str(json.loads(body).get("message", body))
    except (TypeError, ValueError, AttributeError):
        return str(body)[:200]

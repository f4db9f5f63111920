"""This node's pods and their `vgpu.io/` annotations, from a list and a watch; refusal Events.

`NodePods` lists the pods bound to this node (field selector `spec.nodeName=<node>`) and then
watches them from the list's resourceVersion, so the API server sends only changes: no call per
controller tick or per PodResources refresh. The cache is keyed by pod UID: a pod deleted and
re-created under the same name is a new entry and never inherits the old one's annotations. Only
the annotations `throttle/podpolicy.py` reads are kept.

When the API is unreachable the cache keeps the last pods it knew (the regions keep the last
known policy) and the watch is resumed, or the list redone, with backoff. A watch whose
resourceVersion has expired (410 Gone) starts over with a list, which also drops pods deleted in
the meantime.

`report_refusal` turns a refused annotation into one Warning Event on the pod, once per pod UID
and distinct refusal, paced by a token bucket; events are created in the pod's namespace (the
API server requires an event's namespace to be its object's).

API calls made (the DaemonSet's RBAC grants exactly these):
    GET  /api/v1/pods?fieldSelector=spec.nodeName=<node>              pods: list
    GET  /api/v1/pods?fieldSelector=spec.nodeName=<node>&watch=true   pods: watch
    POST /api/v1/namespaces/{pod namespace}/events                    events: create

kubernetes_asyncio is imported only when `run()` starts.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from vgpu_agent.kube.backoff import Backoff, TokenBucket
from vgpu_agent.kube.coreapi import CoreApi
from vgpu_agent.kube.events import (
    REASON_ANNOTATION_REFUSED,
    REASON_MEMORY_SPILLED,
    PodRef,
    SpilledDevice,
    pod_event,
    spill_message,
)
from vgpu_agent.kube.paced import send_in_turn
from vgpu_agent.throttle.podpolicy import PodInfo, Refusal, relevant

log = structlog.get_logger(__name__)

_GONE = 410
_CONFLICT = 409
# A retry cannot fix these: the request itself, or the agent's permission, is wrong.
_EVENT_DROPPED = frozenset({400, 403, 404, 413, 422})
MAX_WATCH_LINE = 8 << 20  # an object larger than the API server stores is not an object
_SHORT_WATCH_S = 1.0


class KubeApiError(Exception):
    """A call answered with an error status; the message names it."""

    def __init__(self, status: int, reason: str, body: str = ""):
        super().__init__(f"HTTP {status} {reason}: {_message(body)}")
        self.status = status
        self.reason = reason
        self.body = body


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class _Malformed(Exception):
    """The watch sent something that is not a watch event: resuming from the same version would
    replay it, so list again."""


@dataclass(frozen=True)
class _QueuedEvent:
    pod: PodInfo
    reason: str
    message: str
    event_type: str
    at: dt.datetime
    seq: int
    about: str  # what the event is about, for the log (an annotation, a container)


# Waits for the API configuration (a kubernetes_asyncio `Configuration`), None when there is none.
ConfigurationSource = Callable[[], Awaitable[Any]]


class NodePods:
    """A cache of this node's pods (list + watch) and the Events about their annotations."""

    def __init__(
        self,
        node_name: str,
        api_configuration: ConfigurationSource,
        *,
        on_change: Callable[[], None] | None = None,
        request_timeout: float = 10.0,
        watch_timeout_s: float = 300.0,
        backoff_initial: float = 0.5,
        backoff_cap: float = 60.0,
        events_per_second: float = 1.0,
        event_burst: int = 20,
        max_queued_events: int = 256,
    ):
        if not node_name:
            raise ValueError("node_name is empty: set NODE_NAME (downward API) or --node-name")
        if not watch_timeout_s >= 1:
            raise ValueError(f"watch timeout must be >= 1 s, got {watch_timeout_s!r}")
        TokenBucket(events_per_second, event_burst, now=0.0)  # bad pacing fails here
        Backoff(backoff_initial, backoff_cap)
        self.node_name = node_name
        self.selector = f"spec.nodeName={node_name}"
        self._configuration_source = api_configuration
        self.on_change = on_change
        self._timeout = request_timeout
        self._watch_s = watch_timeout_s
        self._backoff = (backoff_initial, backoff_cap)
        self._event_rate = (events_per_second, event_burst)
        self._max_events = max_queued_events
        self._api: Any = None
        self._pods: dict[str, PodInfo] = {}  # uid -> pod
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid
        self._reported: dict[str, set[tuple[str, str]]] = {}  # uid -> (annotation, value)
        self._events: collections.deque[_QueuedEvent] = collections.deque()
        self._events_wake = asyncio.Event()
        self._seq = itertools.count()
        self._forbidden_namespaces: set[str] = set()
        self.synced = False  # a list has succeeded at least once
        self.connected = False  # the last list or watch call succeeded
        self.lists = 0
        self.watches = 0
        self.events_sent = 0

    # --- what callers use -------------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        uid = self._names.get((namespace, name))
        return self._pods.get(uid) if uid is not None else None

    def __len__(self) -> int:
        return len(self._pods)

    def report_refusal(self, pod: PodInfo, refusal: Refusal) -> None:
        """Queue one Event for this refusal on this pod, unless it was queued before."""
        key = (refusal.annotation, refusal.value)
        reported = self._reported.setdefault(pod.uid, set())
        if key in reported:
            return
        reported.add(key)
        log.warning(
            "pod_annotation_refused",
            namespace=pod.namespace,
            pod=pod.name,
            pod_uid=pod.uid,
            annotation=refusal.annotation,
            value=refusal.value,
            allowed=refusal.allowed,
            applied=refusal.applied,
        )
        self._queue(pod, REASON_ANNOTATION_REFUSED, refusal.message, "Warning", refusal.annotation)

    def report_spill(self, pod: PodInfo, container: str, devices: list[SpilledDevice]) -> None:
        """Queue one Event saying that `container` of `pod` spilled GPU memory to host memory.

        The caller reports each container once; a pod not (or no longer) in the cache is told
        nothing, as for refusals.
        """
        self._queue(
            pod, REASON_MEMORY_SPILLED, spill_message(container, devices), "Normal", container
        )

    def _queue(self, pod: PodInfo, reason: str, message: str, event_type: str, about: str) -> None:
        if len(self._events) >= self._max_events:
            dropped = self._events.popleft()
            log.warning(
                "pod_event_dropped",
                namespace=dropped.pod.namespace,
                pod=dropped.pod.name,
                reason="event queue full while the API is unreachable",
            )
        now = dt.datetime.now(dt.UTC)
        self._events.append(
            _QueuedEvent(pod, reason, message, event_type, now, next(self._seq), about)
        )
        self._events_wake.set()

    @property
    def queued_events(self) -> int:
        return len(self._events)

    # --- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        """List, watch and send events until cancelled; idle when the API is not configured."""
        configuration = await self._configuration_source()
        if configuration is None:
            log.info(
                "pod_annotations_disabled",
                reason="no Kubernetes API configured",
                effect="every region gets the node's default core policy and priority",
            )
            await asyncio.Event().wait()
        from kubernetes_asyncio import client

        # A client of its own: a watch stays open for minutes, and a shared client closed by
        # its owner would leave the watch hanging rather than failing.
        api_client = client.ApiClient(configuration=configuration)
        self._api = CoreApi(api_client)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._sync_loop(), name="kube-pods-watch")
                group.create_task(self._event_loop(), name="kube-pod-events")
        finally:
            self._api = None
            self.connected = False
            await api_client.close()

    # --- list and watch ---------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        backoff = Backoff(*self._backoff)
        loop = asyncio.get_running_loop()
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list()
                started = loop.time()
                version = await self._watch(version)
                if loop.time() - started < _SHORT_WATCH_S:
                    # a server that keeps ending watches at once must not make this a busy loop
                    await asyncio.sleep(backoff.next_delay())
                else:
                    backoff.reset()
            except _Expired:
                log.info("pod_watch_expired", node=self.node_name, effect="listing again")
                version = None
            except _Malformed as exc:
                self.connected = False
                delay = backoff.next_delay()
                log.warning("pod_watch_malformed", node=self.node_name, error=str(exc),
                            effect="listing again", retry_in_s=round(delay, 3))
                version = None
                await asyncio.sleep(delay)
            except Exception as exc:
                self.connected = False
                delay = backoff.next_delay()
                log.warning(
                    "kube_api_retry",
                    operation="pod_watch" if version is not None else "pod_list",
                    node=self.node_name,
                    error=_describe(exc),
                    attempt=backoff.failures,
                    retry_in_s=round(delay, 3),
                    effect="regions keep the last known pod policies",
                )
                await asyncio.sleep(delay)

    async def _list(self) -> str:
        response = await self._api.list_pod_for_all_namespaces(
            field_selector=self.selector, _preload_content=False, _request_timeout=self._timeout
        )
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status == _GONE:
            raise _Expired
        if not 200 <= response.status <= 299:
            text = body.decode(errors="replace")
            raise KubeApiError(response.status, response.reason or "", text)
        listed = json.loads(body)
        self.lists += 1
        fresh: dict[str, PodInfo] = {}
        for item in listed.get("items") or ():
            info = self._info(item)
            if info is not None:
                fresh[info.uid] = info
        changed = fresh != self._pods
        for uid in [u for u in self._reported if u not in fresh]:
            del self._reported[uid]
        self._pods = fresh
        self._names = {(p.namespace, p.name): uid for uid, p in fresh.items()}
        if not self.synced or not self.connected:
            log.info("pods_listed", node=self.node_name, pods=len(fresh))
        self.synced = self.connected = True
        if changed:
            self._notify()
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> str:
        """Follow changes from `version` until the server ends the watch; the last version."""
        response = await self._api.list_pod_for_all_namespaces(
            field_selector=self.selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self._watch_s),
            _preload_content=False,
            _request_timeout=(self._timeout, self._watch_s + self._timeout),
        )
        try:
            if response.status == _GONE:
                raise _Expired
            if not 200 <= response.status <= 299:
                body = await response.read()
                text = body.decode(errors="replace")
                raise KubeApiError(response.status, response.reason or "", text)
            self.watches += 1
            self.connected = True
            pending = b""
            async for chunk in response.content.iter_any():
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        version = self._on_watch_event(_decode(line), version)
                if len(pending) > MAX_WATCH_LINE:
                    raise _Malformed(f"a watch line longer than {MAX_WATCH_LINE} bytes")
            if pending.strip():
                version = self._on_watch_event(_decode(pending), version)
        finally:
            response.release()
        return version

    def _on_watch_event(self, event: Any, version: str) -> str:
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            raise _Malformed(f"not a watch event: {str(event)[:200]}")
        if kind == "ERROR":
            code = obj.get("code")
            if code == _GONE:
                raise _Expired
            raise KubeApiError(int(code or 500), str(obj.get("reason", "")), json.dumps(obj))
        meta = obj.get("metadata")
        if isinstance(meta, dict) and meta.get("resourceVersion"):
            version = str(meta["resourceVersion"])
        if kind == "BOOKMARK":
            return version
        info = self._info(obj)
        if info is None:
            return version
        spec = obj.get("spec")
        node = spec.get("nodeName") if isinstance(spec, dict) else None
        if kind == "DELETED" or node != self.node_name:
            if self._pods.get(info.uid) is not None:
                self._forget(info.uid)
                self._notify()
        elif kind in ("ADDED", "MODIFIED"):
            self._upsert(info)
        return version

    def _info(self, obj: Any) -> PodInfo | None:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta, dict):
            return None
        uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
        if not all(isinstance(v, str) and v for v in (uid, namespace, name)):
            return None
        annotations = meta.get("annotations")
        kept = relevant(annotations) if isinstance(annotations, dict) else {}
        return PodInfo(str(uid), str(namespace), str(name), kept)

    def _upsert(self, info: PodInfo) -> None:
        key = (info.namespace, info.name)
        previous = self._names.get(key)
        if previous is not None and previous != info.uid:
            self._forget(previous)  # the same name, another pod: nothing carries over
        if self._pods.get(info.uid) == info:
            return
        self._pods[info.uid] = info
        self._names[key] = info.uid
        self._notify()

    def _forget(self, uid: str) -> None:
        info = self._pods.pop(uid, None)
        self._reported.pop(uid, None)
        if info is not None and self._names.get((info.namespace, info.name)) == uid:
            del self._names[(info.namespace, info.name)]

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --- events -----------------------------------------------------------------------------

    async def _event_loop(self) -> None:
        await send_in_turn(self._events, self._events_wake, self._event_rate,
                           Backoff(*self._backoff), self._send, self._event_settled,
                           self._retry_later,
                           gone=lambda item: item.pod.uid not in self._pods)  # nobody to tell

    def _event_settled(self, item: _QueuedEvent, exc: Exception) -> bool:
        status = getattr(exc, "status", None)
        if status == _CONFLICT:
            log.info("pod_event_already_sent", pod=item.pod.name)
        elif status in _EVENT_DROPPED:
            self._rejected(item, exc, status)
        else:
            return False
        return True

    async def _retry_later(self, exc: Exception, backoff: Backoff) -> None:
        delay = backoff.next_delay()
        log.warning(
            "kube_api_retry",
            operation="pod_event",
            error=_describe(exc),
            attempt=backoff.failures,
            retry_in_s=round(delay, 3),
        )
        await asyncio.sleep(delay)

    async def _send(self, item: _QueuedEvent) -> None:
        pod = item.pod
        body = pod_event(
            PodRef(pod.namespace, pod.name, pod.uid),
            item.reason,
            item.message,
            self.node_name,
            item.at,
            item.seq,
            item.event_type,
        )
        response = await self._api.create_namespaced_event(
            pod.namespace, body, _preload_content=False, _request_timeout=self._timeout
        )
        try:
            answer = await response.read()
        finally:
            response.release()
        if not 200 <= response.status <= 299:
            text = answer.decode(errors="replace")
            raise KubeApiError(response.status, response.reason or "", text)
        self.events_sent += 1
        log.info(
            "pod_event_sent",
            namespace=pod.namespace,
            pod=pod.name,
            reason=item.reason,
            about=item.about,
        )

    def _rejected(self, item: _QueuedEvent, exc: Exception, status: int) -> None:
        namespace = item.pod.namespace
        if status == 403:
            if namespace not in self._forbidden_namespaces:  # once per namespace, not per pod
                self._forbidden_namespaces.add(namespace)
                log.error(
                    "pod_event_forbidden",
                    namespace=namespace,
                    error=_describe(exc),
                    effect="refusals in this namespace are logged here, not shown on the pod",
                )
            return
        log.error("pod_event_rejected", namespace=namespace, pod=item.pod.name,
                  error=_describe(exc))


def _decode(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError as err:
        raise _Malformed(f"watch line is not JSON ({err}): {line[:200]!r}") from None


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if isinstance(exc, KubeApiError):
        return str(exc)
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '')}"
    if isinstance(exc, TimeoutError):
        return "request timed out"
    return f"{type(exc).__name__}: {exc}"


def _message(body: str) -> str:
    try:
        return str(json.loads(body).get("message", body))
    except (TypeError, ValueError, AttributeError):
        return body[:200]

"""A fake Kubernetes API server on aiohttp: nodes, core/v1 events, pods and the
`resource.k8s.io/v1` kinds (ResourceSlice, ResourceClaim, DeviceClass: see `resourceapi.py`),
with faults on demand.

Pods (`add_pod`, `set_pod_annotations`, `delete_pod`) are served as list and watch at
/api/v1/pods with a `spec.nodeName` field selector; watches stream JSON lines from a
resourceVersion, and answer 410 Gone after `compact_pod_history()`, as the real server does.

What it does like the real server:
- keeps objects with a cluster-wide, increasing `metadata.resourceVersion` and a `uid`;
- answers GET/PATCH of nodes and POST/GET of events at the real paths, with `Status` bodies on
  errors (404 NotFound, 409 Conflict/AlreadyExists, 400 BadRequest, 415, 422 Invalid, 401);
- PATCH accepts the content types `kubernetes_asyncio` sends: strategic-merge-patch+json (the
  default for a dict body), merge-patch+json and json-patch+json (for a list body). A
  `metadata.resourceVersion` in a merge patch is a precondition, as on the real server;
- validates label keys and values, and event names, namespaces and message length;
- checks the bearer token when one is configured.

What is simplified: strategic merge patch is applied as a JSON merge patch (maps merge, `null`
deletes, lists are replaced); this is exact for `metadata.labels`, which is all the agent patches.

Faults: `fail(...)` answers the next matching requests with a status code, `stall(...)` holds them
past the client's timeout, `stop()`/`start()` close and reopen the port (connection refused).
Every request is recorded in `requests` so tests can compare the calls made with RBAC rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import socket
import ssl
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from vgpu_agent.gpu.model import MIB, GpuInfo
from vgpu_agent.kube.node import NodeIntegration
from vgpu_agent.standins.resourceapi import ResourceStore, add_routes, json_patch, merge_patch

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
_DROP_AFTER_S = 0.5  # a request still running at `stop` is cut after this long (see `start`)

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
# where the middleware leaves the parsed body for the handlers
_BODY: Any = web.RequestKey("body", object) if hasattr(web, "RequestKey") else "body"
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass
class Recorded:
    method: str
    path: str
    content_type: str
    status: int = 0
    body: Any = None
    at: float = field(default_factory=time.monotonic)
    query: str = ""  # the query string, e.g. "fieldSelector=...&watch=true"


@dataclass
class _Fault:
    method: str | None
    path: re.Pattern[str]
    times: int
    status: int = 0  # 0: stall instead of answering
    seconds: float = 0.0
    action: Any = None  # called after the request was answered (or before, see `first`)
    handled: bool = False  # stall after the request took effect (only the answer is late)
    first: bool = False  # the action runs before the request is handled


@dataclass
class FakeKubeAPI:
    token: str | None = "test-token"
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # ns -> name -> obj
    evicted: list[tuple[str, str, str]] = field(default_factory=list)  # (ns, name, uid)
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    _rv: int = 100
    _faults: list[_Fault] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _held_port: socket.socket | None = None  # keeps the port while stopped (see `stop`)
    _changed: asyncio.Condition | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> Pod (see _PodsRoutes)
    _pod_history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    _pod_compacted: int = 0  # watches from a resourceVersion below this get 410 Gone
    _pod_changed: asyncio.Condition | None = None
    _pod_watch_epoch: int = 0  # bumped to end every open watch
    resources: ResourceStore = field(init=False)

    def __post_init__(self) -> None:
        self.resources = ResourceStore(self._next_rv, lambda: self._rv)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1 (a new port the first time, the same port after a stop)."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        app.router.add_get("/api/v1/namespaces/{ns}/events", self._list_events)
        add_routes(app, self.resources, lambda request: request[_BODY])
        app.router.add_get("/api/v1/pods", self._pods_route)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/eviction", self._evict_pod)
        # A request still running when the server stops (a watch opened just after `stop` ended
        # the others) is cut after this long, as a server going away drops its connections;
        # aiohttp would otherwise wait up to 60 s for it, holding `stop`.
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=_DROP_AFTER_S)
        await self._runner.setup()
        if self._held_port is not None:
            self._held_port.close()
            self._held_port = None
        site = web.TCPSite(
            self._runner, "127.0.0.1", self.port, reuse_address=True, ssl_context=self.ssl_context
        )
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        if self._changed is None:
            self._changed = asyncio.Condition()
        if self._pod_changed is None:
            self._pod_changed = asyncio.Condition()

    async def stop(self) -> None:
        """Close the port: clients now get 'connection refused'.

        The port stays bound, not listening (a connection to it is refused), so that no other
        server on the machine is handed it meanwhile and answers in this one's place."""
        self.resources.close_watches()
        await self.end_pod_watches()  # open watches end, as when the server goes away
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                held.bind(("127.0.0.1", self.port))
            except OSError:
                held.close()  # taken already: nothing to hold
            else:
                self._held_port = held
                weakref.finalize(self, held.close)  # closed with the server at the latest

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        token = token if token is not None else (self.token or "")
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "agent", "user": {"token": token}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
                    "current-context": "fake",
                }
            )
        )
        return path

    # --- objects ------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self._next_rv(),
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": dict(labels or {}),
            },
            "spec": {},
            "status": {},
        }
        self.nodes[name] = node
        return node

    def set_labels(self, name: str, **changes: str | None) -> None:
        """Change labels as another controller would (bumps the resourceVersion)."""
        labels = self.nodes[name]["metadata"].setdefault("labels", {})
        for key, value in changes.items():
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
        self.nodes[name]["metadata"]["resourceVersion"] = self._next_rv()

    def all_events(self) -> list[dict[str, Any]]:
        return [event for by_name in self.events.values() for event in by_name.values()]

    async def wait_for(self, predicate: Any, within: float = 5.0) -> None:
        """Wait until predicate() is true after some request; raise TimeoutError if it is not."""
        assert self._changed is not None
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(predicate)

    # --- faults -------------------------------------------------------------------------------

    def fail(
        self, status: int, times: int = 1, method: str | None = None, path: str = ".*"
    ) -> None:
        """Answer the next `times` requests matching method and path regex with `status`."""
        self._faults.append(_Fault(method, re.compile(path), times, status=status))

    def clear_faults(self) -> None:
        """Answer normally again."""
        self._faults.clear()

    def stall(
        self,
        seconds: float,
        times: int = 1,
        method: str | None = None,
        path: str = ".*",
        handled: bool = False,
    ) -> None:
        """Hold the next matching requests for `seconds`. With handled=True the request takes
        effect at once and only its answer is late (a client that times out never learns)."""
        self._faults.append(
            _Fault(method, re.compile(path), times, seconds=seconds, handled=handled)
        )

    def after(self, method: str, action: Any, times: int = 1, path: str = ".*") -> None:
        """Run action() right after the next matching requests were answered, e.g. to change
        an object between a client's read and its write."""
        self._faults.append(_Fault(method, re.compile(path), times, action=action))

    def before(self, method: str, action: Any, times: int = 1, path: str = ".*") -> None:
        """Run action() right before the next matching requests are handled, e.g. to change an
        object after a client read it and before its write lands (a certain conflict)."""
        self._faults.append(_Fault(method, re.compile(path), times, action=action, first=True))

    def _take_fault(
        self, request: web.Request, actions: bool = False, first: bool = False
    ) -> _Fault | None:
        for fault in self._faults:
            if (fault.action is not None) != actions or fault.first != first:
                continue
            if (fault.method is None or fault.method == request.method) and fault.path.search(
                request.path
            ):
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
                return fault
        return None

    # --- HTTP -----------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
        record = Recorded(
            request.method, request.path, request.content_type, body=body,
            query=request.query_string,
        )
        self.requests.append(record)
        request[_BODY] = body
        try:
            ahead = self._take_fault(request, actions=True, first=True)
            if ahead is not None:
                ahead.action()
            response = await self._answer(request, handler)
            follow_up = self._take_fault(request, actions=True)
            if follow_up is not None:
                follow_up.action()
        finally:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()
        record.status = response.status
        return response

    async def _answer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != (
            f"Bearer {self.token}"
        ):
            return status(401, "Unauthorized", "Unauthorized")
        fault = self._take_fault(request)
        if fault is not None and fault.status:
            return status(fault.status, "InternalError", f"injected failure {fault.status}")
        if fault is not None and not fault.handled:
            await asyncio.sleep(fault.seconds)
        if isinstance(request[_BODY], bytes):
            return status(400, "BadRequest", "request body is not JSON")
        response: web.StreamResponse = await handler(request)
        if fault is not None and fault.handled:
            await asyncio.sleep(fault.seconds)
        return response

    async def _get_node(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["name"])
        if node is None:
            return not_found("nodes", request.match_info["name"])
        return web.json_response(node)

    async def _patch_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        node = self.nodes.get(name)
        if node is None:
            return not_found("nodes", name)
        patch = request[_BODY]
        kind = request.content_type
        if kind in (STRATEGIC, MERGE):
            if not isinstance(patch, dict):
                return status(400, "BadRequest", f"{kind} body must be a JSON object")
            wanted_rv = patch.get("metadata", {}).get("resourceVersion")
            if wanted_rv is not None and wanted_rv != node["metadata"]["resourceVersion"]:
                return status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            updated = merge_patch(node, patch)
        elif kind == JSON_PATCH:
            if not isinstance(patch, list):
                return status(400, "BadRequest", "json-patch body must be a JSON array")
            try:
                updated = json_patch(node, patch)
            except (KeyError, IndexError, ValueError) as exc:
                return status(422, "Invalid", f"json patch failed: {exc}")
        else:
            return status(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an "
                f"unknown format - accepted media types include: {STRATEGIC}, {MERGE}, "
                f"{JSON_PATCH}; got {kind!r}",
            )
        meta = updated["metadata"]
        if meta.get("name") != name or meta.get("uid") != node["metadata"]["uid"]:
            return status(422, "Invalid", "metadata.name and metadata.uid are immutable")
        problems = label_problems(meta.get("labels") or {})
        if problems:
            return status(422, "Invalid", "; ".join(problems))
        meta["resourceVersion"] = self._next_rv()
        self.nodes[name] = updated
        return web.json_response(updated)

    async def _create_event(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        event = request[_BODY]
        if not isinstance(event, dict):
            return status(400, "BadRequest", "event body must be a JSON object")
        meta = event.setdefault("metadata", {})
        if meta.get("namespace", ns) != ns:
            return status(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        name = meta.get("name", "")
        problems = []
        if not _DNS_SUBDOMAIN.match(name):
            problems.append(f"metadata.name: Invalid value: {name!r}")
        involved = event.get("involvedObject") or {}
        if not involved.get("kind") or not involved.get("name"):
            problems.append("involvedObject: Required value")
        if involved.get("namespace") not in (None, "", ns):
            problems.append(
                f"involvedObject.namespace: Invalid value: {involved.get('namespace')!r}: "
                "does not match event.namespace"
            )
        if len(event.get("message", "")) > 1024:
            problems.append("message: Too long: must have at most 1024 bytes")
        if not event.get("reason"):
            problems.append("reason: Required value")
        if event.get("type") not in ("Normal", "Warning"):
            problems.append(f"type: Unsupported value: {event.get('type')!r}")
        if problems:
            return status(422, "Invalid", "; ".join(problems))
        by_name = self.events.setdefault(ns, {})
        if name in by_name:
            return status(409, "AlreadyExists", f'events "{name}" already exists')
        meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=self._next_rv())
        by_name[name] = event
        return web.json_response(event, status=201)

    async def _evict_pod(self, request: web.Request) -> web.Response:
        """policy/v1 Eviction: the pod is deleted (no disruption budgets here); a UID
        precondition that does not match is a 409, as the API server answers."""
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = request[_BODY]
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            return status(400, "BadRequest", "body must be a policy/v1 Eviction")
        if body.get("metadata", {}).get("name") != name:
            return status(400, "BadRequest", "name in the body does not match the URL")
        try:
            pod = self.find_pod(name, ns)
        except KeyError:
            return not_found("pods", name)
        uid = (body.get("deleteOptions") or {}).get("preconditions", {}).get("uid")
        if uid is not None and uid != pod["metadata"]["uid"]:
            return status(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                          f"UID in object meta: {pod['metadata']['uid']}")
        self.delete_pod(name, ns)
        self.evicted.append((ns, name, pod["metadata"]["uid"]))
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success"},
                                 status=201)

    async def _list_events(self, request: web.Request) -> web.Response:
        items = list(self.events.get(request.match_info["ns"], {}).values())
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "EventList",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )


    # --- pods: list and watch with a spec.nodeName field selector ----------------------------
    # Kept apart from the other kinds: the pod watch of vgpu_agent/kube/pods.py is what uses it.

    def add_pod(
        self,
        name: str,
        namespace: str = "default",
        node: str = "gpu-node-1",
        annotations: dict[str, str] | None = None,
        containers: tuple[str, ...] = ("main",),
    ) -> dict[str, Any]:
        """Create a pod bound to `node` (a new uid, as the real server gives a re-created pod)."""
        if any(
            p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace
            for p in self.pods.values()
        ):
            raise ValueError(f'pods "{name}" already exists in {namespace}')
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self._next_rv(),
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "annotations": dict(annotations or {}),
            },
            "spec": {"nodeName": node, "containers": [{"name": c} for c in containers]},
            "status": {"phase": "Running"},
        }
        self.pods[pod["metadata"]["uid"]] = pod
        self._pod_event("ADDED", pod)
        return pod

    def find_pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        for pod in self.pods.values():
            if pod["metadata"]["name"] == name and pod["metadata"]["namespace"] == namespace:
                return pod
        raise KeyError(f"{namespace}/{name}")

    def annotate_pod(self, name: str, namespace: str = "default", **changes: str | None) -> None:
        """Change annotations as a user would (keys with '/' go through `changes` as a dict)."""
        self.set_pod_annotations(name, namespace, changes)

    def set_pod_annotations(
        self, name: str, namespace: str, changes: dict[str, str | None]
    ) -> None:
        pod = self.find_pod(name, namespace)
        annotations = pod["metadata"].setdefault("annotations", {})
        for key, value in changes.items():
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
        pod["metadata"]["resourceVersion"] = self._next_rv()
        self._pod_event("MODIFIED", pod)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        pod = self.find_pod(name, namespace)
        del self.pods[pod["metadata"]["uid"]]
        pod["metadata"]["resourceVersion"] = self._next_rv()
        self._pod_event("DELETED", pod)

    def compact_pod_history(self) -> None:
        """Forget past pod changes, as etcd compaction does: older watches get 410 Gone."""
        self._pod_compacted = self._rv + 1
        self._pod_history.clear()

    def bookmark_pod_watches(self) -> str:
        """Send open watches a BOOKMARK at a new resourceVersion (as the server does now and then
        for watches that asked for bookmarks); returns that version."""
        version = self._next_rv()
        marker = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": version}}
        self._pod_history.append((int(version), "BOOKMARK", marker))
        self._wake_soon()
        return version

    def garble_pod_watches(self, line: bytes) -> None:
        """Send open watches `line` as it is (a broken proxy, a server bug)."""
        self._pod_history.append((int(self._next_rv()), "RAW", {"raw": line}))
        self._wake_soon()

    def _wake_soon(self) -> None:
        if self._pod_changed is not None:
            asyncio.get_running_loop().create_task(self._wake_pod_watches())

    async def end_pod_watches(self) -> None:
        """End every open watch normally (as the server does at timeoutSeconds)."""
        self._pod_watch_epoch += 1
        if self._pod_changed is not None:
            async with self._pod_changed:
                self._pod_changed.notify_all()

    def _pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        self._pod_history.append(
            (int(pod["metadata"]["resourceVersion"]), kind, copy.deepcopy(pod))
        )
        if self._pod_changed is not None:
            asyncio.get_running_loop().create_task(self._wake_pod_watches())

    async def _wake_pod_watches(self) -> None:
        assert self._pod_changed is not None
        async with self._pod_changed:
            self._pod_changed.notify_all()

    @staticmethod
    def _node_selector(request: web.Request) -> tuple[str | None, web.Response | None]:
        selector = request.query.get("fieldSelector", "")
        if not selector:
            return None, None
        field_name, _, value = selector.partition("=")
        if field_name != "spec.nodeName" or not value or "," in value:
            return None, status(
                400, "BadRequest", f'"{selector}" is not a field selector this fake knows'
            )
        return value, None

    async def _pods_route(self, request: web.Request) -> web.StreamResponse:
        node, problem = self._node_selector(request)
        if problem is not None:
            return problem
        if request.query.get("watch", "").lower() in ("true", "1", "t"):  # Go ParseBool
            return await self._watch_pods(request, node)
        items = [
            p for p in self.pods.values() if node is None or p["spec"].get("nodeName") == node
        ]
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _watch_pods(self, request: web.Request, node: str | None) -> web.StreamResponse:
        assert self._pod_changed is not None
        try:
            since = int(request.query.get("resourceVersion") or self._rv)
        except ValueError:
            return status(400, "BadRequest", "resourceVersion must be an integer here")
        seconds = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since < self._pod_compacted - 1:
            gone = {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                "reason": "Expired", "message": f"too old resource version: {since}",
            }
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await response.write_eof()
            return response
        epoch = self._pod_watch_epoch
        deadline = asyncio.get_running_loop().time() + seconds
        sent = since
        async with self._pod_changed:  # held while scanning, so no change is missed
            while self._pod_watch_epoch == epoch:
                for rv, kind, pod in list(self._pod_history):
                    if rv <= sent:
                        continue
                    sent = rv
                    if kind == "RAW":
                        await response.write(pod["raw"])
                    elif kind == "BOOKMARK" or node is None or pod["spec"].get("nodeName") == node:
                        line = json.dumps({"type": kind, "object": pod}).encode() + b"\n"
                        await response.write(line)
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pod_changed.wait(), min(left, 1.0))
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


def status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        status=code,
    )


def not_found(resource: str, name: str) -> web.Response:
    return status(404, "NotFound", f'{resource} "{name}" not found')


def label_problems(labels: dict[str, Any]) -> list[str]:
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or not _LABEL_NAME.match(name):
            problems.append(f"metadata.labels: Invalid value: {key!r}: invalid label key")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            problems.append(f"metadata.labels: Invalid value: {value!r}: invalid label value")
    return problems


# --- wiring the agent's node integration to the fake, for tests --------------------------------

NODE = "gpu-node-1"


@dataclass(frozen=True)
class Change:
    """The shape the GPU health watcher reports (duck-typed by the node integration)."""

    uuid: str
    healthy: bool
    reason: str = ""
    xid: int | None = None


def gpu(index: int, name: str = "NVIDIA A100-SXM4-80GB", mib: int = 81920) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name=name,
        memory_total=mib * MIB,
        minor=index,
        pci_bus_id=f"00000000:{index + 1:02x}:00.0",
        compute_capability=(8, 0),
    )


@dataclass
class Wired:
    api: FakeKubeAPI
    node: NodeIntegration
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def wired(
    tmp_path: Path,
    *,
    request_timeout: float = 0.5,
    labels: dict[str, str] | None = None,
    **options: Any,
) -> AsyncIterator[Wired]:
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE, labels)
    node = NodeIntegration(
        NODE,
        str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        namespace="vgpu-system",
        request_timeout=request_timeout,
        backoff_initial=0.02,
        backoff_cap=0.1,
        **options,
    )
    task = asyncio.create_task(node.run())
    try:
        yield Wired(api, node, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.stop()

"""A fake Kubernetes API server on aiohttp: nodes and core/v1 events, with faults on demand.

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
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from vgpu_agent.gpu.model import MIB, GpuInfo
from vgpu_agent.kube.node import NodeIntegration

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

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


@dataclass
class _Fault:
    method: str | None
    path: re.Pattern[str]
    times: int
    status: int = 0  # 0: stall instead of answering
    seconds: float = 0.0
    action: Any = None  # called after the request was answered
    handled: bool = False  # stall after the request took effect (only the answer is late)


@dataclass
class FakeKubeAPI:
    token: str | None = "test-token"
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # ns -> name -> obj
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (ns, name) -> pod
    evicted: list[tuple[str, str, str]] = field(default_factory=list)  # (ns, name, uid)
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    _rv: int = 100
    _faults: list[_Fault] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _changed: asyncio.Condition | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1 (a new port the first time, the same port after a stop)."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        app.router.add_get("/api/v1/namespaces/{ns}/events", self._list_events)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get_pod)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/eviction", self._evict_pod)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
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

    async def stop(self) -> None:
        """Close the port: clients now get 'connection refused'."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

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

    def add_pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                         "resourceVersion": self._next_rv()},
            "spec": {"containers": [{"name": "main"}]},
            "status": {"phase": "Running"},
        }
        self.pods[(namespace, name)] = pod
        return pod

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

    def _take_fault(self, request: web.Request, actions: bool = False) -> _Fault | None:
        for fault in self._faults:
            if (fault.action is not None) != actions:
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
        record = Recorded(request.method, request.path, request.content_type, body=body)
        self.requests.append(record)
        request[_BODY] = body
        try:
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

    async def _get_pod(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        pod = self.pods.get(key)
        if pod is None:
            return not_found("pods", key[1])
        return web.json_response(pod)

    async def _evict_pod(self, request: web.Request) -> web.Response:
        """policy/v1 Eviction: the pod is deleted (no disruption budgets here); a UID
        precondition that does not match is a 409, as the API server answers."""
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = request[_BODY]
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            return status(400, "BadRequest", "body must be a policy/v1 Eviction")
        if body.get("metadata", {}).get("name") != name:
            return status(400, "BadRequest", "name in the body does not match the URL")
        pod = self.pods.get((ns, name))
        if pod is None:
            return not_found("pods", name)
        uid = (body.get("deleteOptions") or {}).get("preconditions", {}).get("uid")
        if uid is not None and uid != pod["metadata"]["uid"]:
            return status(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, "
                          f"UID in object meta: {pod['metadata']['uid']}")
        del self.pods[(ns, name)]
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


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if kind == "add":
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        elif kind == "replace":
            if last not in parent:
                raise KeyError(op["path"])
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "test":
            if parent.get(last) != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unsupported op {kind!r}")
    return doc


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

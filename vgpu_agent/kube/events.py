"""Kubernetes Events (core/v1) that say a GPU went bad or came back. Pure.

Events are attached to the Node object so `kubectl describe node` shows them; they live in the
agent's own namespace, which lets the agent's RBAC grant `create events` there only.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Protocol

COMPONENT = "vgpu-agent"
REASON_UNHEALTHY = "GpuUnhealthy"
REASON_HEALTHY = "GpuHealthy"
_MAX_MESSAGE = 1024  # the API server rejects longer event messages


class HealthChangeLike(Protocol):
    """What the GPU health watcher reports: one GPU turning unhealthy or healthy."""

    @property
    def uuid(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def xid(self) -> int | None: ...


@dataclass(frozen=True)
class NodeRef:
    """The node an event is about. The UID is what `kubectl describe node` matches on."""

    name: str
    uid: str


def health_message(change: HealthChangeLike) -> str:
    state = "healthy again" if change.healthy else "unhealthy"
    parts = [f"GPU {change.uuid} is {state}"]
    if change.xid is not None:
        parts.append(f"XID {change.xid}")
    if change.reason:
        parts.append(change.reason)
    return ": ".join(parts)[:_MAX_MESSAGE]


def health_event(
    change: HealthChangeLike, node: NodeRef, namespace: str, now: dt.datetime, seq: int
) -> dict[str, Any]:
    """The body of a core/v1 Event for one health change. `seq` keeps names unique in a second."""
    if now.tzinfo is None:
        raise ValueError("event time must carry a time zone")
    stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{node.name[:200].rstrip('.-')}.{int(now.timestamp() * 1e9):x}.{seq}",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": COMPONENT},
        },
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid},
        "reason": REASON_HEALTHY if change.healthy else REASON_UNHEALTHY,
        "message": health_message(change),
        "type": "Normal" if change.healthy else "Warning",
        "source": {"component": COMPONENT, "host": node.name},
        "reportingComponent": COMPONENT,
        "reportingInstance": node.name,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


# --- events on pods (a refused vgpu.io/ annotation, memory spilled to the host) -----------------

REASON_ANNOTATION_REFUSED = "VgpuAnnotationRefused"
# a container over its GPU limits, found by the agent's own check (and evicted for it)
REASON_BACKSTOP = "VgpuLimitExceeded"
REASON_EVICTED = "VgpuEvicted"
REASON_MEMORY_SPILLED = "VgpuMemorySpilled"


@dataclass(frozen=True)
class PodRef:
    """The pod an event is about. Events on a pod live in the pod's namespace."""

    namespace: str
    name: str
    uid: str


def pod_event(
    pod: PodRef,
    reason: str,
    message: str,
    host: str,
    now: dt.datetime,
    seq: int,
    event_type: str = "Warning",
    container: str = "",
) -> dict[str, Any]:
    """The body of a core/v1 Event about `pod` (Warning unless told), reported from `host`; with
    `container`, about that container of it."""
    if event_type not in ("Normal", "Warning"):
        raise ValueError(f"event type {event_type!r} is not allowed: Normal or Warning")
    if now.tzinfo is None:
        raise ValueError("event time must carry a time zone")
    stamp = now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{pod.name[:200].rstrip('.-')}.{int(now.timestamp() * 1e9):x}.{seq}",
            "namespace": pod.namespace,
            "labels": {"app.kubernetes.io/name": COMPONENT},
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": pod.namespace,
            "name": pod.name,
            "uid": pod.uid,
            **({"fieldPath": f"spec.containers{{{container}}}"} if container else {}),
        },
        "reason": reason,
        "message": message[:_MAX_MESSAGE],
        "type": event_type,
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT,
        "reportingInstance": host,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def eviction(pod: PodRef) -> dict[str, Any]:
    """The policy/v1 Eviction of a pod, bound to its UID so that a pod recreated under the same
    name is not the one evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
        "deleteOptions": {"preconditions": {"uid": pod.uid}},
    }


@dataclass(frozen=True)
class SpilledDevice:
    """One GPU of a container whose allocations went past the card into host memory."""

    gpu_uuid: str
    gpu_index: int | None  # None: the GPU is not in this node's inventory
    spilled_bytes: int
    limit_bytes: int


def spill_message(container: str, devices: list[SpilledDevice]) -> str:
    """What a container that spilled is told: how much, on which GPU, what it costs."""
    parts = []
    for d in devices:
        where = f"GPU {d.gpu_index} ({d.gpu_uuid})" if d.gpu_index is not None else d.gpu_uuid
        parts.append(
            f"{d.spilled_bytes / (1 << 20):.1f} MiB on {where} "
            f"(limit {d.limit_bytes / (1 << 20):.0f} MiB)"
        )
    text = (
        f"container {container} went past the GPU's physical memory: "
        + ", ".join(parts)
        + " served from host memory (managed memory, charged to the container's memory "
        "limit; slower than device memory)"
    )
    return text[:_MAX_MESSAGE]

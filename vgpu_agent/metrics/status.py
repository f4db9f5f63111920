"""The `/status` document: the node's GPUs and every allocation on them, as one JSON object.

Built from the same caches as a scrape (a `Snapshot`, the region samples of the same round and
the controller's last decisions), so `/status` and `/metrics` agree and a request costs no NVML
call and no file read beyond what a scrape does. Pure: no I/O.

Schema (``schema_version`` 1; fields are only ever added within a version):

    {"schema_version": 1, "node": str, "agent_version": str, "generated_at": float (unix s),
     "registered": bool | null,
     "gpus": [{"uuid", "index", "model", "memory_total_bytes",
               "memory_used_bytes": int | null, "utilization_ratio": float | null,
               "healthy": bool | null, "readings_stale": bool, "slices_total",
               "slices_allocated", "nvml_time_sliced": bool | null (the throttle reads
               the GPU's NVML samples as time-sliced: its containers' measured use is then
               an estimate from their tokens; null without a throttle controller),
               "nvml_use_only_strangers": bool | null (its busy samples have gone only to
               processes no container claims, while containers spend, for 10 s or more:
               none of its containers can be measured; null without a throttle controller),
               "uncharged_use_ratio": float | null (of a time-sliced GPU's use at the last
               batch of samples, the part its containers' tokens do not explain and nobody
               was charged: NVML counting it busy beyond the work, or a few points of a
               figure taken light; null where not split)}],
     "allocations": [{"alloc_id", "seq", "namespace", "pod", "container" (null until
                      PodResources names the holder), "state", "priority", "policy_source"
                      ("pod": its pod's annotations chose policy and priority, "default": the
                      node's; null when the agent does not say), "error",
                      "devices": [{"gpu_uuid", "gpu_index" (null: not on this node),
                                   "memory_limit_bytes" (0 = none), "memory_used_bytes",
                                   "memory_by_kind_bytes" ({"data", "context", "module",
                                   "pool"}, adding up to memory_used_bytes),
                                   "memory_spilled_bytes" (of data: served from managed
                                   memory because the card was full; 0 without spilling),
                                   "core_limit_ratio", "core_target_ratio",
                                   "core_measured_ratio", "policy", "rate_limited",
                                   "open_loop", "paused" (bool | null: its launches held
                                   for a neighbour's turn alone on a time-sliced GPU,
                                   under 2 s; null without a controller's decision),
                                   "token_wait_seconds", "launches",
                                   "last_launch_age_seconds"}]}]}

`state` is one of ``active`` (the container's current region), ``unidentified`` (PodResources
has not named its holder yet), ``superseded`` (its container has a newer region; this one awaits
garbage collection), ``corrupt`` or ``unreadable`` (the container's `state` file). Values the
agent does not know are null, never a made-up zero: usage of a corrupt region, a share before the
controller's first tick. Ratios are 0..1 of the GPU, like the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vgpu_agent import __version__
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.metrics.collectors import (
    ContainerDevice,
    Snapshot,
    container_devices,
    launch_age_s,
    memory_by_kind,
)
from vgpu_agent.metrics.poller import RegionSample
from vgpu_agent.metrics.sources import Identity, ThrottleStatus

SCHEMA_VERSION = 1
ALLOCATION_STATES = ("active", "unidentified", "superseded", "corrupt", "unreadable")
_UNKNOWN: Identity = ("", "", "")


def build_status(
    snap: Snapshot,
    regions: Sequence[RegionSample],
    identity: Callable[[str], Identity | None],
    throttle: Mapping[tuple[str, int], ThrottleStatus],
    now_s: float | None = None,
    policy_source: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The status document for one round of the caches."""
    by_uuid = {gpu.uuid: gpu for gpu in snap.gpus}
    identities = {region.alloc_id: identity(region.alloc_id) for region in regions}
    newest: dict[Identity, int] = {}
    for region in regions:
        who = identities[region.alloc_id]
        if who is not None:
            newest[who] = max(newest.get(who, region.seq), region.seq)

    allocations = []
    for region in sorted(regions, key=lambda r: r.seq):
        who = identities[region.alloc_id]
        entries = container_devices(who or _UNKNOWN, region, by_uuid, throttle)
        allocations.append(
            {
                "alloc_id": region.alloc_id,
                "seq": region.seq,
                "namespace": who[0] if who else None,
                "pod": who[1] if who else None,
                "container": who[2] if who else None,
                "state": _state(region, who, newest),
                "priority": region.priority,
                "policy_source": policy_source(region.alloc_id) if policy_source else None,
                "error": region.error or None,
                "devices": [_device(snap, entry, throttle) for entry in entries],
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "node": snap.node,
        "agent_version": __version__,
        "generated_at": time.time() if now_s is None else now_s,
        "registered": snap.registered,
        "gpus": [_gpu(snap, gpu) for gpu in snap.gpus],
        "allocations": allocations,
    }


def _state(region: RegionSample, who: Identity | None, newest: Mapping[Identity, int]) -> str:
    if region.usage is None:
        return "unreadable"
    if region.usage.corrupt:
        return "corrupt"
    if who is None:
        return "unidentified"
    return "active" if newest[who] == region.seq else "superseded"


def _gpu(snap: Snapshot, gpu: GpuInfo) -> dict[str, Any]:
    uuid = gpu.uuid
    sample = snap.gpu_samples.get(uuid)
    readings = sample.readings if sample is not None and not sample.stale else None
    return {
        "uuid": gpu.uuid,
        "index": gpu.index,
        "model": gpu.name,
        "memory_total_bytes": gpu.memory_total,
        "memory_used_bytes": readings.memory_used if readings is not None else None,
        "utilization_ratio": readings.utilization if readings is not None else None,
        "healthy": snap.healthy.get(uuid) if snap.healthy is not None else None,
        "readings_stale": bool(sample is not None and sample.stale),
        "slices_total": snap.slices_per_gpu,
        "slices_allocated": snap.slices_allocated.get(uuid, 0),
        "nvml_time_sliced": uuid in snap.time_sliced if snap.time_sliced is not None else None,
        "nvml_use_only_strangers": (uuid in snap.only_strangers
                                    if snap.only_strangers is not None else None),
        "uncharged_use_ratio": (_ratio(snap.uncharged[uuid])
                                if snap.uncharged is not None and uuid in snap.uncharged
                                else None),
    }


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else max(0.0, min(100.0, percent)) / 100.0


def _device(
    snap: Snapshot, entry: ContainerDevice, throttle: Mapping[tuple[str, int], ThrottleStatus]
) -> dict[str, Any]:
    status = throttle.get((entry.alloc_id, entry.dev))
    known = entry.usage_known
    age = launch_age_s(snap, entry)
    return {
        "gpu_uuid": entry.uuid,
        "gpu_index": entry.gpu.index if entry.gpu is not None else None,
        "memory_limit_bytes": entry.memory_limit,
        "memory_used_bytes": entry.memory_used if known else None,
        "memory_by_kind_bytes": memory_by_kind(entry) if known else None,
        "memory_spilled_bytes": entry.memory_spilled if known else None,
        "core_limit_ratio": _ratio(entry.core_limit),
        "core_target_ratio": _ratio(status.target) if status is not None else None,
        "core_measured_ratio": _ratio(entry.utilization),
        "policy": status.policy if status is not None else entry.policy,
        "rate_limited": status.rate_limited if status is not None else None,
        "open_loop": entry.open_loop,
        "paused": entry.paused,
        "token_wait_seconds": entry.wait_ns / 1e9 if known else None,
        "launches": entry.launches if known else None,
        "last_launch_age_seconds": age,
    }

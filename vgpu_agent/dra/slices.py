"""What this node publishes as its DRA ResourceSlice: one device per physical GPU. Pure.

Every GPU is one device named `gpu-<index>` (a DNS label) that several claims share
(`allowMultipleAllocations`), each consuming part of two capacities:
- `memory`: floor(S x M) bytes rounded down to whole MiB (M the GPU's memory, S the memory
  scaling), requested in 1 MiB steps; a claim that names no amount gets one slice's memory
  (floor(S x M / K), K the split count, rounded down to whole MiB);
- `cores`: 100 (percent of the GPU's compute), in steps of 1; a claim that names no amount gets
  one slice's share (C x 100 / K, C the cores scaling, rounded down, at least 1).
So a plain request gets exactly what one device-plugin slice is worth, and `memory: 10Gi,
cores: 30` gets that much of one GPU.

Attributes (in the driver's domain, so a selector reads `device.attributes["<driver>"].uuid`):
`uuid`, `productName`, `index`, `minor`, `pciBusID` (strings and ints as NVML reports them),
`architecture` (from the compute capability: "Ampere", "Hopper", ...), `cudaComputeCapability`
and `driverVersion` as semantic versions ("8.0.0", "550.54.15"; the convention of NVIDIA's DRA
driver, so selectors can compare them), `numaNode` only when known.

Health becomes device taints, which keep new claims off the GPU (`NoSchedule`) or also evict the
pods already using it (`NoExecute`):
- a critical XID: `<driver>/xid=<n>:NoSchedule`;
- the GPU is lost (NVML says so, or XID 79, "fallen off the bus"): `<driver>/gpu-lost:NoExecute`;
- any other failing NVML query: `<driver>/unhealthy=nvml-query-failed:NoSchedule`.
A recovered GPU has no taint.

The pool is the node's name, one slice holds every GPU (a node has far fewer than the 64 devices
a slice with taints may hold); `pool.generation` is chosen by the publisher, which bumps it on
every change.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu_agent.deviceplugin.allocation import Split
from vgpu_agent.dra.quantity import canonical, format_quantity
from vgpu_agent.gpu.model import MIB, GpuInfo

API_VERSION = "resource.k8s.io/v1"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "vgpu-agent"
MAX_DEVICES_WITH_TAINTS = 64
LOST_XIDS = frozenset({79})  # "GPU has fallen off the bus"
_STRING_LIMIT = 64  # API limit on a string attribute
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

# compute capability major (and minor where it matters) -> architecture name
_ARCHITECTURES: dict[tuple[int, int | None], str] = {
    (3, None): "Kepler",
    (5, None): "Maxwell",
    (6, None): "Pascal",
    (7, 0): "Volta",
    (7, 2): "Volta",
    (7, 5): "Turing",
    (8, 9): "Ada Lovelace",
    (8, None): "Ampere",
    (9, None): "Hopper",
    (10, None): "Blackwell",
    (12, None): "Blackwell",
}


class SliceError(ValueError):
    """The inventory cannot be published as asked (the message names the bad value)."""


@dataclass(frozen=True)
class DeviceHealth:
    """A GPU's health as the slice shows it."""

    healthy: bool = True
    xid: int | None = None
    lost: bool = False
    reason: str = ""


HEALTHY = DeviceHealth()
_XID_IN_REASON = re.compile(r"\bXID (\d+)\b")
_LOST_IN_REASON = "GPU is lost"


def classify_health(healthy: bool, reason: str = "", xid: int | None = None,
                    lost: bool | None = None) -> DeviceHealth:
    """Turn a health report (as the GPU health monitor gives it) into what the slice shows.
    `lost` is taken from the report when it says; otherwise from NVML's "GPU is lost" error
    text in the reason, or an XID that means the GPU is gone."""
    if healthy:
        return HEALTHY
    if xid is None:
        found = _XID_IN_REASON.search(reason)
        xid = int(found[1]) if found else None
    if lost is None:
        lost = _LOST_IN_REASON in reason or (xid is not None and xid in LOST_XIDS)
    return DeviceHealth(False, xid, lost, reason)


def taints(health: DeviceHealth, driver: str) -> list[dict[str, str]]:
    if health.healthy:
        return []
    if health.lost:
        return [{"key": f"{driver}/gpu-lost", "value": "true", "effect": "NoExecute"}]
    if health.xid is not None:
        return [{"key": f"{driver}/xid", "value": str(health.xid), "effect": "NoSchedule"}]
    return [{"key": f"{driver}/unhealthy", "value": "nvml-query-failed", "effect": "NoSchedule"}]


def device_name(gpu: GpuInfo) -> str:
    """The DNS-label name of a GPU's device in the slice."""
    return f"gpu-{gpu.index}"


def architecture(capability: tuple[int, int]) -> str | None:
    major, minor = capability
    return _ARCHITECTURES.get((major, minor)) or _ARCHITECTURES.get((major, None))


def semver(text: str | None) -> str | None:
    """A driver version such as "535.104.05" or "560.28" as a semantic version ("535.104.5",
    "560.28.0"); None when it is not made of numbers."""
    if not text:
        return None
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def _whole_mib(size: float) -> int:
    return int(size // MIB) * MIB


def memory_capacity(gpu: GpuInfo, split: Split) -> tuple[int, int]:
    """(capacity, default) in bytes, both whole MiB."""
    total = _whole_mib(split.memory_scaling * gpu.memory_total)
    default = _whole_mib(split.slice_memory(gpu.memory_total))
    if default < MIB or total < 2 * MIB:
        raise SliceError(
            f"GPU {gpu.uuid} memory {gpu.memory_total} bytes split {split.count} ways leaves "
            f"{default} bytes per slice; at least 1 MiB per slice (and 2 MiB in all) is needed"
        )
    return total, default


def cores_default(split: Split) -> int:
    return max(1, min(100, int(split.slice_cores())))


def build_device(
    gpu: GpuInfo, split: Split, driver: str, health: DeviceHealth = HEALTHY,
    driver_version: str | None = None,
) -> dict[str, Any]:
    memory, memory_default = memory_capacity(gpu, split)
    attributes: dict[str, dict[str, Any]] = {
        "uuid": {"string": gpu.uuid[:_STRING_LIMIT]},
        "productName": {"string": gpu.name[:_STRING_LIMIT]},
        "index": {"int": gpu.index},
        "minor": {"int": gpu.minor},
    }
    if gpu.pci_bus_id:
        attributes["pciBusID"] = {"string": gpu.pci_bus_id[:_STRING_LIMIT]}
    arch = architecture(gpu.compute_capability)
    if arch:
        attributes["architecture"] = {"string": arch}
    if gpu.compute_capability != (0, 0):
        major, minor = gpu.compute_capability
        attributes["cudaComputeCapability"] = {"version": f"{major}.{minor}.0"}
    version = semver(driver_version)
    if version:
        attributes["driverVersion"] = {"version": version}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attributes["numaNode"] = {"int": gpu.numa_node}
    device: dict[str, Any] = {
        "name": device_name(gpu),
        "attributes": attributes,
        "capacity": {
            "memory": {
                "value": format_quantity(memory, "BinarySI"),
                "requestPolicy": {
                    "default": format_quantity(memory_default, "BinarySI"),
                    "validRange": {
                        "min": "1Mi",
                        "max": format_quantity(memory, "BinarySI"),
                        "step": "1Mi",
                    },
                },
            },
            "cores": {
                "value": "100",
                "requestPolicy": {
                    "default": str(cores_default(split)),
                    "validRange": {"min": "1", "max": "100", "step": "1"},
                },
            },
        },
        "allowMultipleAllocations": True,
    }
    device_taints = taints(health, driver)
    if device_taints:
        device["taints"] = device_taints
    return device


def build_spec(
    node: str,
    driver: str,
    gpus: Sequence[GpuInfo],
    split: Split,
    health: Mapping[str, DeviceHealth],
    generation: int,
    driver_version: str | None = None,
) -> dict[str, Any]:
    """The slice's `spec` for these GPUs (MIG-enabled GPUs are not offered, as in the device
    plugin), at pool generation `generation`."""
    if len(driver) > 63 or not _DNS_SUBDOMAIN.match(driver):
        raise SliceError(
            f"driver name {driver!r} is not a DNS subdomain of at most 63 characters "
            "(lower-case letters, digits, '-' and '.'), e.g. gpu.vgpu.io"
        )
    if not _DNS_SUBDOMAIN.match(node):
        raise SliceError(f"node name {node!r} is not a DNS subdomain")
    offered = sorted((g for g in gpus if not g.mig_enabled), key=lambda g: g.index)
    if len(offered) > MAX_DEVICES_WITH_TAINTS:
        raise SliceError(
            f"{len(offered)} GPUs on node {node}: one ResourceSlice holds at most "
            f"{MAX_DEVICES_WITH_TAINTS} devices"
        )
    names = [device_name(g) for g in offered]
    if len(set(names)) != len(names):
        raise SliceError(f"GPU indexes are not unique on node {node}: {names}")
    return {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": [
            build_device(g, split, driver, health.get(g.uuid, HEALTHY), driver_version)
            for g in offered
        ],
    }


def slice_name(node: str, driver: str) -> str:
    """A fixed name per node and driver, so a restarted agent finds (and the API server refuses
    a second copy of) its slice. Long names are cut and made unique with a hash."""
    name = f"{node}-{driver}".lower()
    if len(name) <= 253 and _DNS_SUBDOMAIN.match(name):
        return name
    digest = hashlib.sha256(f"{node}/{driver}".encode()).hexdigest()[:10]
    cut = re.sub(r"[^a-z0-9.-]", "-", name)[:240].strip(".-")
    return f"{cut}-{digest}"


def slice_object(
    node: str, driver: str, spec: dict[str, Any], node_uid: str | None = None
) -> dict[str, Any]:
    """The whole ResourceSlice; owned by the Node when its uid is known, so it goes when the
    Node goes."""
    metadata: dict[str, Any] = {
        "name": slice_name(node, driver),
        "labels": {MANAGED_BY_LABEL: MANAGED_BY},
    }
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
             "controller": True}
        ]
    return {"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata,
            "spec": spec}


# --- comparing what is stored with what is wanted ------------------------------------------------


def _normal(value: Any, key: str = "") -> Any:
    """A form in which equal slices compare equal: quantities by value, taints without the time
    the server stamps on them."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "timeAdded":
                continue
            if k in ("value", "default", "min", "max", "step") and isinstance(v, str | int) and (
                not isinstance(v, bool)
            ):
                try:
                    out[k] = canonical(v)
                    continue
                except ValueError:
                    pass
            out[k] = _normal(v, k)
        return out
    if isinstance(value, list):
        return [_normal(v, key) for v in value]
    return value


def same_devices(stored_spec: Mapping[str, Any], wanted_spec: Mapping[str, Any]) -> bool:
    """Whether the stored spec publishes what is wanted, generation aside."""
    def strip(spec: Mapping[str, Any]) -> Any:
        pool = dict(spec.get("pool") or {})
        pool.pop("generation", None)
        return _normal({**spec, "pool": pool})

    return bool(strip(stored_spec) == strip(wanted_spec))


def carry_taint_times(wanted_spec: dict[str, Any], stored_spec: Mapping[str, Any]) -> None:
    """Keep `timeAdded` of taints that were already there, so rewriting a slice does not
    restart the eviction clock of a NoExecute taint."""
    stored = {
        d.get("name"): {
            (t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
            for t in d.get("taints") or []
            if t.get("timeAdded")
        }
        for d in stored_spec.get("devices") or []
    }
    for device in wanted_spec.get("devices") or []:
        times = stored.get(device.get("name"), {})
        for taint in device.get("taints") or []:
            when = times.get((taint.get("key"), taint.get("value"), taint.get("effect")))
            if when:
                taint["timeAdded"] = when


def metadata_current(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the stored slice has the labels and owner the publisher sets."""
    have, want = stored.get("metadata") or {}, wanted.get("metadata") or {}
    labels = have.get("labels") or {}
    if any(labels.get(k) != v for k, v in (want.get("labels") or {}).items()):
        return False
    if want.get("ownerReferences"):
        uids = {o.get("uid") for o in have.get("ownerReferences") or []}
        return want["ownerReferences"][0]["uid"] in uids
    return True

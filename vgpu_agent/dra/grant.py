"""A ResourceClaim's allocation, turned into the grant the device plugin would have made. Pure.

The kubelet's NodePrepareResources names a claim; the claim object (read from the API server by
the caller and handed in as its JSON) says what the scheduler chose in
`status.allocation.devices.results[]`: for each request a driver, pool and device, the capacity
consumed from a device that several claims share (`consumedCapacity`: `memory` in bytes, `cores`
in percent), and a `shareID` telling those claims apart. `status.allocation.devices.config[]`
carries opaque parameters per driver (`corePolicy`, `priority`).

`claim_grant()` checks all of it against this node's devices and returns a `ClaimGrant`: the
`Grant` a region is made from (the same type Allocate produces, so regions, the shim's variables,
the controller and the metrics stay one path), the core policy per device, the priority and what
the kubelet is told back per allocated device. Anything wrong raises `ClaimError`, whose message
names the claim, the field and what is allowed; the caller answers that one claim with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice, Split
from vgpu_agent.dra.quantity import QuantityError, parse
from vgpu_agent.dra.slices import device_name, memory_capacity
from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.priorityrule import Overreach, overreach

MEMORY = "memory"
CORES = "cores"
FULL_CORES = 100
CORE_POLICIES = ("off", "strict", "work-conserving")
PARAMETERS_KIND = "GpuConfig"
PARAMETERS_VERSION = "v1alpha1"
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
# the shim ABI's device ID field (vgpu_shm.h DEVICE_ID_LEN) holds at most 63 bytes and a NUL
REGION_ID_MAX = 63


class ClaimError(ValueError):
    """This claim cannot be prepared here; the message is what the kubelet reports."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class DeviceCapacity:
    """One published device: the GPU behind it and what all its claims together may consume."""

    name: str
    gpu: GpuInfo
    memory: int  # bytes
    cores: int  # percent


@dataclass(frozen=True)
class Parameters:
    """This driver's opaque parameters, after validation; None means "not set"."""

    core_policy: str | None = None
    priority: int | None = None


@dataclass(frozen=True)
class ClaimPriorityBound:
    """What a claim's own configuration (`source: FromClaim`, written by its tenant) may set as
    `priority`, as a pod's `vgpu.io/priority` annotation may: at most `most`, and above 0 only
    in `namespaces`. A DeviceClass's configuration (`FromClass`, the cluster admin's) is not
    bounded."""

    most: int
    namespaces: frozenset[str]


@dataclass(frozen=True)
class PreparedDevice:
    """One allocation result of this driver, as the kubelet is told about it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    share_id: str | None
    uuid: str
    admin_access: bool


@dataclass(frozen=True)
class ClaimGrant:
    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    grant: Grant | None  # None when nothing is limited (only admin access, or no results)
    policies: tuple[str | None, ...]  # per grant device; None: the agent's default
    priority: int
    consumed: Mapping[str, tuple[int, int]]  # GPU uuid -> (memory bytes, core percent)


def device_table(gpus: Iterable[GpuInfo], split: Split) -> dict[str, DeviceCapacity]:
    """Published device name -> capacity, exactly as the ResourceSlice declares them."""
    table = {}
    for gpu in gpus:
        memory, _ = memory_capacity(gpu, split)
        table[device_name(gpu)] = DeviceCapacity(device_name(gpu), gpu, memory, FULL_CORES)
    return table


def region_device_id(claim_uid: str, device: str) -> str:
    """The ID a claim's device gets in its region and CDI name: `<claim uid>-<device>`."""
    return f"{claim_uid}-{device}"


def claim_grant(
    claim: Mapping[str, Any],
    ref: ClaimRef,
    *,
    driver: str,
    node: str,
    devices: Mapping[str, DeviceCapacity],
    priority_bound: ClaimPriorityBound | None = None,
) -> ClaimGrant:
    """Check `claim` (the API object as JSON) and say what it is granted on this node.
    `priority_bound`: what the claim's own configuration may set as priority (None: any)."""
    meta = _mapping(claim.get("metadata"), ref, "metadata")
    if meta.get("uid") != ref.uid:
        raise ClaimError(
            f"claim {ref}: the API server has uid {meta.get('uid')!r} under this name: the claim "
            "the kubelet means was deleted (and perhaps made again)"
        )
    if meta.get("deletionTimestamp") and not _allocation(claim):
        raise ClaimError(f"claim {ref}: being deleted and no longer allocated")
    allocation = _allocation(claim)
    if allocation is None:
        raise ClaimError(f"claim {ref}: status.allocation is empty: the claim is not allocated")
    alloc_devices = _mapping(allocation.get("devices", {}), ref, "status.allocation.devices")
    results = _list(alloc_devices.get("results", []), ref, "status.allocation.devices.results")
    ours = []
    for i, result in enumerate(results):
        where = f"status.allocation.devices.results[{i}]"
        result = _mapping(result, ref, where)
        if result.get("driver") != driver:
            continue
        ours.append((where, result))
    if not ours:
        drivers = sorted({str(r.get("driver")) for r in results if isinstance(r, Mapping)})
        raise ClaimError(
            f"claim {ref}: no device of it is allocated from driver {driver} "
            f"(its results are from: {', '.join(drivers) or 'none'})"
        )
    params = _parameters_by_request(alloc_devices.get("config", []), ref, driver,
                                    priority_bound)

    prepared: list[PreparedDevice] = []
    limited: dict[str, list[tuple[int, int, str]]] = {}  # uuid -> (memory, cores, request)
    for where, result in ours:
        pool, name = result.get("pool"), result.get("device")
        request = result.get("request")
        if not isinstance(request, str) or not request:
            raise ClaimError(f"claim {ref}: {where}.request is {request!r}: a request name")
        if pool != node:
            raise ClaimError(
                f"claim {ref}: {where} is in pool {pool!r}, but this node's pool is {node!r}: "
                "the claim was allocated for another node"
            )
        device = devices.get(name) if isinstance(name, str) else None
        if device is None:
            raise ClaimError(
                f"claim {ref}: {where}.device {name!r} is not a device of this node "
                f"(devices: {', '.join(sorted(devices)) or 'none'})"
            )
        share = result.get("shareID")
        if share is not None and (not isinstance(share, str) or not share):
            raise ClaimError(f"claim {ref}: {where}.shareID is {share!r}: a non-empty string")
        admin = result.get("adminAccess") is True
        prepared.append(
            PreparedDevice((request,), node, device.name, share, device.gpu.uuid, admin)
        )
        if admin:
            continue  # monitoring access: the device without limits, consuming nothing
        memory, cores = _consumed(result.get("consumedCapacity"), device, ref, where)
        limited.setdefault(device.gpu.uuid, []).append((memory, cores, request))

    granted: list[GrantedDevice] = []
    policies: list[str | None] = []
    consumed: dict[str, tuple[int, int]] = {}
    priorities: set[int] = set()
    by_uuid = {d.gpu.uuid: d for d in devices.values()}
    for uuid in sorted(limited, key=lambda u: by_uuid[u].gpu.index):
        device = by_uuid[uuid]
        memory = sum(m for m, _, _ in limited[uuid])
        cores = sum(c for _, c, _ in limited[uuid])
        if memory > device.memory or cores > device.cores:
            raise ClaimError(
                f"claim {ref}: consumes memory {memory} bytes and cores {cores}% of device "
                f"{device.name}, which has {device.memory} bytes and {device.cores}%"
            )
        consumed[uuid] = (memory, cores)
        granted.append(GrantedDevice(uuid, device.gpu.index, 1, memory, float(cores)))
        requests = [r for _, _, r in limited[uuid]]
        device_policies = {params(r).core_policy for r in requests} - {None}
        if len(device_policies) > 1:
            raise ClaimError(
                f"claim {ref}: requests {requests} on device {device.name} set different "
                f"corePolicy values {sorted(p for p in device_policies if p)}: one per device"
            )
        policies.append(device_policies.pop() if device_policies else None)
        priorities |= {p for r in requests if (p := params(r).priority) is not None}
    if len(priorities) > 1:
        raise ClaimError(
            f"claim {ref}: its requests set different priority values {sorted(priorities)}: "
            "a claim has one priority"
        )
    grant = None
    if granted:
        ids = tuple(region_device_id(ref.uid, by_uuid[d.uuid].name) for d in granted)
        for device_id in ids:
            if len(device_id.encode()) > REGION_ID_MAX:
                raise ClaimError(f"claim {ref}: device ID {device_id!r} is over 63 bytes")
        grant = Grant(ids, tuple(granted))
    return ClaimGrant(
        ref,
        tuple(prepared),
        grant,
        tuple(policies),
        priorities.pop() if priorities else 0,
        consumed,
    )


def over_capacity(
    new: ClaimGrant,
    prepared: Iterable[ClaimGrant],
    devices: Mapping[str, DeviceCapacity],
) -> str | None:
    """Why `new` does not fit beside the claims already prepared on this node, or None.

    The scheduler should never allocate more than a device has; a stale or hand-edited
    allocation could, and two regions promising the same memory would let both run out.
    """
    by_uuid = {d.gpu.uuid: d for d in devices.values()}
    for uuid, (memory, cores) in new.consumed.items():
        others = [g for g in prepared if g.claim.uid != new.claim.uid and uuid in g.consumed]
        used_memory = sum(g.consumed[uuid][0] for g in others)
        used_cores = sum(g.consumed[uuid][1] for g in others)
        device = by_uuid[uuid]
        if used_memory + memory > device.memory or used_cores + cores > device.cores:
            names = ", ".join(str(g.claim) for g in others)
            return (
                f"claim {new.claim} asks memory {memory} bytes and cores {cores}% of device "
                f"{device.name}, where {names} already hold {used_memory} bytes and "
                f"{used_cores}% of {device.memory} bytes and {device.cores}%"
            )
    return None


def parse_parameters(raw: object, where: str, driver: str) -> Parameters:
    """Validate this driver's opaque parameters: `corePolicy`, `priority`, and optionally
    `apiVersion: <driver>/v1alpha1` and `kind: GpuConfig`. Unknown fields are rejected."""
    if not isinstance(raw, Mapping):
        raise ClaimError(f"{where} must be a JSON object, got {type(raw).__name__}")
    known = {"apiVersion", "kind", "corePolicy", "priority"}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ClaimError(
            f"{where} has unknown field(s) {', '.join(unknown)}: allowed are "
            "apiVersion, kind, corePolicy, priority"
        )
    version = f"{driver}/{PARAMETERS_VERSION}"
    if "apiVersion" in raw and raw["apiVersion"] != version:
        raise ClaimError(f"{where}.apiVersion is {raw['apiVersion']!r}: must be {version!r}")
    if "kind" in raw and raw["kind"] != PARAMETERS_KIND:
        raise ClaimError(f"{where}.kind is {raw['kind']!r}: must be {PARAMETERS_KIND!r}")
    policy = raw.get("corePolicy")
    if policy is not None and policy not in CORE_POLICIES:
        raise ClaimError(
            f"{where}.corePolicy is {policy!r}: must be one of {', '.join(CORE_POLICIES)}"
        )
    priority = raw.get("priority")
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
    ):
        raise ClaimError(f"{where}.priority is {priority!r}: must be a 32-bit signed integer")
    return Parameters(policy, priority)


# --- internals ----------------------------------------------------------------------------------


def _allocation(claim: Mapping[str, Any]) -> Mapping[str, Any] | None:
    status = claim.get("status")
    if not isinstance(status, Mapping):
        return None
    allocation = status.get("allocation")
    return allocation if isinstance(allocation, Mapping) else None


def _mapping(value: object, ref: ClaimRef, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ClaimError(f"claim {ref}: {where} is {type(value).__name__}, not an object")
    return value


def _list(value: object, ref: ClaimRef, where: str) -> Sequence[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ClaimError(f"claim {ref}: {where} is {type(value).__name__}, not a list")
    return value


def _parameters_by_request(raw: object, ref: ClaimRef, driver: str,
                           bound: ClaimPriorityBound | None = None
                           ) -> Callable[[str], Parameters]:
    """The merged parameters that apply to a request (by name).

    Entries come class configuration first, then the claim's: a later value overrides an
    earlier one, field by field. A priority from the claim's own configuration (any entry not
    `FromClass`) is held to `bound`.
    """
    merged: dict[str, Parameters] = {}
    everywhere = Parameters()
    pending: list[tuple[list[str], Parameters]] = []
    for i, entry in enumerate(_list(raw, ref, "status.allocation.devices.config")):
        where = f"status.allocation.devices.config[{i}]"
        entry = _mapping(entry, ref, where)
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        try:
            params = parse_parameters(
                opaque.get("parameters"), f"{where}.opaque.parameters", driver
            )
        except ClaimError as err:
            raise ClaimError(f"claim {ref}: {err}") from None
        if bound is not None and params.priority is not None \
                and entry.get("source") != "FromClass":
            _check_claim_priority(params.priority, bound, ref, where)
        requests = [str(r) for r in _list(entry.get("requests"), ref, f"{where}.requests")]
        pending.append((requests, params))
    for requests, params in pending:
        if not requests:
            everywhere = _overlay(everywhere, params)
            merged = {name: _overlay(p, params) for name, p in merged.items()}
        for name in requests:
            merged[name] = _overlay(merged.get(name, everywhere), params)

    def params_for(request: str) -> Parameters:
        # a subrequest's result is named "<request>/<subrequest>"; config may name either
        if request in merged:
            return merged[request]
        return merged.get(request.split("/", 1)[0], everywhere)

    return params_for


def _check_claim_priority(priority: int, bound: ClaimPriorityBound, ref: ClaimRef,
                          where: str) -> None:
    """A tenant's priority, held to the node's rules for pods (`pod_priority_max`,
    `pod_priority_namespaces`): otherwise a claim could put itself first on every
    oversubscribed GPU."""
    broken = overreach(priority, ref.namespace, bound.most, bound.namespaces)
    if broken is Overreach.ABOVE_MOST:
        raise ClaimError(
            f"claim {ref}: {where}.opaque.parameters.priority is {priority}: this node lets a "
            f"claim's own configuration set priorities up to {bound.most} (a DeviceClass may "
            "set more)"
        )
    if broken is Overreach.OUTSIDE_NAMESPACES:
        allowed = ", ".join(sorted(bound.namespaces)) or "no namespace"
        raise ClaimError(
            f"claim {ref}: {where}.opaque.parameters.priority is {priority}: priorities above 0 "
            f"are allowed to claims in {allowed} only (a DeviceClass may set them)"
        )


def _overlay(base: Parameters, top: Parameters) -> Parameters:
    return Parameters(
        top.core_policy if top.core_policy is not None else base.core_policy,
        top.priority if top.priority is not None else base.priority,
    )


def _consumed(raw: object, device: DeviceCapacity, ref: ClaimRef, where: str) -> tuple[int, int]:
    """(memory bytes, core percent) a result consumes; the whole device when none is listed."""
    if raw is None:
        return device.memory, device.cores
    capacity = _mapping(raw, ref, f"{where}.consumedCapacity")
    values: dict[str, Fraction] = {}
    for key, text in capacity.items():
        bare = str(key).rsplit("/", 1)[-1]
        if bare not in (MEMORY, CORES):
            continue  # a capacity this driver does not enforce
        try:
            values[bare] = parse(text)
        except QuantityError as err:
            raise ClaimError(f"claim {ref}: {where}.consumedCapacity.{key}: {err}") from None
    memory = values.get(MEMORY, Fraction(device.memory))
    cores = values.get(CORES, Fraction(device.cores))
    if not 0 < memory <= device.memory:
        raise ClaimError(
            f"claim {ref}: {where}.consumedCapacity.memory is {memory} bytes: device "
            f"{device.name} has {device.memory} (more than 0 and at most that is allowed)"
        )
    if not 0 < cores <= device.cores:
        raise ClaimError(
            f"claim {ref}: {where}.consumedCapacity.cores is {cores}: device {device.name} "
            f"has {device.cores} (more than 0 and at most that is allowed)"
        )
    return math.floor(memory), math.ceil(cores)

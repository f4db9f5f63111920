"""Splitting arithmetic, the preferred-allocation policies and what a container is granted.

Pure: the device plugin servicer hands in kubelet requests as plain lists and gets plain values
back. A GPU of memory M split K ways with memory scaling S and cores scaling C offers K slices,
each worth floor(S*M/K) bytes and C*100/K percent of its compute. Slices of one GPU given to one
container add up: the container sees that GPU once, with the summed share.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from vgpu_agent.deviceplugin.ids import DeviceIdError, format_device_id, parse_device_id, shown
from vgpu_agent.gpu.model import MIB, GpuInfo

Policy = Literal["spread", "binpack"]
Strategy = Literal["envvar", "cdi"]


@dataclass(frozen=True)
class Split:
    """How every GPU is cut: K slices, memory scaling S, cores scaling C."""

    count: int
    memory_scaling: float = 1.0
    cores_scaling: float = 1.0
    spill: bool = False  # memory_oversubscription: spill (has effect only with scaling above 1)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"split count {self.count} must be >= 1")
        if not self.memory_scaling > 0:
            raise ValueError(f"memory scaling {self.memory_scaling} must be > 0")
        if not self.cores_scaling > 0:
            raise ValueError(f"cores scaling {self.cores_scaling} must be > 0")

    def slice_memory(self, gpu_memory: int) -> int:
        return math.floor(self.memory_scaling * gpu_memory / self.count)

    def slice_cores(self) -> float:
        return self.cores_scaling * 100.0 / self.count

    @property
    def spills(self) -> bool:
        """Whether containers' allocations the card cannot hold are served from host memory."""
        return self.spill and self.memory_scaling > 1


@dataclass(frozen=True)
class AdvertisedDevice:
    device_id: str
    healthy: bool
    numa_node: int | None


def device_list(
    gpus: Iterable[GpuInfo], split: Split, healthy: Mapping[str, bool]
) -> list[AdvertisedDevice]:
    """The complete device set for ListAndWatch: every slice of every GPU, in order."""
    return [
        AdvertisedDevice(format_device_id(gpu.uuid, n), healthy.get(gpu.uuid, True), gpu.numa_node)
        for gpu in sorted(gpus, key=lambda g: g.index)
        for n in range(split.count)
    ]


# --- GetPreferredAllocation --------------------------------------------------------------------


def preferred_allocation(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: Policy,
    gpu_order: Mapping[str, int] | None = None,
) -> list[str]:
    """Choose `size` IDs from `available`, keeping every must-include ID that is available.

    spread: a container's slices land on distinct GPUs first, each time on the GPU with the most
    free slices. binpack: slices go to the GPU with the fewest free slices (the fullest) first.
    Only IDs from `available` are returned; malformed ones are never chosen. If fewer than `size`
    can be chosen the answer is short and the kubelet falls back to its own choice.
    """
    order = gpu_order or {}
    free: dict[str, list[tuple[int, str]]] = {}
    for device_id in dict.fromkeys(available):
        try:
            uuid, index = parse_device_id(device_id)
        except DeviceIdError:
            continue
        free.setdefault(uuid, []).append((index, device_id))
    for slices in free.values():
        slices.sort()
    offered = {device_id: uuid for uuid, slices in free.items() for _, device_id in slices}

    chosen: list[str] = []
    taken: set[str] = set()
    left = {uuid: len(slices) for uuid, slices in free.items()}
    used_on: dict[str, int] = {}

    def take(uuid: str, device_id: str) -> None:
        chosen.append(device_id)
        taken.add(device_id)
        left[uuid] -= 1
        used_on[uuid] = used_on.get(uuid, 0) + 1

    for device_id in dict.fromkeys(must_include):
        if len(chosen) >= size:
            break
        if device_id in offered:
            take(offered[device_id], device_id)

    def rank(uuid: str) -> tuple[int, int, int, str]:
        tie = (order.get(uuid, 1 << 30), uuid)
        if policy == "spread":
            return (used_on.get(uuid, 0), -left[uuid], *tie)
        return (-used_on.get(uuid, 0), left[uuid], *tie)

    # One heap entry per GPU with free slices, keyed by its rank: a pick changes only the rank
    # of the GPU picked, so each pick is O(log GPUs) and the whole choice O(n log n).
    heap = [(rank(uuid), uuid) for uuid in free if left[uuid]]
    heapq.heapify(heap)
    cursor = dict.fromkeys(free, 0)  # the lowest slice of each GPU not looked at yet
    while len(chosen) < size and heap:
        _, uuid = heapq.heappop(heap)
        slices, i = free[uuid], cursor[uuid]
        while slices[i][1] in taken:  # a must-include ID taken above
            i += 1
        cursor[uuid] = i + 1
        take(uuid, slices[i][1])
        if left[uuid]:
            heapq.heappush(heap, (rank(uuid), uuid))
    return chosen


# --- Allocate ----------------------------------------------------------------------------------


class AllocationError(ValueError):
    """The kubelet asked for IDs this plugin cannot grant; the message names the ID."""

    def __init__(self, device_id: str, reason: str):
        what = f"device ID {shown(device_id)}" if device_id else "the request"
        super().__init__(f"cannot allocate {what}: {reason}")
        self.device_id = device_id


@dataclass(frozen=True)
class GrantedDevice:
    """One physical GPU as a container sees it, with the container's share of it."""

    uuid: str
    gpu_index: int
    slices: int
    memory_limit: int  # bytes
    core_percent: float
    spill: bool = False  # allocations past the card's free memory go to host memory

    @property
    def memory_limit_mib(self) -> int:
        return self.memory_limit // MIB


@dataclass(frozen=True)
class Grant:
    """What one container request is given: its devices in the order the container sees them."""

    device_ids: tuple[str, ...]
    devices: tuple[GrantedDevice, ...]


def grant(device_ids: Sequence[str], gpus: Mapping[str, GpuInfo], split: Split) -> Grant:
    """Group the kubelet's chosen IDs by physical GPU and size each GPU's share.

    Raises AllocationError for a malformed ID, an unknown GPU, a slice number >= K, a repeated ID
    or an empty request.
    """
    if not device_ids:
        raise AllocationError("", "the container request has no device IDs")
    per_gpu: dict[str, set[int]] = {}
    for device_id in device_ids:
        try:
            uuid, index = parse_device_id(device_id)
        except DeviceIdError as err:
            raise AllocationError(device_id, str(err)) from None
        if uuid not in gpus:
            raise AllocationError(device_id, f"GPU {uuid} is not on this node")
        if index >= split.count:
            raise AllocationError(device_id, f"slice {index} is out of range 0..{split.count - 1}")
        if index in per_gpu.setdefault(uuid, set()):
            raise AllocationError(device_id, "the ID is listed twice")
        per_gpu[uuid].add(index)

    devices = []
    for uuid in sorted(per_gpu, key=lambda u: gpus[u].index):
        gpu, slices = gpus[uuid], len(per_gpu[uuid])
        memory = min(slices * split.slice_memory(gpu.memory_total), _memory_cap(gpu, split))
        cores = min(100.0, slices * split.slice_cores())
        devices.append(GrantedDevice(uuid, gpu.index, slices, memory, cores, split.spills))
    return Grant(tuple(device_ids), tuple(devices))


def grant_all(
    requests: Sequence[Sequence[str]], gpus: Mapping[str, GpuInfo], split: Split
) -> list[Grant]:
    """The grants of one Allocate, all or nothing; AllocationError names what is wrong.

    A node has `len(gpus) * split.count` slices and the kubelet hands each to one container, so
    a request for more containers or IDs than that, or an ID asked for twice, is refused before
    any ID is looked at: the work stays bounded by the node, whatever the request holds.
    """
    slices = len(gpus) * split.count
    if len(requests) > slices:
        raise AllocationError(
            "", f"{len(requests)} container requests; this node has {slices} slices"
        )
    total = sum(len(ids) for ids in requests)
    if total > slices:
        raise AllocationError("", f"{total} device IDs; this node has {slices} slices")
    grants = [grant(ids, gpus, split) for ids in requests]
    seen: set[str] = set()
    for g in grants:
        for device_id in g.device_ids:
            if device_id in seen:
                raise AllocationError(device_id, "the ID is granted to two containers")
            seen.add(device_id)
    return grants


def preferred_request_error(
    available: int, must_include: int, size: int, node_slices: int
) -> str:
    """Why a GetPreferredAllocation container request is too large for this node, "" if not."""
    for name, value in (
        ("available_deviceIDs", available),
        ("must_include_deviceIDs", must_include),
        ("allocation_size", size),
    ):
        if value > node_slices:
            return f"{name} has {value} entries; this node has {node_slices} slices"
    return ""


def _memory_cap(gpu: GpuInfo, split: Split) -> int:
    # Without oversubscription no container may be promised more than the card has.
    return math.floor(max(1.0, split.memory_scaling) * gpu.memory_total)


def container_envs(grant: Grant, strategy: Strategy) -> dict[str, str]:
    """Environment for the container: visible devices and per-device shares.

    Our own variables and the ones HAMi-core reads, so either interposer enforces the grant.
    HAMi-core takes one SM limit for all devices; it gets the smallest share (never too much).
    """
    envs: dict[str, str] = {}
    uuids = [d.uuid for d in grant.devices]
    if strategy == "envvar":
        envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids)
    envs["VGPU_DEVICE_UUIDS"] = ",".join(uuids)
    for i, device in enumerate(grant.devices):
        cores = core_percent_value(device.core_percent)
        envs[f"VGPU_MEMORY_LIMIT_{i}"] = f"{device.memory_limit_mib}m"
        envs[f"VGPU_CORE_LIMIT_{i}"] = str(cores)
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{device.memory_limit_mib}m"
    # What a limit above the card means: "spill" (the card's memory first, then host memory
    # charged to the container) or "off" (allocations past what the card has free fail).
    # CUDA_OVERSUBSCRIBE is HAMi-core's switch for the same thing.
    spilling = any(d.spill for d in grant.devices)
    envs["VGPU_MEMORY_OVERSUBSCRIPTION"] = "spill" if spilling else "off"
    if spilling:
        envs["CUDA_OVERSUBSCRIBE"] = "true"
    envs["CUDA_DEVICE_SM_LIMIT"] = str(
        min(core_percent_value(d.core_percent) for d in grant.devices)
    )
    return envs


def core_percent_value(percent: float) -> int:
    """A share as the whole percent handed to containers: rounded down, at least 1."""
    return max(1, math.floor(percent + 1e-9))


def cdi_device_names(grant: Grant, vendor_class: str) -> list[str]:
    """Fully qualified CDI names (`vendor.com/class=<uuid>`) for the cdi strategy."""
    return [f"{vendor_class}={d.uuid}" for d in grant.devices]


class SpillHostMemoryError(ValueError):
    """Spilling could promise more host memory than the node's configured share of it."""


def check_spill_host_memory(
    gpu_memory: Iterable[int], split: Split, host_memory: int, fraction: float
) -> int:
    """The bytes S * M summed over the GPUs, when they fit `fraction` of `host_memory`.

    With spilling every container may fill its whole limit from host memory in the worst case,
    so the sum of the limits (S * M per GPU) must fit the share of host memory set aside for it.
    Raises SpillHostMemoryError naming both numbers otherwise (and when host memory is unknown).
    """
    promised = sum(math.floor(split.memory_scaling * m) for m in gpu_memory)
    if host_memory <= 0:
        raise SpillHostMemoryError("host memory is unknown, so spilling cannot be bounded")
    allowed = math.floor(fraction * host_memory)
    if promised > allowed:
        raise SpillHostMemoryError(
            f"memory scaling {split.memory_scaling} x GPU memory sums to {promised >> 20} MiB, "
            f"more than {fraction} of host memory ({allowed >> 20} of {host_memory >> 20} MiB)"
        )
    return promised

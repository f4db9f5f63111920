"""A simulated GPU backend for `vgpu-agent simulate`, demos and tests.

Same interface as the NVML backend, built from an inventory spec such as `2xA100-80GB,1xL4-24GB`.
UUIDs, PCI ids and NUMA nodes are deterministic, so the same spec always yields the same device
IDs. Faults are injected programmatically: XIDs, lost GPUs, start failures, readings, samples.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from vgpu_agent.gpu.model import (
    MIB,
    GpuError,
    GpuInfo,
    GpuReadings,
    Inventory,
    ProcessSample,
    XidEvent,
)
from vgpu_agent.gpu.simspec import parse_sim_spec

if TYPE_CHECKING:
    from vgpu_agent.throttle.attribution import RegionMarks

log = structlog.get_logger(__name__)

GIB = 1024 * MIB
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNINITIALIZED = 1

_COMPUTE_CAPABILITY = {
    "A100": (8, 0),
    "A30": (8, 0),
    "A10": (8, 6),
    "H100": (9, 0),
    "H200": (9, 0),
    "L4": (8, 9),
    "L40": (8, 9),
    "L40S": (8, 9),
    "T4": (7, 5),
    "V100": (7, 0),
}

# A source of per-process samples: (uuid, since_us) -> samples newer than since_us
SampleSource = Callable[[str, int], list[ProcessSample]]


def sim_uuid(position: int, model: str, memory_gib: int) -> str:
    """A stable NVML-style UUID for the GPU at `position` of a spec."""
    h = hashlib.sha256(f"vgpu-sim/{position}/{model}/{memory_gib}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def compute_capability(model: str) -> tuple[int, int]:
    """The CUDA compute capability of a model name; 8.0 for models not listed."""
    upper = model.upper()
    for prefix in sorted(_COMPUTE_CAPABILITY, key=len, reverse=True):
        if upper.startswith(prefix):
            return _COMPUTE_CAPABILITY[prefix]
    return (8, 0)


def build_inventory(spec: str) -> list[GpuInfo]:
    gpus: list[GpuInfo] = []
    for entry in parse_sim_spec(spec):
        for _ in range(entry.count):
            index = len(gpus)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=sim_uuid(index, entry.model, entry.memory_gib),
                    name=f"NVIDIA {entry.model}-{entry.memory_gib}GB",
                    memory_total=entry.memory_gib * GIB,
                    minor=index,
                    pci_bus_id=f"{index // 16:08X}:{0x18 + (index % 16) * 8:02X}:00.0",
                    numa_node=index % 2,
                    compute_capability=compute_capability(entry.model),
                )
            )
    return gpus


class SimBackend:
    """`GpuBackend` over simulated GPUs, with fault injection. Thread-safe."""

    def __init__(self, spec: str):
        self.spec = spec
        self._gpus = {g.uuid: g for g in build_inventory(spec)}
        self._cond = threading.Condition()
        self._xids: deque[XidEvent] = deque()
        self._lost: set[str] = set()
        self._readings = {u: GpuReadings(0, 0.0, 35.0, 60.0) for u in self._gpus}
        self._samples: dict[str, list[ProcessSample]] = {u: [] for u in self._gpus}
        self._no_samples: set[str] = set()
        self._sample_source: SampleSource | None = None
        self._process_owner: Callable[[int], str | None] | None = None
        self._start_error: GpuError | None = None
        self._started = False

    @property
    def uuids(self) -> list[str]:
        return list(self._gpus)

    # ---- GpuBackend --------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._start_error is not None:
                raise self._start_error
            self._started = True
        log.info("sim_started", spec=self.spec, gpus=len(self._gpus))

    def shutdown(self) -> None:
        with self._cond:
            self._started = False
            self._cond.notify_all()

    def discover(self) -> Inventory:
        self._require_started("discover")
        return Inventory(gpus=list(self._gpus.values()))

    def check(self, uuid: str) -> None:
        self._require_gpu(uuid, "check")

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        deadline = time.monotonic() + timeout_ms / 1000.0
        with self._cond:
            while not self._xids:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._xids.popleft()

    def readings(self, uuid: str) -> GpuReadings:
        self._require_gpu(uuid, "readings")
        with self._cond:
            return self._readings[uuid]

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self._require_gpu(uuid, "process_utilization")
        with self._cond:
            if uuid in self._no_samples:
                raise GpuError(
                    f"process utilization is not supported on {uuid}",
                    call="nvmlDeviceGetProcessUtilization",
                    code=NVML_ERROR_NOT_SUPPORTED,
                )
            source = self._sample_source
            samples = list(self._samples[uuid])
        if source is not None:
            samples = samples + source(uuid, since_us)
        return [s for s in samples if s.timestamp_us > since_us]

    def running_processes(self, uuid: str) -> list[tuple[int, int | None]]:
        """Processes seen in the latest samples; memory use is unknown in simulation."""
        self._require_gpu(uuid, "running_processes")
        with self._cond:
            return [(pid, None) for pid in sorted({s.pid for s in self._samples[uuid]})]

    # ---- fault injection ---------------------------------------------------------------------

    def inject_xid(self, uuid: str, xid: int) -> None:
        self._known(uuid)
        with self._cond:
            self._xids.append(XidEvent(uuid=uuid, xid=xid, timestamp=time.time()))
            self._cond.notify_all()

    def set_lost(self, uuid: str, lost: bool = True) -> None:
        self._known(uuid)
        with self._cond:
            (self._lost.add if lost else self._lost.discard)(uuid)

    def set_start_failure(self, error: GpuError | None) -> None:
        """Make start() raise `error` (None: start normally again)."""
        with self._cond:
            self._start_error = error

    def set_readings(
        self,
        uuid: str,
        *,
        util: float | None = None,
        temp: float | None = None,
        power: float | None = None,
        mem_used: int | None = None,
    ) -> None:
        """util as a 0..1 fraction, temp in C, power in W, mem_used in bytes."""
        self._known(uuid)
        with self._cond:
            current = self._readings[uuid]
            self._readings[uuid] = replace(
                current,
                utilization=current.utilization if util is None else util,
                temperature_c=current.temperature_c if temp is None else temp,
                power_w=current.power_w if power is None else power,
                memory_used=current.memory_used if mem_used is None else mem_used,
            )

    def set_process_samples(self, uuid: str, samples: Iterable[ProcessSample]) -> None:
        self._known(uuid)
        with self._cond:
            self._samples[uuid] = list(samples)

    def set_process_utilization_supported(self, uuid: str, supported: bool) -> None:
        self._known(uuid)
        with self._cond:
            (self._no_samples.discard if supported else self._no_samples.add)(uuid)

    def set_sample_source(self, source: SampleSource | None) -> None:
        """Hook for a GPU simulator: called for every process_utilization query."""
        with self._cond:
            self._sample_source = source

    def set_process_owner(self, owner: Callable[[int], str | None] | None) -> None:
        """Hook for a simulator: the allocation whose container runs a host pid, which on a real
        node the host's /proc proves (see `owner`)."""
        with self._cond:
            self._process_owner = owner

    def owner(self, host_pid: int, marks: RegionMarks) -> str | None:
        """Host evidence of the simulated node (`throttle.attribution.HostEvidence`)."""
        with self._cond:
            source = self._process_owner
        alloc_id = source(host_pid) if source is not None else None
        return alloc_id if alloc_id is not None and alloc_id in marks else ""

    def forget_except(self, live: Iterable[int]) -> None:
        pass  # nothing is cached: the simulator's answer is always current

    # ---- helpers -----------------------------------------------------------------------------

    def _known(self, uuid: str) -> None:
        if uuid not in self._gpus:
            raise KeyError(f"no simulated GPU {uuid!r}; have {list(self._gpus)}")

    def _require_started(self, call: str) -> None:
        if not self._started:
            raise GpuError(
                f"{call}: simulated backend is not started",
                call=call,
                code=NVML_ERROR_UNINITIALIZED,
            )

    def _require_gpu(self, uuid: str, call: str) -> None:
        self._require_started(call)
        if uuid not in self._gpus:
            raise GpuError(f"{call}: no simulated GPU {uuid!r}", call=call, code=2)
        with self._cond:
            lost = uuid in self._lost
        if lost:
            raise GpuError(
                f"{call} on {uuid} failed: GPU is lost (simulated)",
                call=call,
                code=NVML_ERROR_GPU_IS_LOST,
                gpu_lost=True,
            )

"""What the agent knows about a physical GPU, and the backend interface that discovers it.

Pure: no I/O here. Backends (`nvml.py`, `sim.py`) implement `GpuBackend`; every method of a
backend may block, so async callers run them with `asyncio.to_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MIB = 1024 * 1024


class GpuError(Exception):
    """A GPU backend call failed: `call` names the NVML (or simulated) call, `code` its code."""

    def __init__(self, message: str, *, call: str = "", code: int = 0, gpu_lost: bool = False):
        super().__init__(message)
        self.call = call
        self.code = code
        self.gpu_lost = gpu_lost


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as discovered at start. Immutable: a changed GPU is a new inventory."""

    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    minor: int
    pci_bus_id: str
    numa_node: int | None = None
    compute_capability: tuple[int, int] = (0, 0)
    mig_enabled: bool = False


@dataclass(frozen=True)
class XidEvent:
    """A critical XID error reported for one GPU."""

    uuid: str
    xid: int
    timestamp: float = 0.0


@dataclass(frozen=True)
class GpuReadings:
    """One poll of a GPU's live figures. None where the GPU does not report the value."""

    memory_used: int | None = None  # bytes
    utilization: float | None = None  # 0..1 of the GPU's SM time
    temperature_c: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class ProcessSample:
    """One NVML per-process utilization sample (host PID)."""

    pid: int
    timestamp_us: int
    sm_util: int  # percent, 0..100


@dataclass
class Inventory:
    """The GPUs a backend found, plus the ones it skipped and why."""

    gpus: list[GpuInfo] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # uuid -> reason


class GpuBackend(Protocol):
    """The interface every GPU backend offers. All methods may block."""

    def start(self) -> None:
        """Initialise the library; raises GpuError on failure (retried by the caller)."""

    def shutdown(self) -> None: ...

    def discover(self) -> Inventory: ...

    def check(self, uuid: str) -> None:
        """Raise GpuError if the GPU does not answer (lost, fallen off the bus)."""

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        """Wait up to timeout_ms for the next critical XID event on any GPU."""

    def readings(self, uuid: str) -> GpuReadings: ...

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        """Per-process SM samples newer than since_us. Raises GpuError(code=NOT_SUPPORTED)
        where the GPU cannot report them."""

    def running_processes(self, uuid: str) -> list[tuple[int, int | None]]:
        """(host pid, used GPU memory bytes or None) of the compute processes on the GPU."""

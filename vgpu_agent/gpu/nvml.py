"""The NVML backend: the only module that talks to the NVIDIA driver, through `pynvml`.

Every method blocks (NVML calls go into the driver); async callers use `asyncio.to_thread`.
Every NVML error becomes a `GpuError` naming the call, the GPU and the NVML code, and is counted
in `errors_by_call` for the metrics.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml
import structlog

from vgpu_agent.gpu.model import (
    GpuError,
    GpuInfo,
    GpuReadings,
    Inventory,
    ProcessSample,
    XidEvent,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

XID_CRITICAL_ERROR = pynvml.nvmlEventTypeXidCriticalError
# answers that mean "this GPU or driver does not offer it", not "something broke"
_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


def sysfs_pci_address(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` as sysfs spells it: `0000:3b:00.0`."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep or not rest:
        raise ValueError(f"PCI bus id {bus_id!r} is not of the form DOMAIN:BUS:DEVICE.FUNCTION")
    if len(domain) == 8:
        domain = domain[4:]  # NVML pads the domain to 8 hex digits, sysfs uses 4
    return f"{domain}:{rest}"


def numa_node_from_sysfs(bus_id: str, sysfs_root: Path) -> int | None:
    """The NUMA node sysfs reports for a PCI device; None when unknown (-1 or no file)."""
    try:
        path = sysfs_root / "bus/pci/devices" / sysfs_pci_address(bus_id) / "numa_node"
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def load_library(path: str) -> None:
    """Make pynvml use the NVML library at `path` instead of the system one."""
    if not Path(path).is_file():
        raise GpuError(
            f"NVML library {path!r} does not exist or is not a file (--nvml-library)", call="load"
        )
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        raise GpuError(f"cannot load NVML library {path!r}: {err}", call="load") from err
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        # symbols are cached per library; stale ones would call into the previous library
        pynvml._nvmlGetFunctionPointer_cache.clear()


class NvmlBackend:
    """`GpuBackend` over the real NVML (or the library named by `library_path`)."""

    def __init__(
        self,
        library_path: str | None = None,
        *,
        sysfs_root: Path = Path("/sys"),
        on_error: Callable[[str, int], None] | None = None,
    ):
        self.library_path = library_path
        self.sysfs_root = sysfs_root
        self.errors_by_call: Counter[str] = Counter()
        self._on_error = on_error
        self._lock = threading.Lock()  # handles and the started flag
        self._event_lock = threading.Lock()  # the event set, used by the XID waiter thread
        self._errors_lock = threading.Lock()
        self._started = False
        self._handles: dict[str, Any] = {}
        self._uuid_by_address: dict[int, str] = {}
        self._event_set: Any = None
        self._samples = ProcessSampleReader()
        self._samples_lock = threading.Lock()  # its buffer
        self.driver_version: str | None = None  # as NVML reports it, once started

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self.library_path:
                load_library(self.library_path)
            with self._samples_lock:
                self._samples = ProcessSampleReader()  # its function from the library now loaded
            self._call("nvmlInit", "", pynvml.nvmlInit)
            self._started = True
            driver = self._optional(
                "nvmlSystemGetDriverVersion", "", pynvml.nvmlSystemGetDriverVersion
            )
            self.driver_version = driver if isinstance(driver, str) and driver else None
            log.info("nvml_started", driver_version=driver, library=self.library_path or "system")

    def shutdown(self) -> None:
        with self._event_lock:
            self._free_event_set()
        with self._lock:
            if not self._started:
                return
            self._started = False
            self._handles.clear()
            self._uuid_by_address.clear()
            try:
                self._call("nvmlShutdown", "", pynvml.nvmlShutdown)
            except GpuError as err:
                log.warning("nvml_shutdown_failed", error=str(err))

    # ---- inventory ---------------------------------------------------------------------------

    def discover(self) -> Inventory:
        with self._lock:
            self._require_started()
            count = self._call("nvmlDeviceGetCount", "", pynvml.nvmlDeviceGetCount)
            inventory = Inventory()
            handles: dict[str, Any] = {}
            for index in range(count):
                uuid = ""
                try:
                    handle = self._call(
                        "nvmlDeviceGetHandleByIndex",
                        f"index {index}",
                        pynvml.nvmlDeviceGetHandleByIndex,
                        index,
                    )
                    uuid = self._call(
                        "nvmlDeviceGetUUID", f"index {index}", pynvml.nvmlDeviceGetUUID, handle
                    )
                    info = self._describe(index, uuid, handle)
                except GpuError as err:
                    # one broken GPU must not hide the others
                    inventory.skipped[uuid or f"index-{index}"] = f"NVML query failed: {err}"
                    log.warning("gpu_discovery_failed", index=index, error=str(err))
                    continue
                handles[uuid] = handle
                if info.mig_enabled:
                    inventory.skipped[uuid] = (
                        "MIG mode is enabled; MIG devices are not supported yet"
                    )
                    log.warning("gpu_skipped_mig", uuid=uuid, index=index)
                    continue
                inventory.gpus.append(info)
            self._handles = handles
            self._uuid_by_address = {_address(h): u for u, h in handles.items()}
        with self._event_lock:
            self._free_event_set()  # the next wait registers the GPUs found now
        return inventory

    def _describe(self, index: int, uuid: str, handle: Any) -> GpuInfo:
        name = self._call("nvmlDeviceGetName", uuid, pynvml.nvmlDeviceGetName, handle)
        memory = self._call("nvmlDeviceGetMemoryInfo", uuid, pynvml.nvmlDeviceGetMemoryInfo, handle)
        minor = self._call(
            "nvmlDeviceGetMinorNumber", uuid, pynvml.nvmlDeviceGetMinorNumber, handle
        )
        pci = self._call("nvmlDeviceGetPciInfo", uuid, pynvml.nvmlDeviceGetPciInfo, handle)
        bus_id = _text(pci.busId)
        cc = self._optional(
            "nvmlDeviceGetCudaComputeCapability",
            uuid,
            pynvml.nvmlDeviceGetCudaComputeCapability,
            handle,
        )
        mig = self._optional("nvmlDeviceGetMigMode", uuid, pynvml.nvmlDeviceGetMigMode, handle)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            memory_total=int(memory.total),
            minor=minor,
            pci_bus_id=bus_id,
            numa_node=self._numa_node(uuid, handle, bus_id),
            compute_capability=(int(cc[0]), int(cc[1])) if cc else (0, 0),
            mig_enabled=bool(mig and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE),
        )

    def _numa_node(self, uuid: str, handle: Any, bus_id: str) -> int | None:
        node = self._optional(
            "nvmlDeviceGetNumaNodeId", uuid, pynvml.nvmlDeviceGetNumaNodeId, handle
        )
        # the header declares the node unsigned: 0xFFFFFFFF (-1) means "no NUMA affinity"
        if node is not None and 0 <= node < 0x7FFFFFFF:
            return int(node)
        return numa_node_from_sysfs(bus_id, self.sysfs_root)

    # ---- health and readings -----------------------------------------------------------------

    def check(self, uuid: str) -> None:
        handle = self._handle(uuid)
        # memory info is answered by the GPU itself, so a lost GPU fails it
        self._call("nvmlDeviceGetMemoryInfo", uuid, pynvml.nvmlDeviceGetMemoryInfo, handle)

    def readings(self, uuid: str) -> GpuReadings:
        handle = self._handle(uuid)
        memory = self._optional(
            "nvmlDeviceGetMemoryInfo", uuid, pynvml.nvmlDeviceGetMemoryInfo, handle
        )
        util = self._optional(
            "nvmlDeviceGetUtilizationRates", uuid, pynvml.nvmlDeviceGetUtilizationRates, handle
        )
        temp = self._optional(
            "nvmlDeviceGetTemperature",
            uuid,
            pynvml.nvmlDeviceGetTemperature,
            handle,
            pynvml.NVML_TEMPERATURE_GPU,
        )
        power = self._optional(
            "nvmlDeviceGetPowerUsage", uuid, pynvml.nvmlDeviceGetPowerUsage, handle
        )
        return GpuReadings(
            memory_used=int(memory.used) if memory is not None else None,
            utilization=util.gpu / 100.0 if util is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_w=power / 1000.0 if power is not None else None,
        )

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        handle = self._handle(uuid)
        try:
            with self._samples_lock:
                raw = self._samples.read(handle, since_us)
        except pynvml.NVMLError as err:
            raise self._error("nvmlDeviceGetProcessUtilization", uuid, err) from None
        # NVML has been seen to report more than 100 % for short windows
        return [ProcessSample(pid, stamp, min(sm, 100)) for pid, stamp, sm in raw]

    def running_processes(self, uuid: str) -> list[tuple[int, int | None]]:
        """(pid, used GPU memory in bytes or None) of the compute processes on this GPU."""
        handle = self._handle(uuid)
        procs = self._call(
            "nvmlDeviceGetComputeRunningProcesses",
            uuid,
            pynvml.nvmlDeviceGetComputeRunningProcesses,
            handle,
        )
        return [
            (int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs
        ]

    # ---- XID events --------------------------------------------------------------------------

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        with self._event_lock:
            event_set = self._ensure_event_set()
            try:
                data = pynvml.nvmlEventSetWait(event_set, timeout_ms)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_TIMEOUT:
                    return None
                # a broken set is rebuilt on the next wait
                self._free_event_set()
                raise self._error("nvmlEventSetWait", "", err) from None
        if not data.eventType & XID_CRITICAL_ERROR:
            return None
        uuid = self._uuid_by_address.get(_address(data.device))
        if uuid is None:
            uuid = self._optional("nvmlDeviceGetUUID", "", pynvml.nvmlDeviceGetUUID, data.device)
        return XidEvent(uuid=uuid or "unknown", xid=int(data.eventData))

    def _ensure_event_set(self) -> Any:
        if self._event_set is not None:
            return self._event_set
        self._require_started()
        with self._lock:
            handles = dict(self._handles)
        event_set = self._call("nvmlEventSetCreate", "", pynvml.nvmlEventSetCreate)
        try:
            for uuid, handle in handles.items():
                supported = self._optional(
                    "nvmlDeviceGetSupportedEventTypes",
                    uuid,
                    pynvml.nvmlDeviceGetSupportedEventTypes,
                    handle,
                )
                if not (supported or 0) & XID_CRITICAL_ERROR:
                    log.warning("xid_events_not_supported", uuid=uuid)
                    continue
                self._call(
                    "nvmlDeviceRegisterEvents",
                    uuid,
                    pynvml.nvmlDeviceRegisterEvents,
                    handle,
                    XID_CRITICAL_ERROR,
                    event_set,
                )
        except GpuError:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(event_set)
            raise
        self._event_set = event_set
        return event_set

    def _free_event_set(self) -> None:
        if self._event_set is None:
            return
        event_set, self._event_set = self._event_set, None
        try:
            pynvml.nvmlEventSetFree(event_set)
        except pynvml.NVMLError as err:
            self._count("nvmlEventSetFree", int(err.value))

    # ---- helpers -----------------------------------------------------------------------------

    def _require_started(self) -> None:
        if not self._started:
            raise GpuError(
                "NVML is not started; call start() first",
                call="nvmlInit",
                code=pynvml.NVML_ERROR_UNINITIALIZED,
            )

    def _handle(self, uuid: str) -> Any:
        with self._lock:
            self._require_started()
            handle = self._handles.get(uuid)
            if handle is None:
                handle = self._call(
                    "nvmlDeviceGetHandleByUUID", uuid, pynvml.nvmlDeviceGetHandleByUUID, uuid
                )
                self._handles[uuid] = handle
                self._uuid_by_address[_address(handle)] = uuid
            return handle

    def _call(self, call: str, uuid: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            raise self._error(call, uuid, err) from None

    def _optional(self, call: str, uuid: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Like _call, but None where the GPU or the driver does not offer the value."""
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            if err.value in _ABSENT:
                return None
            raise self._error(call, uuid, err) from None

    def _error(self, call: str, uuid: str, err: pynvml.NVMLError) -> GpuError:
        code = int(err.value)
        self._count(call, code)
        where = f" on {uuid}" if uuid else ""
        return GpuError(
            f"{call}{where} failed: {_describe_error(err)} (NVML code {code})",
            call=call,
            code=code,
            gpu_lost=code == pynvml.NVML_ERROR_GPU_IS_LOST,
        )

    def _count(self, call: str, code: int) -> None:
        with self._errors_lock:
            self.errors_by_call[call] += 1
        if self._on_error is not None:
            self._on_error(call, code)


class ProcessSampleReader:
    """`nvmlDeviceGetProcessUtilization` in one driver call where pynvml's wrapper makes two.

    pynvml asks for the size first (a call with no buffer), then for the samples. On an H200
    (driver 580) the sizing call costs next to nothing: a read cost 2.4-2.6 ms of CPU either
    way (median of 200: 2.37 ms for pynvml's two calls, 2.37-2.61 ms for this one;
    `shim/tests/gpu/nvml_loop.py` times both), the driver's work being in the fill. What the
    one call buys is an answer whole: samples arriving between pynvml's two calls could fail
    the second. This reader keeps a buffer
    sized by the largest answer so far and asks once. A buffer found too small (the driver says
    INSUFFICIENT_SIZE with the count it needs, or fills it to the last entry, which could be a
    cut answer) is grown and the call made again, at most `ATTEMPTS` times: samples that
    arrive between two calls are read, where between pynvml's two they could fail the second
    (as the fake library answers; what a real driver answers then was not seen).
    Not thread-safe: one caller at a time (the backend holds a lock around it).
    """

    INITIAL = 64
    MOST = 1 << 16  # the buffer's bound: 2 MiB of samples
    ATTEMPTS = 4

    def __init__(self, call: Callable[..., int] | None = None) -> None:
        self._call = call  # the C function; looked up in pynvml's library when first needed
        self._capacity = 0
        self._buffer: Any = None
        self.driver_calls = 0

    def read(self, handle: Any, since_us: int) -> list[tuple[int, int, int]]:
        """(pid, timestamp_us, sm %) of every sample newer than `since_us`; [] when NVML has
        none. Raises `pynvml.NVMLError` for any other answer."""
        call = self._call
        if call is None:
            call = self._call = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
        wanted = max(self.INITIAL, self._capacity)
        for _ in range(self.ATTEMPTS):
            if wanted > self._capacity:
                self._capacity = min(self.MOST, wanted)
                self._buffer = (pynvml.c_nvmlProcessUtilizationSample_t * self._capacity)()
            count = ctypes.c_uint(self._capacity)
            self.driver_calls += 1
            ret = call(handle, self._buffer, ctypes.byref(count), ctypes.c_ulonglong(since_us))
            if ret == pynvml.NVML_ERROR_NOT_FOUND:
                return []
            if ret == pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                wanted = max(2 * self._capacity, count.value + self.INITIAL)
            elif ret != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(ret)
            elif count.value < self._capacity or self._capacity >= self.MOST:
                n = min(count.value, self._capacity)
                return [(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in self._buffer[:n]]
            else:
                wanted = 2 * self._capacity  # full to the last entry: maybe cut short
            if self._capacity >= self.MOST:
                break
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _describe_error(err: pynvml.NVMLError) -> str:
    try:
        return str(err)
    except Exception:  # str() asks the library, which may be gone
        return "NVML error"


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Build and drive the fake `libnvidia-ml.so.1` (tests/fakes/fake_nvml.c).

`build_fake_nvml()` compiles the library once per source version (cached by hash under
`tests/fakes/build/`). `FakeNvml` owns one inventory file and one events file in a directory;
every change rewrites the inventory atomically (write + rename), which the library notices on its
next call, so a running agent sees new readings, samples and failures without a restart.

    fake = FakeNvml(tmp_path)
    fake.set_gpus([FakeGpu.a100(0), FakeGpu.a100(1)])
    env = fake.env()                      # FAKE_NVML_CONFIG / FAKE_NVML_EVENTS for a subprocess
    fake.fail("nvmlDeviceGetMemoryInfo", fake.gpus[1].uuid, NVML_ERROR_GPU_IS_LOST)
    fake.inject_xid(fake.gpus[0].uuid, 79)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
SOURCE = FAKES_DIR / "fake_nvml.c"
BUILD_ROOT = FAKES_DIR / "build"
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC")

# NVML return codes the tests use (values from nvml.h)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

GIB = 1024**3
_build_lock = threading.Lock()


def nvml_header_dir() -> Path:
    """The directory holding nvml.h from the nvidia-nvml-dev wheel."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    candidates = sorted(purelib.glob("nvidia/*/include/nvml.h"))
    if not candidates:
        raise RuntimeError(
            f"nvml.h not found under {purelib}/nvidia/*/include; install the test extra "
            "(it brings nvidia-nvml-dev)"
        )
    return candidates[-1].parent


def build_fake_nvml(build_root: Path = BUILD_ROOT) -> Path:
    """Compile the fake library if this source has not been built yet; return its path."""
    include = nvml_header_dir()
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update((include / "nvml.h").read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    out_dir = build_root / f"nvml-{digest.hexdigest()[:16]}"
    library = out_dir / LIBRARY_NAME
    with _build_lock:
        if library.exists():
            return library
        out_dir.mkdir(parents=True, exist_ok=True)
        # build under a private name, then rename: parallel sessions never load a half-written file
        partial = out_dir / f".{LIBRARY_NAME}.{os.getpid()}"
        cmd = ["gcc", *CFLAGS, f"-I{include}", "-o", str(partial), str(SOURCE), "-lpthread"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"building the fake NVML failed ({' '.join(cmd)}):\n{result.stderr}")
        partial.rename(library)
    return library


@dataclass(frozen=True)
class FakeGpu:
    """One GPU of the fake inventory, with its live readings."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_total: int = 80 * GIB
    memory_used: int = 0
    minor: int = 0
    pci_bus_id: str = "00000000:3B:00.0"
    compute_capability: tuple[int, int] = (8, 0)
    mig: bool = False
    numa: int | None = 0  # None: the driver answers NOT_SUPPORTED for the NUMA node
    utilization: int = 0  # percent
    memory_utilization: int = 0
    temperature_c: int = 40
    power_mw: int = 70_000
    process_utilization_supported: bool = True
    event_types: int = 0x8 | 0x1 | 0x2  # XID critical, single- and double-bit ECC

    @staticmethod
    def make(index: int, model: str = "A100", **overrides: object) -> FakeGpu:
        """A plausible GPU for slot `index` (unique UUID, minor and PCI bus id)."""
        models = {
            "A100": ("NVIDIA A100-SXM4-80GB", 80 * GIB, (8, 0)),
            "H100": ("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0)),
            "L4": ("NVIDIA L4", 24 * GIB, (8, 9)),
            "T4": ("Tesla T4", 16 * GIB, (7, 5)),
        }
        name, memory, cc = models[model]
        h = hashlib.sha256(f"fake-nvml/{index}/{model}".encode()).hexdigest()
        gpu = FakeGpu(
            uuid=f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}",
            name=name,
            memory_total=memory,
            minor=index,
            pci_bus_id=f"00000000:{0x3B + index:02X}:00.0",
            compute_capability=cc,
            numa=index % 2,
        )
        return replace(gpu, **overrides)  # type: ignore[arg-type]

    def config_line(self) -> str:
        numa = "none" if self.numa is None else str(self.numa)
        major, minor = self.compute_capability
        return (
            f"gpu {self.uuid} memory={self.memory_total} used={self.memory_used} "
            f"minor={self.minor} pci={self.pci_bus_id} cc={major}.{minor} mig={int(self.mig)} "
            f"numa={numa} util={self.utilization} memutil={self.memory_utilization} "
            f"temp={self.temperature_c} power={self.power_mw} "
            f"procutil={int(self.process_utilization_supported)} events={self.event_types:x} "
            f"name={self.name}"
        )


@dataclass(frozen=True)
class Sample:
    """One per-process utilization sample the fake reports."""

    pid: int
    timestamp_us: int
    sm_util: int
    mem_util: int = 0


@dataclass
class _State:
    driver: str = "550.54.15"
    gpus: list[FakeGpu] = field(default_factory=list)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    processes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    failures: list[tuple[str, str, int]] = field(default_factory=list)


class FakeNvml:
    """The inventory, failures and events of one fake NVML installation."""

    def __init__(self, directory: Path, library: Path | None = None, gpus: int = 2):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.library_path = library or build_fake_nvml()
        self.config_path = self.directory / "fake-nvml.conf"
        self.events_path = self.directory / "fake-nvml.events"
        self.events_path.touch()
        self._state = _State()
        self._lock = threading.Lock()
        self._generation = 0
        self.set_gpus([FakeGpu.make(i) for i in range(gpus)])

    def call_count(self, call: str) -> int:
        """How many times this process called the device entry point `call` of the fake
        library (failed calls included; the library counts from when it was first loaded)."""
        counter = ctypes.CDLL(str(self.library_path)).fake_nvml_call_count
        counter.restype = ctypes.c_ulong
        counter.argtypes = [ctypes.c_char_p]
        return int(counter(call.encode()))

    # --- inventory -----------------------------------------------------------------------------

    @property
    def gpus(self) -> list[FakeGpu]:
        return list(self._state.gpus)

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self._state.gpus]

    @property
    def library_dir(self) -> Path:
        """The directory to put on LD_LIBRARY_PATH to make this the system NVML."""
        return self.library_path.parent

    def set_gpus(self, gpus: Iterable[FakeGpu] | int) -> list[FakeGpu]:
        """Replace the inventory (an int builds that many A100s). Samples of gone GPUs go."""
        new = [FakeGpu.make(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
        uuids = [g.uuid for g in new]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"duplicate GPU UUIDs in {uuids}")
        with self._lock:
            self._state.gpus = new
            self._state.samples = {u: s for u, s in self._state.samples.items() if u in uuids}
            self._state.processes = {u: p for u, p in self._state.processes.items() if u in uuids}
            self._write()
        return new

    def update_gpu(self, uuid: str, **changes: object) -> FakeGpu:
        """Change fields of one GPU (see FakeGpu), e.g. update_gpu(u, mig=True)."""
        with self._lock:
            index = self._index(uuid)
            gpu = replace(self._state.gpus[index], **changes)  # type: ignore[arg-type]
            self._state.gpus[index] = gpu
            self._write()
        return gpu

    def set_readings(
        self,
        uuid: str,
        *,
        util: int | None = None,
        temp: int | None = None,
        power: float | None = None,
        mem_used: int | None = None,
    ) -> None:
        """Live figures: util in percent, temp in C, power in W, mem_used in bytes."""
        changes: dict[str, object] = {}
        if util is not None:
            changes["utilization"] = util
        if temp is not None:
            changes["temperature_c"] = temp
        if power is not None:
            changes["power_mw"] = round(power * 1000)
        if mem_used is not None:
            changes["memory_used"] = mem_used
        self.update_gpu(uuid, **changes)

    def set_driver_version(self, version: str) -> None:
        with self._lock:
            self._state.driver = version
            self._write()

    def set_process_samples(
        self, uuid: str, samples: Iterable[Sample | tuple[int, int, int]]
    ) -> None:
        """Per-process utilization samples: Sample objects or (pid, timestamp_us, sm%)."""
        parsed = [s if isinstance(s, Sample) else Sample(*s) for s in samples]
        with self._lock:
            self._index(uuid)
            self._state.samples[uuid] = parsed
            self._write()

    def set_processes(self, uuid: str, processes: Iterable[tuple[int, int]]) -> None:
        """Running compute processes as (pid, used_bytes)."""
        with self._lock:
            self._index(uuid)
            self._state.processes[uuid] = list(processes)
            self._write()

    # --- faults --------------------------------------------------------------------------------

    def fail(self, call: str, uuid: str = "*", code: int = NVML_ERROR_UNKNOWN) -> None:
        """Make `call` return `code` for `uuid` ("*": every device) until clear_failures().
        `call` is an NVML symbol with or without its _vN suffix, "nvmlInit" (both init
        entry points) or "*" (every call made on a device)."""
        if not call or any(c.isspace() for c in call) or not uuid:
            raise ValueError(f"bad failure rule call={call!r} uuid={uuid!r}")
        with self._lock:
            self._state.failures.append((call, uuid, int(code)))
            self._write()

    def lose_gpu(self, uuid: str) -> None:
        """Every call on this GPU answers NVML_ERROR_GPU_IS_LOST."""
        self.fail("*", uuid, NVML_ERROR_GPU_IS_LOST)

    def clear_failures(self, uuid: str | None = None) -> None:
        """Drop every failure rule, or only those naming `uuid`."""
        with self._lock:
            self._state.failures = [f for f in self._state.failures if uuid and f[1] != uuid]
            self._write()

    def inject_xid(self, uuid: str, xid: int) -> None:
        """Append a critical XID event; event sets registered for the GPU deliver it."""
        with open(self.events_path, "a", encoding="ascii") as f:
            f.write(f"{uuid} {int(xid)}\n")

    def write_raw_config(self, text: str) -> None:
        """Replace the inventory file with arbitrary text (for corrupt-file tests)."""
        self._replace(text)

    # --- environment ---------------------------------------------------------------------------

    def env(self, *, system_library: bool = False) -> dict[str, str]:
        """Variables a process needs to load this fake. With system_library, LD_LIBRARY_PATH
        also points at it, for programs that load libnvidia-ml.so.1 by name."""
        env = {
            "FAKE_NVML_CONFIG": str(self.config_path),
            "FAKE_NVML_EVENTS": str(self.events_path),
        }
        if system_library:
            previous = os.environ.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(self.library_dir), previous) if p
            )
        return env

    # --- internals -----------------------------------------------------------------------------

    def _index(self, uuid: str) -> int:
        for i, gpu in enumerate(self._state.gpus):
            if gpu.uuid == uuid:
                return i
        raise KeyError(f"no fake GPU {uuid!r}; have {[g.uuid for g in self._state.gpus]}")

    def _render(self) -> str:
        s = self._state
        lines = [f"driver {s.driver}"]
        lines += [g.config_line() for g in s.gpus]
        for uuid, samples in s.samples.items():
            lines += [
                f"procutil {uuid} {x.pid} {x.timestamp_us} {x.sm_util} {x.mem_util}"
                for x in samples
            ]
        for uuid, procs in s.processes.items():
            lines += [f"proc {uuid} {pid} {used}" for pid, used in procs]
        lines += [f"fail {call} {uuid} {code}" for call, uuid, code in s.failures]
        return "\n".join(lines) + "\n"

    def _write(self) -> None:
        self._replace(self._render())

    def _replace(self, text: str) -> None:
        # rename gives a new inode, so the library notices even within one mtime tick
        self._generation += 1
        tmp = self.config_path.with_name(f".{self.config_path.name}.{self._generation}")
        tmp.write_text(text, encoding="utf-8")
        tmp.rename(self.config_path)

"""The real NvmlBackend (through pynvml) against the fake libnvidia-ml.so.1."""

from __future__ import annotations

import asyncio
import ctypes
import time
from pathlib import Path

import pynvml
import pytest

from tests.fakes.fakenvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    FakeNvml,
)
from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.model import GpuError
from vgpu_agent.gpu.nvml import NvmlBackend, ProcessSampleReader, sysfs_pci_address

IGNORED = frozenset({13, 31, 43, 45, 68, 109})


def reset_library_state() -> None:
    """Drop every NVML init a failed test may have left, so the next test starts clean."""
    for _ in range(100):
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            return


@pytest.fixture
def make_backend(fake_nvml: FakeNvml, tmp_path: Path):
    backends: list[NvmlBackend] = []

    def make(start: bool = True, **kwargs) -> NvmlBackend:
        kwargs.setdefault("sysfs_root", tmp_path / "sys")
        backend = NvmlBackend(str(fake_nvml.library_path), **kwargs)
        backends.append(backend)
        if start:
            backend.start()
        return backend

    yield make
    for backend in backends:
        backend.shutdown()
    reset_library_state()


def test_discovers_every_gpu_field(fake_nvml: FakeNvml, make_backend):
    fake_nvml.set_gpus(
        [
            FakeGpu.make(0, "A100"),
            FakeGpu.make(1, "L4", numa=1, pci_bus_id="00000001:5E:00.0", minor=7),
        ]
    )
    inventory = make_backend().discover()
    assert inventory.skipped == {}
    a100, l4 = inventory.gpus
    assert (a100.index, a100.uuid, a100.name) == (0, fake_nvml.uuids[0], "NVIDIA A100-SXM4-80GB")
    assert (a100.memory_total, a100.compute_capability, a100.numa_node) == (80 << 30, (8, 0), 0)
    assert (l4.index, l4.name, l4.memory_total) == (1, "NVIDIA L4", 24 << 30)
    assert (l4.minor, l4.pci_bus_id, l4.numa_node, l4.compute_capability) == (
        7,
        "00000001:5E:00.0",
        1,
        (8, 9),
    )
    assert not a100.mig_enabled and not l4.mig_enabled


def test_mig_enabled_gpus_are_skipped_with_a_reason(fake_nvml: FakeNvml, make_backend):
    fake_nvml.update_gpu(fake_nvml.uuids[1], mig=True)
    inventory = make_backend().discover()
    assert [g.uuid for g in inventory.gpus] == [fake_nvml.uuids[0]]
    assert "MIG" in inventory.skipped[fake_nvml.uuids[1]]


def test_pre_ampere_gpus_without_mig_support_are_kept(fake_nvml: FakeNvml, make_backend):
    fake_nvml.set_gpus([FakeGpu.make(0, "T4")])
    [t4] = make_backend().discover().gpus
    assert t4.compute_capability == (7, 5) and not t4.mig_enabled


def write_numa(root: Path, bus_id: str, text: str) -> None:
    node = root / "bus/pci/devices" / sysfs_pci_address(bus_id) / "numa_node"
    node.parent.mkdir(parents=True)
    node.write_text(text)


def test_numa_node_falls_back_to_sysfs(fake_nvml: FakeNvml, make_backend, tmp_path: Path):
    gpus = fake_nvml.set_gpus(
        [
            FakeGpu.make(0, numa=None, pci_bus_id="00000000:3B:00.0"),
            FakeGpu.make(1, numa=None, pci_bus_id="00000000:86:00.0"),
            FakeGpu.make(2, numa=None, pci_bus_id="00000000:AF:00.0"),
        ]
    )
    sys_root = tmp_path / "sys"
    write_numa(sys_root, gpus[0].pci_bus_id, "1\n")
    write_numa(sys_root, gpus[1].pci_bus_id, "-1\n")  # the kernel's "unknown"
    # gpus[2] has no sysfs entry at all
    found = make_backend(sysfs_root=sys_root).discover().gpus
    assert [g.numa_node for g in found] == [1, None, None]


def test_sysfs_address_spelling():
    assert sysfs_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_pci_address("0001:AF:00.0") == "0001:af:00.0"
    with pytest.raises(ValueError, match="bogus"):
        sysfs_pci_address("bogus")


def test_gpu_that_fails_discovery_is_skipped_and_others_are_kept(fake_nvml: FakeNvml, make_backend):
    broken = fake_nvml.uuids[0]
    fake_nvml.fail("nvmlDeviceGetPciInfo", broken, NVML_ERROR_UNKNOWN)  # any version
    backend = make_backend()
    inventory = backend.discover()
    assert [g.uuid for g in inventory.gpus] == [fake_nvml.uuids[1]]
    assert "nvmlDeviceGetPciInfo" in inventory.skipped[broken]
    assert backend.errors_by_call["nvmlDeviceGetPciInfo"] == 1


def test_init_failure_is_a_gpu_error_and_a_retry_succeeds(fake_nvml: FakeNvml, make_backend):
    fake_nvml.fail("nvmlInit", code=NVML_ERROR_DRIVER_NOT_LOADED)
    backend = make_backend(start=False)
    with pytest.raises(GpuError) as err:
        backend.start()
    assert (err.value.call, err.value.code) == ("nvmlInit", NVML_ERROR_DRIVER_NOT_LOADED)
    assert "Driver Not Loaded" in str(err.value)
    fake_nvml.clear_failures()
    backend.start()
    assert len(backend.discover().gpus) == 2


def test_missing_library_path_is_named(tmp_path: Path):
    missing = tmp_path / "nope" / "libnvidia-ml.so.1"
    with pytest.raises(GpuError, match=str(missing)):
        NvmlBackend(str(missing)).start()


def test_unloadable_library_is_named(tmp_path: Path):
    junk = tmp_path / "libnvidia-ml.so.1"
    junk.write_bytes(b"not an ELF file")
    with pytest.raises(GpuError, match="cannot load NVML library") as err:
        NvmlBackend(str(junk)).start()
    assert str(junk) in str(err.value)


def test_calls_before_start_are_refused(fake_nvml: FakeNvml, make_backend):
    backend = make_backend(start=False)
    with pytest.raises(GpuError, match="not started"):
        backend.discover()


def test_lost_gpu_fails_check_with_gpu_lost(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    lost, fine = fake_nvml.uuids
    fake_nvml.lose_gpu(lost)
    with pytest.raises(GpuError) as err:
        backend.check(lost)
    assert err.value.gpu_lost and err.value.code == NVML_ERROR_GPU_IS_LOST
    assert lost in str(err.value) and "nvmlDeviceGetMemoryInfo" in str(err.value)
    backend.check(fine)
    fake_nvml.clear_failures()
    backend.check(lost)


def test_other_errors_are_not_gpu_lost(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    fake_nvml.fail("nvmlDeviceGetMemoryInfo", fake_nvml.uuids[0], NVML_ERROR_UNKNOWN)
    with pytest.raises(GpuError) as err:
        backend.check(fake_nvml.uuids[0])
    assert not err.value.gpu_lost and err.value.code == NVML_ERROR_UNKNOWN


def test_readings(fake_nvml: FakeNvml, make_backend):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_readings(uuid, util=37, temp=66, power=212.5, mem_used=5 << 30)
    backend = make_backend()
    backend.discover()
    r = backend.readings(uuid)
    assert (r.utilization, r.temperature_c, r.power_w, r.memory_used) == (
        0.37,
        66.0,
        212.5,
        5 << 30,
    )


def test_readings_not_supported_are_none(fake_nvml: FakeNvml, make_backend):
    uuid = fake_nvml.uuids[0]
    fake_nvml.fail("nvmlDeviceGetPowerUsage", uuid, NVML_ERROR_NOT_SUPPORTED)
    r = make_backend().readings(uuid)  # handle found by UUID without discover
    assert r.power_w is None and r.temperature_c == 40.0


def test_process_utilization_returns_only_newer_samples(fake_nvml: FakeNvml, make_backend):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_process_samples(uuid, [(100, 1_000, 30), (101, 2_000, 55), (102, 3_000, 140)])
    backend = make_backend()
    samples = backend.process_utilization(uuid, 1_000)
    assert [(s.pid, s.timestamp_us, s.sm_util) for s in samples] == [
        (101, 2_000, 55),
        (102, 3_000, 100),  # clamped
    ]
    assert backend.process_utilization(uuid, 3_000) == []


def test_process_utilization_not_supported(fake_nvml: FakeNvml, make_backend):
    uuid = fake_nvml.uuids[1]
    fake_nvml.update_gpu(uuid, process_utilization_supported=False)
    backend = make_backend()
    with pytest.raises(GpuError) as err:
        backend.process_utilization(uuid, 0)
    assert (err.value.code, err.value.call) == (
        NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetProcessUtilization",
    )


def test_running_processes(fake_nvml: FakeNvml, make_backend):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_processes(uuid, [(4242, 3 << 30), (4343, 1 << 20)])
    assert make_backend().running_processes(uuid) == [(4242, 3 << 30), (4343, 1 << 20)]


def test_wait_xid_times_out_then_delivers(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    begin = time.monotonic()
    assert backend.wait_xid(60) is None
    assert time.monotonic() - begin >= 0.055
    fake_nvml.inject_xid(fake_nvml.uuids[1], 79)
    event = backend.wait_xid(1000)
    assert event is not None and (event.uuid, event.xid) == (fake_nvml.uuids[1], 79)


def test_wait_xid_waits_without_spinning(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    backend.wait_xid(1)  # creates and registers the event set
    cpu = time.thread_time()  # this thread is the one inside nvmlEventSetWait
    assert backend.wait_xid(300) is None
    assert time.thread_time() - cpu < 0.1


def test_wait_error_rebuilds_the_event_set(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    backend.wait_xid(1)
    fake_nvml.fail("nvmlEventSetWait_v2", code=NVML_ERROR_UNKNOWN)
    with pytest.raises(GpuError) as err:
        backend.wait_xid(10)
    assert err.value.call == "nvmlEventSetWait"
    assert backend.errors_by_call["nvmlEventSetWait"] == 1
    fake_nvml.clear_failures()
    assert backend.wait_xid(1) is None  # new set registered
    fake_nvml.inject_xid(fake_nvml.uuids[0], 48)
    event = backend.wait_xid(1000)
    assert event is not None and event.xid == 48


def test_registration_failure_is_an_error_and_retried(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    backend.discover()
    fake_nvml.fail("nvmlDeviceRegisterEvents", fake_nvml.uuids[0], NVML_ERROR_UNKNOWN)
    with pytest.raises(GpuError, match="nvmlDeviceRegisterEvents"):
        backend.wait_xid(1)
    fake_nvml.clear_failures()
    assert backend.wait_xid(1) is None


def test_gpus_without_xid_events_are_not_registered(fake_nvml: FakeNvml, make_backend):
    quiet = fake_nvml.uuids[0]
    fake_nvml.update_gpu(quiet, event_types=0)
    backend = make_backend()
    backend.discover()
    backend.wait_xid(1)
    fake_nvml.inject_xid(quiet, 79)
    fake_nvml.inject_xid(fake_nvml.uuids[1], 79)
    event = backend.wait_xid(1000)
    assert event is not None and event.uuid == fake_nvml.uuids[1]


def test_corrupt_inventory_keeps_the_last_good_one(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    assert len(backend.discover().gpus) == 2
    fake_nvml.write_raw_config("gpu GPU-x memory=1 bogus\n")
    assert len(backend.discover().gpus) == 2


def test_corrupt_inventory_at_start_fails_start(fake_nvml: FakeNvml, make_backend):
    fake_nvml.write_raw_config("this is not an inventory\n")
    with pytest.raises(GpuError) as err:
        make_backend(start=False).start()
    assert err.value.call == "nvmlInit"


async def test_xid_then_recovery_through_the_health_monitor(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    gpus = backend.discover().gpus
    monitor = HealthMonitor(backend, gpus, IGNORED, 0.3, check_interval_s=0.05)
    changes = monitor.subscribe()
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.2)  # the waiter registers its event set
    uuid = fake_nvml.uuids[0]
    fake_nvml.inject_xid(uuid, 43)  # ignored
    fake_nvml.inject_xid(uuid, 79)
    down = await asyncio.wait_for(changes.get(), 2.0)
    assert (down.uuid, down.healthy, down.xid) == (uuid, False, 79)
    up = await asyncio.wait_for(changes.get(), 3.0)
    assert (up.uuid, up.healthy) == (uuid, True)
    assert monitor.xid_counts == {uuid: 1, fake_nvml.uuids[1]: 0}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_lost_gpu_goes_unhealthy_through_the_health_monitor(
    fake_nvml: FakeNvml, make_backend
):
    backend = make_backend()
    monitor = HealthMonitor(backend, backend.discover().gpus, IGNORED, 0.0, 0.05)
    changes = monitor.subscribe()
    task = asyncio.create_task(monitor.run())
    fake_nvml.lose_gpu(fake_nvml.uuids[1])
    change = await asyncio.wait_for(changes.get(), 2.0)
    assert (change.uuid, change.healthy) == (fake_nvml.uuids[1], False)
    assert "GPU is lost" in change.reason
    fake_nvml.clear_failures()
    await asyncio.sleep(0.3)
    assert monitor.healthy()[fake_nvml.uuids[1]] is False  # recovery disabled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_discovery_registers_the_found_gpus_for_events(fake_nvml: FakeNvml, make_backend):
    backend = make_backend()
    assert backend.wait_xid(1) is None  # a set made before discovery watches no GPU
    backend.discover()
    backend.wait_xid(1)
    fake_nvml.inject_xid(fake_nvml.uuids[0], 94)
    event = backend.wait_xid(1000)
    assert event is not None and (event.uuid, event.xid) == (fake_nvml.uuids[0], 94)


# ---- per-process samples in one driver call --------------------------------------------------

PROCESS_UTILIZATION = "nvmlDeviceGetProcessUtilization"


def test_process_utilization_asks_the_driver_once_where_pynvml_asks_twice(
    fake_nvml: FakeNvml, make_backend
):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_process_samples(uuid, [(100, 1_000, 30), (101, 2_000, 55)])
    backend = make_backend()
    before = fake_nvml.call_count(PROCESS_UTILIZATION)
    assert [s.pid for s in backend.process_utilization(uuid, 0)] == [100, 101]
    assert backend.process_utilization(uuid, 2_000) == []  # nothing newer: NOT_FOUND
    assert fake_nvml.call_count(PROCESS_UTILIZATION) - before == 2  # one call a read
    before = fake_nvml.call_count(PROCESS_UTILIZATION)
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    assert len(pynvml.nvmlDeviceGetProcessUtilization(handle, 0)) == 2
    assert fake_nvml.call_count(PROCESS_UTILIZATION) - before == 2  # the wrapper: size, then fill


def test_process_utilization_grows_its_buffer_for_a_long_history(
    fake_nvml: FakeNvml, make_backend
):
    uuid = fake_nvml.uuids[0]
    history = [(1_000 + n % 150, 10_000 + n, n % 101) for n in range(300)]
    fake_nvml.set_process_samples(uuid, history)
    backend = make_backend()
    before = fake_nvml.call_count(PROCESS_UTILIZATION)
    samples = backend.process_utilization(uuid, 0)
    assert [(s.pid, s.timestamp_us, s.sm_util) for s in samples] == history
    assert fake_nvml.call_count(PROCESS_UTILIZATION) - before == 2  # too small once, then read
    before = fake_nvml.call_count(PROCESS_UTILIZATION)
    assert len(backend.process_utilization(uuid, 10_100)) == 199
    assert fake_nvml.call_count(PROCESS_UTILIZATION) - before == 1  # the grown buffer kept


def test_a_driver_that_never_has_room_enough_is_an_error_not_a_loop(
    fake_nvml: FakeNvml, make_backend
):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_process_samples(uuid, [(100, 1_000, 30)])
    fake_nvml.fail(PROCESS_UTILIZATION, uuid, pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    backend = make_backend()
    before = fake_nvml.call_count(PROCESS_UTILIZATION)
    with pytest.raises(GpuError) as err:
        backend.process_utilization(uuid, 0)
    assert (err.value.call, err.value.code) == (
        PROCESS_UTILIZATION, pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    assert fake_nvml.call_count(PROCESS_UTILIZATION) - before == ProcessSampleReader.ATTEMPTS
    fake_nvml.clear_failures()
    assert [s.pid for s in backend.process_utilization(uuid, 0)] == [100]  # and reads after


SampleArray = ctypes.POINTER(pynvml.c_nvmlProcessUtilizationSample_t)
DriverCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, SampleArray,
                              ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong)


class StubDriver:
    """`nvmlDeviceGetProcessUtilization` as C sees it, answering from a list of samples that
    `grow` lengthens after each call (samples arriving between calls); `cuts` fills a short
    buffer to its end and says SUCCESS, as a driver might, instead of INSUFFICIENT_SIZE."""

    def __init__(self, samples: int, grow: int = 0, cuts: bool = False):
        self.samples = [(500 + n, 1_000 + n, n % 100) for n in range(samples)]
        self.grow, self.cuts, self.calls = grow, cuts, 0
        self.function = DriverCall(self._call)

    def _call(self, handle, buffer, count, since) -> int:
        self.calls += 1
        newer = [s for s in self.samples if s[1] > since]
        room = count[0]
        try:
            if not newer:
                count[0] = 0
                return pynvml.NVML_ERROR_NOT_FOUND
            if len(newer) > room and not self.cuts:
                count[0] = len(newer)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            for n, (pid, stamp, sm) in enumerate(newer[:room]):
                buffer[n].pid, buffer[n].timeStamp, buffer[n].smUtil = pid, stamp, sm
            count[0] = min(room, len(newer))
            return pynvml.NVML_SUCCESS
        finally:
            last = self.samples[-1][1] if self.samples else 0
            self.samples += [(900, last + 1 + n, 1) for n in range(self.grow)]


def test_samples_that_arrive_between_two_calls_are_read_not_an_error():
    # pynvml sizes, then fills: a sample arriving in between made its second call fail
    driver = StubDriver(samples=100, grow=3)
    reader = ProcessSampleReader(driver.function)
    got = reader.read(None, 0)
    assert driver.calls == 2  # 64 too few; then 164, with the 3 that came meanwhile
    assert [s[1] for s in got] == list(range(1_000, 1_103))


def test_a_buffer_filled_to_its_end_is_read_again_larger():
    driver = StubDriver(samples=64, cuts=True)
    reader = ProcessSampleReader(driver.function)
    assert len(reader.read(None, 0)) == 64
    assert driver.calls == 2  # 64 of 64 might be cut short: asked again with 128
    driver.samples += [(900, 5_000 + n, 1) for n in range(200)]
    assert len(reader.read(None, 0)) == 264  # 128 full, then 256 full, then 512
    assert driver.calls == 5


def test_the_reader_answers_what_the_driver_says():
    empty = StubDriver(samples=0)
    assert ProcessSampleReader(empty.function).read(None, 0) == []
    lost = DriverCall(lambda handle, buffer, count, since: pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(pynvml.NVMLError) as err:
        ProcessSampleReader(lost).read(None, 0)
    assert err.value.value == pynvml.NVML_ERROR_GPU_IS_LOST

"""The fake libnvidia-ml.so.1 keeps NVML's contracts: sizing protocol, init state, event
delivery from the events file, live config reloads, and use from another process."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest

from tests.fakes.fakenvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    FakeNvml,
    Sample,
)

INSUFFICIENT_SIZE = 7
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lib(fake_nvml: FakeNvml):
    """The fake, loaded directly with ctypes and initialised (shut down again afterwards)."""
    handle = ctypes.CDLL(str(fake_nvml.library_path))
    assert handle.nvmlInit_v2() == 0
    yield handle
    while handle.nvmlShutdown() == 0:
        pass


def device(lib, index: int) -> pynvml.c_nvmlDevice_t:
    dev = pynvml.c_nvmlDevice_t()
    assert lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(dev)) == 0
    return dev


def test_calls_before_init_answer_uninitialized(fake_nvml: FakeNvml):
    handle = ctypes.CDLL(str(fake_nvml.library_path))
    count = ctypes.c_uint()
    assert handle.nvmlDeviceGetCount_v2(ctypes.byref(count)) == NVML_ERROR_UNINITIALIZED


def test_init_without_config_is_driver_not_loaded(fake_nvml: FakeNvml, monkeypatch):
    handle = ctypes.CDLL(str(fake_nvml.library_path))
    monkeypatch.delenv("FAKE_NVML_CONFIG")
    assert handle.nvmlInit_v2() == NVML_ERROR_DRIVER_NOT_LOADED


def test_process_utilization_sizing_protocol(fake_nvml: FakeNvml, lib):
    uuid = fake_nvml.uuids[0]
    fake_nvml.set_process_samples(uuid, [Sample(1, 10, 5), Sample(2, 20, 6), Sample(3, 30, 7)])
    dev = device(lib, 0)
    count = ctypes.c_uint(0)
    fn = lib.nvmlDeviceGetProcessUtilization
    assert fn(dev, None, ctypes.byref(count), ctypes.c_ulonglong(10)) == INSUFFICIENT_SIZE
    assert count.value == 2  # only the samples newer than 10
    small = (pynvml.c_nvmlProcessUtilizationSample_t * 1)()
    count.value = 1
    assert fn(dev, small, ctypes.byref(count), ctypes.c_ulonglong(0)) == INSUFFICIENT_SIZE
    assert count.value == 3
    big = (pynvml.c_nvmlProcessUtilizationSample_t * 8)()
    count.value = 8
    assert fn(dev, big, ctypes.byref(count), ctypes.c_ulonglong(0)) == 0
    assert [(big[i].pid, big[i].timeStamp, big[i].smUtil) for i in range(count.value)] == [
        (1, 10, 5),
        (2, 20, 6),
        (3, 30, 7),
    ]
    assert fn(dev, None, ctypes.byref(count), ctypes.c_ulonglong(30)) == NVML_ERROR_NOT_FOUND


def test_bad_handles_and_null_pointers_are_invalid_arguments(lib):
    bogus = ctypes.cast(ctypes.c_void_p(8), pynvml.c_nvmlDevice_t)
    name = ctypes.create_string_buffer(96)
    assert lib.nvmlDeviceGetName(bogus, name, ctypes.c_uint(96)) == NVML_ERROR_INVALID_ARGUMENT
    assert lib.nvmlDeviceGetMinorNumber(device(lib, 0), None) == NVML_ERROR_INVALID_ARGUMENT
    dev = pynvml.c_nvmlDevice_t()
    assert lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(9), ctypes.byref(dev)) == (
        NVML_ERROR_INVALID_ARGUMENT
    )


def test_short_string_buffers_are_insufficient_size(lib):
    name = ctypes.create_string_buffer(4)
    assert lib.nvmlDeviceGetName(device(lib, 0), name, ctypes.c_uint(4)) == INSUFFICIENT_SIZE


def test_config_changes_are_seen_without_reinit(fake_nvml: FakeNvml, lib):
    count = ctypes.c_uint()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value == 2
    fake_nvml.set_gpus(3)
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value == 3


def wait_event(lib, event_set, timeout_ms: int):
    data = pynvml.c_nvmlEventData_t()
    rc = lib.nvmlEventSetWait_v2(event_set, ctypes.byref(data), ctypes.c_uint(timeout_ms))
    return rc, data


def test_events_need_registration_and_skip_partial_lines(fake_nvml: FakeNvml, lib):
    fake_nvml.inject_xid(fake_nvml.uuids[0], 31)  # before the set exists: never delivered
    event_set = pynvml.c_nvmlEventSet_t()
    assert lib.nvmlEventSetCreate(ctypes.byref(event_set)) == 0
    assert lib.nvmlDeviceRegisterEvents(device(lib, 1), ctypes.c_ulonglong(8), event_set) == 0
    fake_nvml.inject_xid(fake_nvml.uuids[0], 79)  # GPU 0 is not registered
    with open(fake_nvml.events_path, "a") as f:
        f.write(f"{fake_nvml.uuids[1]} 4")  # a line still being written
    assert wait_event(lib, event_set, 30)[0] == NVML_ERROR_TIMEOUT
    with open(fake_nvml.events_path, "a") as f:
        f.write("8\n")
    rc, data = wait_event(lib, event_set, 1000)
    assert rc == 0 and data.eventData == 48 and data.eventType == 8
    assert (
        ctypes.cast(data.device, ctypes.c_void_p).value
        == ctypes.cast(device(lib, 1), ctypes.c_void_p).value
    )
    assert lib.nvmlEventSetFree(event_set) == 0


def test_event_wait_delivers_while_blocked(fake_nvml: FakeNvml, lib):
    event_set = pynvml.c_nvmlEventSet_t()
    assert lib.nvmlEventSetCreate(ctypes.byref(event_set)) == 0
    assert lib.nvmlDeviceRegisterEvents(device(lib, 0), ctypes.c_ulonglong(8), event_set) == 0
    threading.Timer(0.1, fake_nvml.inject_xid, (fake_nvml.uuids[0], 79)).start()
    begin = time.monotonic()
    rc, data = wait_event(lib, event_set, 5000)
    elapsed = time.monotonic() - begin
    assert rc == 0 and data.eventData == 79
    assert 0.09 <= elapsed < 2.0  # woke on the event, long before the 5 s timeout
    lib.nvmlEventSetFree(event_set)


def test_unsupported_event_types_cannot_be_registered(fake_nvml: FakeNvml, lib):
    fake_nvml.update_gpu(fake_nvml.uuids[0], event_types=0x1)
    event_set = pynvml.c_nvmlEventSet_t()
    assert lib.nvmlEventSetCreate(ctypes.byref(event_set)) == 0
    assert lib.nvmlDeviceRegisterEvents(device(lib, 0), ctypes.c_ulonglong(8), event_set) == 3
    lib.nvmlEventSetFree(event_set)


def test_another_process_uses_the_fake_through_env(fake_nvml: FakeNvml):
    script = (
        "import json, sys\n"
        "from vgpu_agent.gpu.nvml import NvmlBackend\n"
        "b = NvmlBackend(sys.argv[1]); b.start()\n"
        "print(json.dumps([g.uuid for g in b.discover().gpus])); b.shutdown()\n"
    )
    env = {**os.environ, **fake_nvml.env()}
    out = subprocess.run(
        [sys.executable, "-c", script, str(fake_nvml.library_path)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == fake_nvml.uuids


def test_system_library_env_makes_it_the_default_nvml(fake_nvml: FakeNvml):
    script = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    env = {**os.environ, **fake_nvml.env(system_library=True)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


def test_library_is_built_once_per_source(fake_nvml_library: Path):
    from tests.fakes.fakenvml import build_fake_nvml

    assert build_fake_nvml() == fake_nvml_library
    assert fake_nvml_library.name == "libnvidia-ml.so.1"


def test_failure_rules_match_whole_names_with_optional_version(fake_nvml: FakeNvml, lib):
    dev = device(lib, 0)
    name = ctypes.create_string_buffer(96)
    count = ctypes.c_uint()
    fake_nvml.fail("nvmlDeviceGet", code=999)  # a prefix, not a name: matches nothing
    assert lib.nvmlDeviceGetName(dev, name, ctypes.c_uint(96)) == 0
    fake_nvml.fail("nvmlDeviceGetCount", code=999)  # unversioned name of nvmlDeviceGetCount_v2
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 999
    fake_nvml.fail("nvmlDeviceGetName", fake_nvml.uuids[1], code=15)  # one GPU only
    assert lib.nvmlDeviceGetName(dev, name, ctypes.c_uint(96)) == 0
    assert lib.nvmlDeviceGetName(device(lib, 1), name, ctypes.c_uint(96)) == 15
    fake_nvml.clear_failures()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0


def test_garbage_in_the_events_file_is_skipped(fake_nvml: FakeNvml, lib):
    event_set = pynvml.c_nvmlEventSet_t()
    assert lib.nvmlEventSetCreate(ctypes.byref(event_set)) == 0
    assert lib.nvmlDeviceRegisterEvents(device(lib, 0), ctypes.c_ulonglong(8), event_set) == 0
    with open(fake_nvml.events_path, "a") as f:
        f.write("x" * 5000 + "\n" + "not an event\n" + "GPU-unknown 79\n")
    fake_nvml.inject_xid(fake_nvml.uuids[0], 62)
    rc, data = wait_event(lib, event_set, 1000)
    assert rc == 0 and data.eventData == 62
    lib.nvmlEventSetFree(event_set)

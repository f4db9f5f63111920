"""The simulated backend: deterministic inventory, fault injection, blocking XID waits."""

from __future__ import annotations

import re
import threading
import time

import pytest

from vgpu_agent.gpu.model import GpuError, ProcessSample
from vgpu_agent.gpu.sim import SimBackend, compute_capability

UUID_FORM = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def started(spec: str = "2xA100-80GB,1xL4-24GB") -> SimBackend:
    backend = SimBackend(spec)
    backend.start()
    return backend


def test_inventory_follows_the_spec():
    gpus = started().discover().gpus
    assert [g.index for g in gpus] == [0, 1, 2]
    assert [g.memory_total for g in gpus] == [80 << 30, 80 << 30, 24 << 30]
    assert [g.compute_capability for g in gpus] == [(8, 0), (8, 0), (8, 9)]
    assert [g.numa_node for g in gpus] == [0, 1, 0]
    assert len({g.pci_bus_id for g in gpus}) == 3
    assert all(UUID_FORM.match(g.uuid) for g in gpus)
    assert len({g.uuid for g in gpus}) == 3


def test_uuids_are_deterministic_per_spec():
    assert started().uuids == started().uuids
    assert started("1xA100-80GB").uuids != started("1xA100-40GB").uuids


def test_pci_ids_stay_valid_for_large_inventories():
    gpus = started("40xT4-16GB").discover().gpus
    assert len({g.pci_bus_id for g in gpus}) == 40
    for gpu in gpus:
        domain, bus, rest = gpu.pci_bus_id.split(":")
        assert len(domain) == 8 and int(bus, 16) <= 0xFF and rest == "00.0"


@pytest.mark.parametrize(
    ("model", "cc"),
    [
        ("A100", (8, 0)),
        ("H100", (9, 0)),
        ("H200", (9, 0)),
        ("L4", (8, 9)),
        ("T4", (7, 5)),
        ("L40S", (8, 9)),
        ("Quadro", (8, 0)),
    ],
)
def test_compute_capability_by_model(model, cc):
    assert compute_capability(model) == cc


def test_bad_spec_raises_value_error():
    with pytest.raises(ValueError, match="bad simulated GPU entry"):
        SimBackend("2xA100")


def test_calls_before_start_fail_like_an_uninitialised_library():
    backend = SimBackend("1xA100-80GB")
    with pytest.raises(GpuError) as err:
        backend.discover()
    assert err.value.code == 1


def test_start_failure_can_be_injected_and_cleared():
    backend = SimBackend("1xA100-80GB")
    backend.set_start_failure(GpuError("driver not loaded", call="nvmlInit", code=9))
    with pytest.raises(GpuError, match="driver not loaded"):
        backend.start()
    backend.set_start_failure(None)
    backend.start()
    assert len(backend.discover().gpus) == 1


def test_lost_gpu_fails_checks_until_it_returns():
    backend = started()
    lost, fine = backend.uuids[0], backend.uuids[1]
    backend.set_lost(lost)
    with pytest.raises(GpuError) as err:
        backend.check(lost)
    assert err.value.gpu_lost and err.value.code == 15
    with pytest.raises(GpuError):
        backend.readings(lost)
    backend.check(fine)
    backend.set_lost(lost, False)
    backend.check(lost)


def test_unknown_uuid_is_an_error_naming_it():
    backend = started()
    with pytest.raises(GpuError, match="GPU-nope"):
        backend.check("GPU-nope")
    with pytest.raises(KeyError, match="GPU-nope"):
        backend.inject_xid("GPU-nope", 79)


def test_wait_xid_times_out_without_events():
    backend = started()
    begin = time.monotonic()
    assert backend.wait_xid(50) is None
    assert 0.045 <= time.monotonic() - begin < 1.0


def test_wait_xid_wakes_up_as_soon_as_an_xid_is_injected():
    backend = started()
    uuid = backend.uuids[1]
    threading.Timer(0.05, backend.inject_xid, (uuid, 79)).start()
    begin = time.monotonic()
    event = backend.wait_xid(5000)
    assert event is not None and (event.uuid, event.xid) == (uuid, 79)
    assert time.monotonic() - begin < 1.0


def test_events_are_delivered_in_order():
    backend = started()
    a, b = backend.uuids[:2]
    backend.inject_xid(a, 48)
    backend.inject_xid(b, 79)
    assert [(e.uuid, e.xid) for e in (backend.wait_xid(10), backend.wait_xid(10))] == [
        (a, 48),
        (b, 79),
    ]
    assert backend.wait_xid(0) is None


def test_readings_update_partially():
    backend = started()
    uuid = backend.uuids[0]
    backend.set_readings(uuid, util=0.5, mem_used=1 << 30)
    backend.set_readings(uuid, temp=71.0)
    r = backend.readings(uuid)
    assert (r.utilization, r.memory_used, r.temperature_c) == (0.5, 1 << 30, 71.0)


def test_process_samples_filter_by_timestamp_and_can_come_from_a_hook():
    backend = started()
    uuid = backend.uuids[0]
    backend.set_process_samples(uuid, [ProcessSample(10, 100, 20), ProcessSample(11, 300, 40)])
    assert [s.pid for s in backend.process_utilization(uuid, 150)] == [11]
    backend.set_sample_source(lambda u, since: [ProcessSample(99, since + 1, 5)])
    assert [s.pid for s in backend.process_utilization(uuid, 150)] == [11, 99]
    assert backend.running_processes(uuid) == [(10, None), (11, None)]


def test_process_utilization_can_be_unsupported():
    backend = started()
    uuid = backend.uuids[0]
    backend.set_process_utilization_supported(uuid, False)
    with pytest.raises(GpuError) as err:
        backend.process_utilization(uuid, 0)
    assert err.value.code == 3

"""The collectors, from real region files (written as the shim writes them) and cached readings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from tests.fakes.promtext import names, series, value
from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region, put_totals
from vgpu_agent.gpu.model import GpuReadings
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics.collectors import (
    AgentInstruments,
    families,
    render_exposition,
    take_snapshot,
)
from vgpu_agent.metrics.poller import GpuSample, RegionCache
from vgpu_agent.metrics.sources import Identity, MetricsSources

GIB = 1 << 30
GPUS = build_inventory("2xA100-80GB,1xL4-24GB")
G0, G1, G2 = (g.uuid for g in GPUS)


@dataclass
class Status:
    measured_util: float | None
    rate: int
    open_loop: bool = False
    paused: bool = False


@dataclass
class Registration:
    registered: bool = True
    registrations: int = 1
    kubelet_restarts: int = 0
    last_error: str = ""


class Node:
    """A node's worth of stand-in sources around real region files."""

    def __init__(self, root: Path):
        self.root = root
        self.handles: list[FileRegion] = []
        self.identities: dict[str, Identity] = {}
        self.throttle: dict[tuple[str, int], Status] = {}
        self.gpu_samples = {
            g.uuid: GpuSample(GpuReadings(5 * GIB, 0.5, 40.0, 120.0), False) for g in GPUS
        }

    def region(
        self,
        alloc_id: str,
        identity: Identity | None,
        devices: list[DeviceSpec],
        slices: list[str],
        seq: int = 1,
    ) -> Path:
        directory = make_region(self.root, alloc_id, devices, slices, seq)
        self.handles.append(FileRegion(directory))
        if identity is not None:
            self.identities[alloc_id] = identity
        return directory

    def sources(self, **overrides: object) -> MetricsSources:
        values: dict[str, object] = {
            "node": "node-a",
            "gpus": lambda: GPUS,
            "slices_per_gpu": 4,
            "regions": lambda: self.handles,
            "identity": self.identities.get,
            "throttle_status": lambda: self.throttle,
        }
        values.update(overrides)
        return MetricsSources(**values)  # type: ignore[arg-type]

    async def scrape(self, hami: bool = False, **overrides: object) -> str:
        cache = RegionCache(lambda: self.handles)
        await cache.refresh()
        snap = take_snapshot(self.sources(**overrides), self.gpu_samples, cache.samples)
        return render_exposition(snap, AgentInstruments(), hami, generate_latest, False).decode()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def _labels(ns: str, pod: str, ctr: str, uuid: str, index: int) -> dict[str, str]:
    return {"namespace": ns, "pod": pod, "container": ctr, "gpu_uuid": uuid, "gpu_index": str(index)}


async def test_gpu_series_carry_node_uuid_index_model(node: Node) -> None:
    node.gpu_samples[G2] = GpuSample(GpuReadings(3 * GIB, 0.25, 51.0, 70.5), False)
    text = await node.scrape(healthy=lambda: {G0: True, G1: False, G2: True},
                             xid_counts=lambda: {G1: 3})
    l4 = {"node": "node-a", "gpu_uuid": G2, "gpu_index": "2", "model": "NVIDIA L4-24GB"}
    assert value(text, "vgpu_gpu_memory_total_bytes", **l4) == 24 * GIB
    assert value(text, "vgpu_gpu_memory_used_bytes", **l4) == 3 * GIB
    assert value(text, "vgpu_gpu_utilization_ratio", **l4) == 0.25
    assert value(text, "vgpu_gpu_temperature_celsius", **l4) == 51.0
    assert value(text, "vgpu_gpu_power_watts", **l4) == 70.5
    assert value(text, "vgpu_gpu_slices", **l4) == 4
    assert value(text, "vgpu_gpu_healthy", gpu_uuid=G1) == 0
    assert value(text, "vgpu_gpu_healthy", gpu_uuid=G0) == 1
    assert value(text, "vgpu_gpu_critical_xid_events_total", gpu_uuid=G1) == 3
    assert value(text, "vgpu_gpu_critical_xid_events_total", gpu_uuid=G0) == 0
    assert len(series(text, "vgpu_gpu_memory_total_bytes")) == 3


async def test_stale_gpu_loses_live_readings_but_keeps_its_other_series(node: Node) -> None:
    node.gpu_samples[G1] = GpuSample(GpuReadings(1, 0.9, 80.0, 300.0), True, "lost", 0.0, 4)
    node.region("a", ("ns", "p", "c"), [DeviceSpec(G1, 8 * GIB, 50)], [f"{G1}::0"])
    text = await node.scrape()
    assert value(text, "vgpu_gpu_readings_stale", gpu_uuid=G1) == 1
    assert value(text, "vgpu_gpu_readings_stale", gpu_uuid=G0) == 0
    assert value(text, "vgpu_gpu_poll_failures_total", gpu_uuid=G1) == 4
    for name in ("vgpu_gpu_memory_used_bytes", "vgpu_gpu_utilization_ratio",
                 "vgpu_gpu_temperature_celsius", "vgpu_gpu_power_watts"):
        assert value(text, name, gpu_uuid=G1) is None, name
        assert value(text, name, gpu_uuid=G0) is not None, name
    assert value(text, "vgpu_gpu_memory_total_bytes", gpu_uuid=G1) == 80 * GIB
    assert value(text, "vgpu_container_memory_limit_bytes", gpu_uuid=G1) == 8 * GIB


async def test_container_without_gpu_use_yet_has_its_limit_series(node: Node) -> None:
    node.region("a", ("team", "train-0", "main"), [DeviceSpec(G0, 20 * GIB, 25)], [f"{G0}::1"])
    text = await node.scrape()
    labels = _labels("team", "train-0", "main", G0, 0)
    assert series(text, "vgpu_container_memory_limit_bytes") == [(labels, 20 * GIB)]
    assert series(text, "vgpu_container_core_limit_ratio") == [(labels, 0.25)]
    assert series(text, "vgpu_container_memory_used_bytes") == [
        ({**labels, "kind": kind}, 0) for kind in ("context", "data", "module", "pool")
    ]
    assert series(text, "vgpu_container_kernel_launches_total") == [(labels, 0)]
    assert series(text, "vgpu_container_last_launch_age_seconds") == []  # never launched


async def test_memory_is_exported_by_kind_and_the_kinds_add_up(node: Node) -> None:
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, 20 * GIB, 50)], [f"{G0}::0"])
    shim = ShimWriter(directory)
    shim.process(0, 17, 4017, 0, memory=5 * GIB)
    shim.device_totals(0, memory=5 * GIB)
    shim.memory_kinds(0, context=GIB // 2, module=GIB // 4, pool=2 * GIB)
    shim.close()
    text = await node.scrape()
    kinds = {lab["kind"]: v for lab, v in series(text, "vgpu_container_memory_used_bytes")}
    assert kinds == {"context": GIB // 2, "module": GIB // 4, "pool": 2 * GIB,
                     "data": 5 * GIB - GIB // 2 - GIB // 4 - 2 * GIB}
    assert sum(kinds.values()) == 5 * GIB


async def test_kinds_above_the_total_leave_no_negative_data(node: Node) -> None:
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, 20 * GIB, 50)], [f"{G0}::0"])
    shim = ShimWriter(directory)
    shim.device_totals(0, memory=GIB)
    shim.memory_kinds(0, pool=2 * GIB)  # a reader may see a kind before its total
    shim.close()
    text = await node.scrape()
    assert value(text, "vgpu_container_memory_used_bytes", kind="data") == 0
    assert value(text, "vgpu_container_memory_used_bytes", kind="pool") == 2 * GIB


async def test_unpriced_graphs_are_counted_per_container_device(node: Node) -> None:
    directory = node.region(
        "a", ("ns", "p", "c"), [DeviceSpec(G1, 10 * GIB, 25), DeviceSpec(G2, 6 * GIB, 50)],
        [f"{G1}::3", f"{G2}::0"])
    shim = ShimWriter(directory)
    shim.graphs_unpriced(1, 3)
    shim.close()
    text = await node.scrape()
    assert value(text, "vgpu_container_graphs_unpriced_total", gpu_uuid=G2) == 3
    assert value(text, "vgpu_container_graphs_unpriced_total", gpu_uuid=G1) == 0


async def test_container_usage_comes_from_the_state_file(node: Node) -> None:
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, 20 * GIB, 50)], [f"{G0}::0"])
    shim = ShimWriter(directory)
    now = time.monotonic_ns()
    shim.process(0, 17, 4017, 0, memory=GIB, launches=100, wait_ns=1_500_000_000,
                 last_launch_ns=now - 2_000_000_000)
    shim.process(5, 18, 4018, 0, memory=2 * GIB, launches=50, wait_ns=500_000_000,
                 last_launch_ns=now - 4_000_000_000)
    shim.device_totals(0, memory=3 * GIB)
    shim.close()
    node.throttle[("a", 0)] = Status(measured_util=42.0, rate=123_456)
    text = await node.scrape()
    assert value(text, "vgpu_container_memory_used_bytes", pod="p", kind="data") == 3 * GIB
    assert value(text, "vgpu_container_kernel_launches_total", pod="p") == 150
    assert value(text, "vgpu_container_token_wait_seconds_total", pod="p") == 2.0
    age = value(text, "vgpu_container_last_launch_age_seconds", pod="p")
    assert age is not None and 2.0 <= age < 5.0  # the newest launch of the two processes
    assert value(text, "vgpu_container_core_utilization_ratio", pod="p") == 0.42
    assert value(text, "vgpu_container_token_refill_rate", pod="p") == 123_456
    assert value(text, "vgpu_container_throttle_open_loop", pod="p") == 0
    assert value(text, "vgpu_container_throttle_paused", pod="p") == 0
    node.throttle[("a", 0)] = Status(measured_util=42.0, rate=123_456, paused=True)
    assert value(await node.scrape(), "vgpu_container_throttle_paused", pod="p") == 1


async def test_launch_and_wait_counters_keep_an_ended_process_counts(node: Node) -> None:
    """The shim adds each launch to its process's slot and to the device's cumulative totals,
    and zeroes the slot when it reclaims it from a process that ended: the counters follow the
    totals, so they never fall when a process ends (Prometheus would read a reset)."""
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, 20 * GIB, 50)], [f"{G0}::0"])
    shim = ShimWriter(directory)
    shim.process(0, 17, 4017, 0)
    shim.process(1, 18, 4018, 0)
    shim.publish(0, 0, launches=100, wait_ns=1_500_000_000)
    shim.publish(1, 0, launches=50, wait_ns=500_000_000)
    text = await node.scrape()
    assert value(text, "vgpu_container_kernel_launches_total", pod="p") == 150
    assert value(text, "vgpu_container_token_wait_seconds_total", pod="p") == 2.0
    shim.reclaim(1)  # process 18 ended
    shim.publish(0, 0, launches=20)
    text = await node.scrape()
    assert value(text, "vgpu_container_kernel_launches_total", pod="p") == 170
    assert value(text, "vgpu_container_token_wait_seconds_total", pod="p") == 2.0
    # totals a container wrote below its live processes' counts never lower them
    put_totals(directory, 0, spent=0, launches=3, waited=0)
    shim.close()
    text = await node.scrape()
    assert value(text, "vgpu_container_kernel_launches_total", pod="p") == 120
    assert value(text, "vgpu_container_token_wait_seconds_total", pod="p") == 1.5


async def test_a_launch_stamped_in_the_future_reads_as_just_now(node: Node) -> None:
    """`state` is the container's: a last launch stamped ahead of the host's clock (a lie, or
    garbage) gives an age of 0, never a negative one, in both namings."""
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, 20 * GIB, 50)], [f"{G0}::0"])
    shim = ShimWriter(directory)
    shim.process(0, 17, 4017, 0, launches=1, last_launch_ns=time.monotonic_ns() + 10**12)
    shim.close()
    text = await node.scrape(hami=True)
    assert value(text, "vgpu_container_last_launch_age_seconds", pod="p") == 0
    assert value(text, "hami_container_last_kernel_elapsed_seconds", pod="p") == 0


async def test_container_with_two_gpus_has_one_series_per_gpu(node: Node) -> None:
    directory = node.region(
        "a",
        ("ns", "p", "c"),
        [DeviceSpec(G1, 10 * GIB, 25), DeviceSpec(G2, 6 * GIB, 50)],
        [f"{G1}::3", f"{G2}::0"],
    )
    shim = ShimWriter(directory)
    shim.process(0, 9, 909, 1, memory=GIB, launches=7)
    shim.device_totals(1, memory=GIB)
    shim.close()
    text = await node.scrape()
    assert series(text, "vgpu_container_memory_limit_bytes") == [
        (_labels("ns", "p", "c", G1, 1), 10 * GIB),
        (_labels("ns", "p", "c", G2, 2), 6 * GIB),
    ]
    assert value(text, "vgpu_container_memory_used_bytes", gpu_uuid=G2, kind="data") == GIB
    assert value(text, "vgpu_container_memory_used_bytes", gpu_uuid=G1, kind="data") == 0
    assert value(text, "vgpu_container_kernel_launches_total", gpu_uuid=G2) == 7
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G1) == 1
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G2) == 1
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G0) == 0


async def test_two_containers_in_one_pod_are_told_apart(node: Node) -> None:
    node.region("a", ("ns", "p", "trainer"), [DeviceSpec(G0, 10 * GIB, 25)], [f"{G0}::0"])
    node.region("b", ("ns", "p", "sidecar"), [DeviceSpec(G0, 5 * GIB, 25)], [f"{G0}::1"])
    text = await node.scrape()
    assert series(text, "vgpu_container_memory_limit_bytes") == [
        (_labels("ns", "p", "sidecar", G0, 0), 5 * GIB),
        (_labels("ns", "p", "trainer", G0, 0), 10 * GIB),
    ]
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G0) == 2


async def test_corrupt_state_file_keeps_limits_and_the_other_containers(node: Node) -> None:
    bad = node.region("bad", ("ns", "p1", "c"), [DeviceSpec(G0, 10 * GIB, 25)], [f"{G0}::0"])
    good = node.region("good", ("ns", "p2", "c"), [DeviceSpec(G0, 10 * GIB, 25)], [f"{G0}::1"])
    for directory, memory in ((bad, GIB), (good, 2 * GIB)):
        shim = ShimWriter(directory)
        shim.process(0, 3, 303, 0, memory=memory, launches=1)
        shim.device_totals(0, memory=memory)
        if directory is bad:
            shim.scribble_header()
        shim.close()
    text = await node.scrape()
    assert value(text, "vgpu_container_memory_limit_bytes", pod="p1") == 10 * GIB
    assert value(text, "vgpu_container_memory_used_bytes", pod="p1", kind="data") is None
    assert value(text, "vgpu_container_kernel_launches_total", pod="p1") is None
    assert value(text, "vgpu_container_memory_used_bytes", pod="p2", kind="data") == 2 * GIB
    assert value(text, "vgpu_regions", state="corrupt") == 1
    assert value(text, "vgpu_regions", state="active") == 1


async def test_truncated_state_file_is_reported_not_fatal(node: Node) -> None:
    directory = node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, GIB, 10)], [f"{G0}::0"])
    (directory / "state").write_bytes(b"")  # mmap of an empty file fails
    text = await node.scrape()
    assert value(text, "vgpu_regions", state="unreadable") == 1
    assert value(text, "vgpu_container_memory_limit_bytes", pod="p") == GIB


async def test_newest_allocation_wins_when_a_container_appears_twice(node: Node) -> None:
    node.region("old", ("ns", "p", "c"), [DeviceSpec(G0, 4 * GIB, 10)], [f"{G0}::0"], seq=1)
    node.region("new", ("ns", "p", "c"), [DeviceSpec(G0, 8 * GIB, 20)], [f"{G0}::1"], seq=2)
    text = await node.scrape()  # samples() raises on duplicate series
    assert series(text, "vgpu_container_memory_limit_bytes") == [
        (_labels("ns", "p", "c", G0, 0), 8 * GIB)
    ]


async def test_replaced_allocation_on_another_gpu_is_not_shown(node: Node) -> None:
    # the container restarted and got a slice of another GPU; the old region awaits GC
    node.region("old", ("ns", "p", "c"), [DeviceSpec(G0, 4 * GIB, 10)], [f"{G0}::0"], seq=1)
    node.region("new", ("ns", "p", "c"), [DeviceSpec(G2, 6 * GIB, 20)], [f"{G2}::0"], seq=2)
    text = await node.scrape()
    assert series(text, "vgpu_container_memory_limit_bytes") == [
        (_labels("ns", "p", "c", G2, 2), 6 * GIB)
    ]
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G0) == 1  # held until GC


async def test_region_without_identity_is_counted_not_labelled(node: Node) -> None:
    node.region("a", None, [DeviceSpec(G0, GIB, 10)], [f"{G0}::0"])
    text = await node.scrape()
    assert series(text, "vgpu_container_memory_limit_bytes") == []
    assert value(text, "vgpu_regions", state="unidentified") == 1
    assert value(text, "vgpu_gpu_slices_allocated", gpu_uuid=G0) == 1


async def test_unlimited_rate_and_missing_throttle_data_leave_series_out(node: Node) -> None:
    node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, GIB, 100, "off")], [f"{G0}::0"])
    node.throttle[("a", 0)] = Status(measured_util=None, rate=1 << 52, open_loop=True)
    text = await node.scrape()
    assert value(text, "vgpu_container_token_refill_rate", pod="p") is None
    assert value(text, "vgpu_container_core_utilization_ratio", pod="p") is None
    assert value(text, "vgpu_container_throttle_open_loop", pod="p") == 1
    # no decision from the controller: nothing said of a pause either
    del node.throttle[("a", 0)]
    text = await node.scrape()
    assert value(text, "vgpu_container_throttle_paused", pod="p") is None
    assert value(text, "vgpu_container_throttle_open_loop", pod="p") is None


async def test_utilization_is_clamped_to_a_ratio(node: Node) -> None:
    node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, GIB, 50)], [f"{G0}::0"])
    node.throttle[("a", 0)] = Status(measured_util=180.0, rate=5)
    text = await node.scrape()
    assert value(text, "vgpu_container_core_utilization_ratio", pod="p") == 1.0


async def test_agent_counters(node: Node) -> None:
    text = await node.scrape(
        registration=lambda: Registration(True, 3, 2),
        nvml_errors=lambda: {"nvmlDeviceGetMemoryInfo": 5},
        region_events=lambda: {"created": 4, "removed": 2, "corrupt": 1, "adopted": 1},
        pod_resources_failures=lambda: 7,
    )
    assert value(text, "vgpu_plugin_registered") == 1
    assert value(text, "vgpu_plugin_registrations_total") == 3
    assert value(text, "vgpu_kubelet_restarts_total") == 2
    assert value(text, "vgpu_nvml_errors_total", call="nvmlDeviceGetMemoryInfo") == 5
    assert value(text, "vgpu_region_events_total", event="removed") == 2
    assert value(text, "vgpu_region_events_total", event="corrupt") == 1
    assert value(text, "vgpu_pod_resources_failures_total") == 7
    assert value(text, "vgpu_build_info", version=__import__("vgpu_agent").__version__) == 1
    assert "process_resident_memory_bytes" in names(text)


async def test_absent_sources_mean_absent_series_not_zeroes(node: Node) -> None:
    text = await node.scrape()
    for name in ("vgpu_plugin_registered", "vgpu_pod_resources_failures_total",
                 "vgpu_gpu_healthy", "vgpu_kubelet_restarts_total"):
        assert name not in names(text), name


def test_allocate_results_feed_the_counter_and_histogram() -> None:
    instruments = AgentInstruments()
    instruments.on_result("ok", 0.004)
    instruments.on_result("ok", 0.2)
    instruments.on_result("invalid", 0.001)
    instruments.on_result("surprise", 0.001)  # unknown results count as errors
    text = generate_latest(instruments.registry).decode()
    assert value(text, "vgpu_allocate_requests_total", result="ok") == 2
    assert value(text, "vgpu_allocate_requests_total", result="invalid") == 1
    assert value(text, "vgpu_allocate_requests_total", result="error") == 1
    assert value(text, "vgpu_allocate_duration_seconds_count") == 4
    assert value(text, "vgpu_allocate_duration_seconds_bucket", le="0.005") == 3
    assert value(text, "vgpu_allocate_duration_seconds_bucket", le="0.25") == 4


async def test_hami_names_only_when_asked_for(node: Node) -> None:
    node.region("a", ("ns", "p", "c"), [DeviceSpec(G1, 6 * GIB, 25)], [f"{G1}::0"])
    node.throttle[("a", 0)] = Status(measured_util=30.0, rate=10)
    plain = await node.scrape()
    assert not any(n.startswith("hami_") or n[0].isupper() for n in names(plain))
    text = await node.scrape(hami=True)
    c = {"namespace": "ns", "pod": "p", "container": "c", "vdevice_index": "0", "device_uuid": G1}
    assert value(text, "hami_vgpu_memory_limit_bytes", **c) == 6 * GIB
    assert value(text, "hami_vgpu_memory_used_bytes", **c) == 0
    assert value(text, "hami_container_device_utilization_ratio", **c) == 0.3
    host = {"node": "node-a", "device_index": "1", "device_uuid": G1,
            "device_type": "NVIDIA A100-80GB"}
    assert value(text, "hami_host_gpu_memory_used_bytes", **host) == 5 * GIB
    assert value(text, "hami_host_gpu_utilization_ratio", **host) == 0.5
    legacy = {"podnamespace": "ns", "podname": "p", "ctrname": "c", "vdeviceid": "0",
              "deviceuuid": G1}
    assert value(text, "vGPU_device_memory_limit_in_bytes", **legacy) == 6 * GIB
    assert value(text, "Device_utilization_desc_of_container", **legacy) == 30.0
    assert value(text, "HostCoreUtilization", deviceuuid=G1) == 50.0
    # the agent's own names are all still there
    assert names(plain) <= names(text)


async def test_openmetrics_exposition_parses(node: Node) -> None:
    node.region("a", ("ns", "p", "c"), [DeviceSpec(G0, GIB, 50)], [f"{G0}::0"])
    cache = RegionCache(lambda: node.handles)
    await cache.refresh()
    snap = take_snapshot(node.sources(), node.gpu_samples, cache.samples)
    text = render_exposition(snap, AgentInstruments(), False, om_latest, True).decode()
    assert text.endswith("# EOF\n")
    parsed = {f.name: f for f in parse_om(text)}
    assert parsed["vgpu_container_kernel_launches"].type == "counter"
    assert parsed["vgpu_build"].type == "info"


def test_families_without_samples_are_left_out() -> None:
    snap = take_snapshot(
        MetricsSources(node="n", gpus=lambda: (), slices_per_gpu=1), {}, ()
    )
    found = [f.name for f in families(snap)]
    assert "vgpu_container_memory_limit_bytes" not in found
    assert "vgpu_build" in found


async def test_dra_regions_name_their_claim_next_to_the_container(node: Node) -> None:
    claim_uid = "00000000-0000-4000-8000-000000000001"
    node.region("dra", ("team-a", "train-pod", "main"), [DeviceSpec(G0, 10 * GIB, 30)],
                [f"{claim_uid}-gpu-0"])
    node.region("dp", ("team-b", "p", "c"), [DeviceSpec(G1, 8 * GIB, 25)], [f"{G1}::0"])
    node.region("unbound", None, [DeviceSpec(G1, 8 * GIB, 25)], ["x-gpu-1"])
    claims = {"dra": ("team-a", "train", claim_uid), "unbound": ("team-c", "c", "u")}
    text = await node.scrape(claims=lambda: claims)
    info = series(text, "vgpu_container_claim_info")
    assert len(info) == 1  # the device-plugin region has no claim; an unbound one no container
    assert value(text, "vgpu_container_claim_info", namespace="team-a", pod="train-pod",
                 container="main", claim_namespace="team-a", claim_name="train",
                 claim_uid=claim_uid) == 1
    # the container's own series carry the same namespace/pod/container, so they join
    assert value(text, "vgpu_container_memory_limit_bytes",
                 **_labels("team-a", "train-pod", "main", G0, 0)) == 10 * GIB
    assert series(await node.scrape(), "vgpu_container_claim_info") == []  # device-plugin mode


async def test_time_sliced_gpus_and_their_phase_changes_are_series_of_the_gpu(node: Node) -> None:
    text = await node.scrape(time_sliced_gpus=lambda: frozenset({G1}),
                             use_only_strangers_gpus=lambda: frozenset({G0}),
                             phase_changes=lambda: {G1: 2, G0: 1},
                             use_charged_to_nobody=lambda: {G1: 37.5},
                             solo_turns=lambda: {G1: 1},
                             unmeasured=lambda: {G1: 3})
    assert value(text, "vgpu_gpu_nvml_time_sliced", gpu_uuid=G1) == 1
    assert value(text, "vgpu_gpu_nvml_time_sliced", gpu_uuid=G0) == 0
    # a GPU whose use NVML gives only to processes no container claims (an MPS server?)
    assert value(text, "vgpu_gpu_nvml_use_only_strangers", gpu_uuid=G0) == 1
    assert value(text, "vgpu_gpu_nvml_use_only_strangers", gpu_uuid=G1) == 0
    assert value(text, "vgpu_gpu_throttle_phase_changes_total", gpu_uuid=G1) == 2
    # found while G0 was time-sliced: the count stays, as a counter's does
    assert value(text, "vgpu_gpu_throttle_phase_changes_total", gpu_uuid=G0) == 1
    assert value(text, "vgpu_gpu_throttle_phase_changes_total", gpu_uuid=G2) == 0
    # the use charged to nobody: only for the GPUs split
    assert value(text, "vgpu_gpu_throttle_uncharged_use_percent", gpu_uuid=G1) == 37.5
    assert value(text, "vgpu_gpu_throttle_uncharged_use_percent", gpu_uuid=G0) is None
    assert value(text, "vgpu_gpu_throttle_solo_turns_total", gpu_uuid=G1) == 1
    assert value(text, "vgpu_gpu_throttle_solo_turns_total", gpu_uuid=G0) == 0
    # containers awaiting a figure: only for the GPUs split
    assert value(text, "vgpu_gpu_throttle_unmeasured_containers", gpu_uuid=G1) == 3
    assert value(text, "vgpu_gpu_throttle_unmeasured_containers", gpu_uuid=G0) is None
    # without a throttle controller the series are absent, not 0
    bare = await node.scrape()
    assert "vgpu_gpu_nvml_time_sliced" not in names(bare)
    assert "vgpu_gpu_nvml_use_only_strangers" not in names(bare)
    assert "vgpu_gpu_throttle_phase_changes_total" not in names(bare)
    assert "vgpu_gpu_throttle_uncharged_use_percent" not in names(bare)
    assert "vgpu_gpu_throttle_solo_turns_total" not in names(bare)
    assert "vgpu_gpu_throttle_unmeasured_containers" not in names(bare)


async def test_the_nvml_sample_period_is_a_series_of_each_gpu_read(node: Node) -> None:
    text = await node.scrape(sample_periods=lambda: {G0: 1 / 6, G1: 1.0})
    assert value(text, "vgpu_gpu_nvml_sample_period_seconds", gpu_uuid=G0) == pytest.approx(1 / 6)
    assert value(text, "vgpu_gpu_nvml_sample_period_seconds", gpu_uuid=G1) == 1.0
    # a GPU not read yet has no period to tell: no series, not 0
    assert value(text, "vgpu_gpu_nvml_sample_period_seconds", gpu_uuid=G2) is None
    assert "vgpu_gpu_nvml_sample_period_seconds" not in names(await node.scrape())


async def test_the_nvml_poll_periods_are_a_series_of_each_gpu_read(node: Node) -> None:
    text = await node.scrape(poll_periods=lambda: {G0: 1, G1: 2})
    assert value(text, "vgpu_gpu_nvml_poll_periods", gpu_uuid=G0) == 1
    assert value(text, "vgpu_gpu_nvml_poll_periods", gpu_uuid=G1) == 2
    assert value(text, "vgpu_gpu_nvml_poll_periods", gpu_uuid=G2) is None
    assert "vgpu_gpu_nvml_poll_periods" not in names(await node.scrape())


async def test_nvml_calls_and_their_seconds_are_counters_of_the_gpu_and_ticks_of_the_agent(
        node: Node) -> None:
    asked = {G1: (12, 0.0264), G0: (1, 0.5)}
    text = await node.scrape(nvml_utilization_calls=lambda: asked, throttle_ticks=lambda: 345)
    # a GPU the throttle has not asked yet reads 0, as a counter starts
    for uuid, (made, seconds) in {**asked, G2: (0, 0.0)}.items():
        got = (value(text, "vgpu_gpu_nvml_process_utilization_calls_total", gpu_uuid=uuid),
               value(text, "vgpu_gpu_nvml_process_utilization_call_seconds_total", gpu_uuid=uuid))
        assert got == (made, seconds), uuid
    assert value(text, "vgpu_throttle_ticks_total") == 345
    # without a throttle controller the series are absent, not 0
    bare = names(await node.scrape())
    assert not bare & {"vgpu_gpu_nvml_process_utilization_calls_total", "vgpu_throttle_ticks_total",
                       "vgpu_gpu_nvml_process_utilization_call_seconds_total"}

"""Label sets kept from scrape to scrape: the series follow every change of values, labels and
containers, a vanished container takes its series and its kept set with it, and the exposition
is the one prometheus_client writes for the same families, in both formats."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from tests.fakes.promtext import series, value
from tests.fakes.shimstate import DeviceSpec, FileRegion, ShimWriter, make_region
from vgpu_agent.gpu.model import GpuReadings
from vgpu_agent.gpu.sim import build_inventory
from vgpu_agent.metrics.collectors import (
    AgentInstruments,
    ContainerDevice,
    ScrapeView,
    Snapshot,
    build_families,
    render_exposition,
    take_snapshot,
)
from vgpu_agent.metrics.exposition import Labels, LabelSets, encode
from vgpu_agent.metrics.poller import GpuSample, RegionCache
from vgpu_agent.metrics.sources import Identity, MetricsSources

GIB = 1 << 30
GPUS = build_inventory("2xA100-80GB")
G0, G1 = (g.uuid for g in GPUS)
NOW_NS = 50_000_000_000
# what a namespace or pod name could never be, and a label value must still survive
ODD = 'we"ird\\pod\nname-ü'


class Node:
    def __init__(self, root: Path):
        self.root = root
        self.handles: dict[str, FileRegion] = {}
        self.identities: dict[str, Identity] = {}
        self.sources_of: dict[str, str] = {}
        self.instruments = AgentInstruments("node-a")

    def region(self, alloc_id: str, identity: Identity, devices: list[DeviceSpec],
               seq: int = 1) -> ShimWriter:
        ids = [f"{d.uuid}::{n}" for n, d in enumerate(devices)]
        directory = make_region(self.root, alloc_id, devices, ids, seq)
        self.handles[alloc_id] = FileRegion(directory)
        self.identities[alloc_id] = identity
        return ShimWriter(directory)

    def sources(self) -> MetricsSources:
        return MetricsSources(
            node="node-a",
            gpus=lambda: GPUS,
            slices_per_gpu=4,
            regions=lambda: list(self.handles.values()),
            identity=self.identities.get,
            policy_source=lambda alloc_id: self.sources_of.get(alloc_id, ""),
        )

    async def snapshot(self) -> Snapshot:
        cache = RegionCache(lambda: list(self.handles.values()))
        await cache.refresh()
        readings = {g.uuid: GpuSample(GpuReadings(GIB, 0.25, 40.0, 100.0), False) for g in GPUS}
        return take_snapshot(self.sources(), readings, cache.samples, now_ns=NOW_NS)

    def render(self, snap: Snapshot, sets: LabelSets | None, openmetrics: bool,
               hami: bool = False) -> str:
        encoder = om_latest if openmetrics else text_latest
        return render_exposition(snap, self.instruments, hami, encoder, openmetrics,
                                 sets).decode()

    def reference(self, snap: Snapshot, openmetrics: bool, hami: bool = False) -> str:
        """prometheus_client's own encoder over the same families."""
        encoder = om_latest if openmetrics else text_latest
        return encoder(ScrapeView(snap, self.instruments, hami)).decode()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def _parsed(text: str, openmetrics: bool) -> list[tuple[str, str, str, list[tuple]]]:
    out = []
    for family in (om_parse if openmetrics else text_parse)(text):
        samples = sorted(
            (s.name, tuple(sorted(s.labels.items())),
             "nan" if math.isnan(s.value) else float(s.value))
            for s in family.samples
            # the process's own figures move between two encodings of one scrape
            if not s.name.startswith(("process_", "python_gc_"))
        )
        out.append((family.name, family.type, family.documentation, samples))
    return out


def _assert_same_as_reference(node: Node, snap: Snapshot, sets: LabelSets,
                              hami: bool = False) -> str:
    for openmetrics in (False, True):
        ours = node.render(snap, sets, openmetrics, hami)
        assert _parsed(ours, openmetrics) == _parsed(
            node.reference(snap, openmetrics, hami), openmetrics)
    return node.render(snap, sets, False, hami)


def _busy(shim: ShimWriter, launches: int, memory: int, dev: int = 0) -> None:
    shim.process(0, 7, 4007, dev, memory=memory, launches=launches,
                 wait_ns=launches * 1_000_000, last_launch_ns=NOW_NS - 1_000_000_000)
    shim.device_totals(dev, memory=memory)


async def test_kept_sets_follow_values_labels_and_the_set_of_containers(node: Node) -> None:
    sets = LabelSets()
    a = node.region("a", ("team-a", ODD, "main"), [DeviceSpec(G0, 4 * GIB, 25)])
    b = node.region("b", ("team-b", "p", "c"), [DeviceSpec(G0, 2 * GIB, 25),
                                                DeviceSpec(G1, 2 * GIB, 25)], seq=2)
    node.region("c", ("team-c", "gone", "c"), [DeviceSpec(G1, GIB, 10)], seq=3)
    node.sources_of["a"] = "default"
    _busy(a, 10, GIB)
    _busy(b, 5, GIB, dev=1)
    text = _assert_same_as_reference(node, await node.snapshot(), sets, hami=True)
    assert value(text, "vgpu_container_kernel_launches_total", pod=ODD) == 10
    assert value(text, "vgpu_container_memory_limit_bytes", pod="gone") == GIB
    built = sets.built

    # the same containers again: nothing is escaped anew, the values still move
    _busy(a, 25, 3 * GIB)
    text = _assert_same_as_reference(node, await node.snapshot(), sets, hami=True)
    assert sets.built == built
    assert value(text, "vgpu_container_kernel_launches_total", pod=ODD) == 25
    assert value(text, "vgpu_container_memory_used_bytes", pod=ODD, kind="data") == 3 * GIB

    # b's pod is renamed (labels), c goes, d comes, a's policy becomes the pod's own
    node.identities["b"] = ("team-b", "p-renamed", "c")
    c_handle = node.handles.pop("c")
    node.region("d", ("team-d", "new", "c"), [DeviceSpec(G1, 8 * GIB, 50)], seq=4)
    node.sources_of["a"] = "pod"
    text = _assert_same_as_reference(node, await node.snapshot(), sets, hami=True)
    assert value(text, "vgpu_container_memory_limit_bytes", pod="p") is None
    assert [labels["gpu_uuid"] for labels, _ in
            series(text, "vgpu_container_memory_limit_bytes")
            if labels["pod"] == "p-renamed"] == [G0, G1]
    assert value(text, "vgpu_container_memory_limit_bytes", pod="gone") is None
    assert value(text, "vgpu_container_memory_limit_bytes", pod="new") == 8 * GIB
    assert value(text, "vgpu_container_core_policy_info", pod=ODD, policy_source="pod") == 1
    assert value(text, "vgpu_container_core_policy_info", pod=ODD,
                 policy_source="default") is None

    # more scrapes: the live containers' sets stay (nothing is escaped anew)...
    built = sets.built
    _assert_same_as_reference(node, await node.snapshot(), sets)
    assert sets.built == built
    # ...and the vanished container's were dropped: back, its five sets (its labels, and one
    # per memory kind) are escaped anew
    node.handles["c"] = c_handle
    text = _assert_same_as_reference(node, await node.snapshot(), sets)
    assert sets.built == built + 5
    assert value(text, "vgpu_container_memory_limit_bytes", pod="gone") == GIB


async def test_a_tenants_region_content_never_changes_anothers_series(node: Node) -> None:
    sets = LabelSets()
    hostile = node.region("h", ("evil", "h", "c"), [DeviceSpec(G0, GIB, 25)])
    victim = node.region("v", ("good", "v", "c"), [DeviceSpec(G0, 2 * GIB, 25)], seq=2)
    _busy(hostile, 3, GIB)
    _busy(victim, 9, GIB)

    def victims(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if 'namespace="good"' in line)

    clean = node.render(await node.snapshot(), sets, False)
    # the hostile container writes garbage: a wrecked header, then a label-like record
    hostile.scribble_header()
    scribbled = _assert_same_as_reference(node, await node.snapshot(), sets)
    assert victims(scribbled) == victims(clean)
    assert value(scribbled, "vgpu_container_kernel_launches_total", namespace="evil") is None
    assert value(scribbled, "vgpu_container_memory_limit_bytes", namespace="evil") == GIB
    assert value(scribbled, "vgpu_regions", state="corrupt") == 1
    (node.handles["h"].directory / "state").write_bytes(b'"}\nvgpu_x{pod="v"} 1\n' * 64)
    garbage = _assert_same_as_reference(node, await node.snapshot(), sets)
    assert victims(garbage) == victims(clean)
    # the victim's own counters still move with its own file
    _busy(victim, 11, GIB)
    moved = node.render(await node.snapshot(), sets, False)
    assert value(moved, "vgpu_container_kernel_launches_total", namespace="good") == 11


async def test_renders_in_two_threads_share_the_kept_sets_safely(node: Node) -> None:
    one = node.region("a", ("ns", "one", "c"), [DeviceSpec(G0, GIB, 25)])
    _busy(one, 4, GIB)
    first = await node.snapshot()
    node.region("b", ("ns", "two", "c"), [DeviceSpec(G1, GIB, 25)], seq=2)
    second = await node.snapshot()
    # the agent's own families only: the process figures after them move between renders
    expected = {id(snap): encode(build_families(snap), True) for snap in (first, second)}
    sets = LabelSets()
    wrong: list[str] = []

    def scrape(snap: Snapshot) -> None:
        for _ in range(40):
            sets.rotate()  # as each scrape does
            if encode(build_families(snap, labels=sets), True) != expected[id(snap)]:
                wrong.append(str(id(snap)))

    threads = [threading.Thread(target=scrape, args=(snap,)) for snap in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_label_set_escapes_once_and_is_shared() -> None:
    sets = LabelSets()
    names = ("namespace", "pod")
    first = sets.get(names, ("ns", ODD))
    assert first.text == '{namespace="ns",pod="we\\"ird\\\\pod\\nname-ü"}'
    assert dict(first) == {"namespace": "ns", "pod": ODD}
    assert sets.get(names, ("ns", ODD)) is first
    assert sets.built == 1
    sets.rotate()
    assert sets.get(names, ("ns", ODD)) is first  # kept from the scrape before
    sets.rotate()
    sets.rotate()  # two scrapes without it
    assert (names, ("ns", ODD)) not in sets
    assert sets.get(names, ("ns", ODD)) is not first
    assert Labels((), ()).text == ""
    with pytest.raises(ValueError):
        Labels(("a",), ())


def _random_container(rng: random.Random, serial: int) -> ContainerDevice:
    """A container device whose every labelled field is drawn from a few values, so that
    containers share some and differ in others."""
    gpu = rng.choice([*GPUS, None])
    return ContainerDevice(
        identity=(rng.choice(["ns", "other"]), rng.choice(["p", ODD]), rng.choice(["c", "d"])),
        alloc_id=f"a{serial}", dev=0, gpu=gpu,
        uuid=gpu.uuid if gpu is not None else rng.choice([G0, "GPU-elsewhere"]),
        memory_limit=rng.choice([GIB, 0]), core_limit=25.0, rate=1000, burst=2000,
        usage_known=rng.random() < 0.8, policy=rng.choice(["strict", "work-conserving", "off"]),
        memory_used=3 * GIB, memory_context=GIB // 4, memory_pool=rng.choice([0, GIB // 2]),
        launches=rng.randrange(100), priority=rng.randrange(3),
        policy_source=rng.choice(["", "pod", "default", "claim"]),
    )


@pytest.mark.parametrize("seed", range(6))
def test_kept_sets_render_what_fresh_ones_do_as_containers_change(seed: int) -> None:
    """Scrape after scrape, containers come, go and change any labelled field (identity, GPU,
    policy, its source): the exposition with the kept sets is the one with sets built afresh."""
    rng = random.Random(seed)
    base = Snapshot(
        node="node-a", gpus=tuple(GPUS), gpu_samples={}, healthy=None, xid_counts=None,
        slices_per_gpu=4, slices_allocated={}, containers=(), regions_by_state={},
        region_events={}, region_read_errors=0, nvml_errors={}, now_ns=NOW_NS,
    )
    kept = LabelSets()
    containers = [_random_container(rng, n) for n in range(8)]
    for _ in range(40):
        for n in range(len(containers)):
            if rng.random() < 0.3:  # a field or more changed, or another container
                containers[n] = _random_container(rng, n)
        shown = [c for c in containers if rng.random() < 0.85]  # some missing this scrape
        snap = dataclasses.replace(base, containers=tuple(shown))
        for hami in (False, True):
            kept.rotate()
            assert encode(build_families(snap, hami, kept), True) == \
                encode(build_families(snap, hami, LabelSets()), True)

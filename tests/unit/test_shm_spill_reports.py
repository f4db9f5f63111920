"""Spilled memory read from `state`, and each container that spills reported once."""

from pathlib import Path

from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.shm import layout
from vgpu_agent.shm.api import RegionUsage
from vgpu_agent.shm.spill import SpillReports

GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
WHO = ("ns", "pod", "main")


def usage(*spilled: int, corrupt: bool = False) -> RegionUsage:
    return RegionUsage(memory_used=tuple(spilled), memory_spilled=tuple(spilled), corrupt=corrupt)


def test_the_state_extension_carries_spilled_bytes(tmp_path: Path) -> None:
    directory = make_region(tmp_path, "a", [DeviceSpec(U0, 4 * GIB, 50)], [f"{U0}::0"])
    shim = ShimWriter(directory)
    shim.device_totals(0, memory=3 * GIB)
    shim.memory_kinds(0, context=GIB // 4, spilled=GIB)
    shim.close()
    read = layout.decode_state((directory / "state").read_bytes())
    assert read.memory_spilled == (GIB,)
    assert read.memory_data(0) == 3 * GIB - GIB // 4  # spilled bytes are data
    assert read.skipped_records == 0


def test_an_implausible_spilled_word_is_skipped_and_counted(tmp_path: Path) -> None:
    directory = make_region(tmp_path, "a", [DeviceSpec(U0, 4 * GIB, 50)], [f"{U0}::0"])
    shim = ShimWriter(directory)
    shim.memory_kinds(0, spilled=layout.PLAUSIBLE_BYTES + 1)
    shim.close()
    read = layout.decode_state((directory / "state").read_bytes())
    assert read.memory_spilled == (0,)
    assert read.skipped_records == 1


def test_a_1_0_state_has_nothing_spilled() -> None:
    data = layout.encode_state(1, abi_minor=0)
    assert layout.decode_state(data).memory_spilled == (0,)


def test_a_container_is_reported_once_with_the_devices_that_spilled() -> None:
    reports = SpillReports()
    notice = reports.observe("a", WHO, usage(0, GIB), (U0, U1), (4 * GIB, 4 * GIB))
    assert notice is not None and notice.container == WHO
    assert [(d.dev, d.gpu_uuid, d.spilled_bytes) for d in notice.devices] == [(1, U1, GIB)]
    assert reports.observe("a", WHO, usage(GIB, 2 * GIB), (U0, U1), (4 * GIB, 4 * GIB)) is None


def test_nothing_spilled_is_not_reported_and_stays_watched() -> None:
    reports = SpillReports()
    assert reports.observe("a", WHO, usage(0), (U0,), (GIB,)) is None
    assert reports.observe("a", WHO, usage(5), (U0,), (GIB,)) is not None


def test_an_unbound_region_waits_until_it_names_a_container() -> None:
    reports = SpillReports()
    assert reports.observe("a", None, usage(GIB), (U0,), (4 * GIB,)) is None
    assert len(reports) == 0
    assert reports.observe("a", WHO, usage(GIB), (U0,), (4 * GIB,)) is not None


def test_lies_from_the_container_are_not_reported() -> None:
    reports = SpillReports()
    # more than the limit: no shim writes that
    assert reports.observe("a", WHO, usage(5 * GIB), (U0,), (4 * GIB,)) is None
    # a corrupt file, or more devices than the region has
    assert reports.observe("b", WHO, usage(GIB, corrupt=True), (U0,), (4 * GIB,)) is None
    assert reports.observe("c", WHO, usage(0, GIB), (U0,), (4 * GIB,)) is None


def test_gone_regions_are_forgotten() -> None:
    reports = SpillReports()
    for alloc in ("a", "b"):
        reports.observe(alloc, WHO, usage(GIB), (U0,), (4 * GIB,))
    reports.forget(["b"])
    assert len(reports) == 1
    assert reports.observe("a", WHO, usage(GIB), (U0,), (4 * GIB,)) is not None

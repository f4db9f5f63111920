"""A `state` file read again unchanged is not decoded again by the Python read, and any change to
it is seen: the same bytes give the same usage, and the counts of corrupt reads and skipped
records go on as if every read were decoded. The C read (`usageread`) decodes every read, as
cheaply as the Python read compares: every test runs on both."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.shm import layout, regions, usageread
from vgpu_agent.shm.regions import Region, format_alloc_id

GIB = 1 << 30
UUID = "GPU-cccccccc-0000-0000-0000-000000000003"


@pytest.fixture(params=["c", "python"])
def opened(request, tmp_path: Path, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(regions, "usage_at", None)
    elif not usageread.NATIVE_USAGE:
        pytest.skip("the C read was not built")
    ids = [f"{UUID}::0"]
    alloc_id = format_alloc_id(1, ids, 7)
    make_region(tmp_path, alloc_id, [DeviceSpec(UUID, 4 * GIB, 50.0)], ids)
    region = Region.open(tmp_path / alloc_id)
    shim = ShimWriter(tmp_path / alloc_id)
    yield region, shim
    shim.close()
    region.close()


def test_unchanged_state_is_not_decoded_again_and_every_change_is_seen(opened):
    region, shim = opened
    shim.process(0, 10, 1010, 0, memory=GIB, launches=5, tokens=500)
    first = region.usage()
    again = region.usage()
    assert again == first
    if regions.usage_at is None:
        assert again is first  # the same bytes: the same (immutable) reading

    shim.process(0, 10, 1010, 0, memory=GIB, launches=6, tokens=500)  # one counter moves
    second = region.usage()
    assert second is not first and second.processes[0].launches == (6,)

    shim.process(1, 11, 1011, 0, tokens=7)  # a new slot: the high-water mark moves too
    third = region.usage()
    assert [p.pid for p in third.processes] == [10, 11]

    shim.process(1, 11, 1011, 0, tokens=0)  # and back: decoded again, not an old answer
    assert region.usage().processes[1].tokens_spent == (0,)


def test_an_unchanged_bad_file_is_counted_on_every_read(opened):
    region, shim = opened
    shim.process(0, 10, 1010, 0, tokens=layout.PLAUSIBLE_COUNTER + 1)  # a nonsense counter
    for expected in (1, 2, 3):
        usage = region.usage()
        assert usage.skipped_records == 1 and region.skipped_records == expected
    shim.scribble_header()
    for expected in (1, 2):
        assert region.usage().corrupt
        assert region.corrupt_reads == expected


def test_many_live_slots_are_decoded_on_every_read(opened):
    region, shim = opened
    for slot in range(20):  # far past what is kept between reads
        shim.process(slot, 100 + slot, 0, 0, tokens=slot)
    region.limit_slots(20)  # twenty processes proven on its GPU
    first = region.usage()
    again = region.usage()
    assert again == first and again is not first
    shim.process(19, 119, 0, 0, tokens=1_000)
    assert region.usage().processes[19].tokens_spent == (1_000,)

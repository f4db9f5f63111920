"""The metrics' read of a whole `state` (`usageread`, `Region._read_usage`): the C read and the
Python read give the same usage on the same file, whatever the container left there, fail the
same way on descriptors that cannot be read, and the C read is clean under AddressSanitizer and
UBSan (it runs inside the agent's process)."""

from __future__ import annotations

import os
import random
import shutil
import textwrap
import types
from pathlib import Path

import pytest

from tests import sanitized
from tests.fakes.hostilestate import extension_of, scribbled_state
from tests.fakes.shimstate import DeviceSpec, make_region
from vgpu_agent.shm import layout, usageread
from vgpu_agent.shm.regions import Region, format_alloc_id

SOURCE = sanitized.REPO / "vgpu_agent" / "shm" / "_usagec.c"
GIB = 1 << 30
UUID = "GPU-dddddddd-0000-0000-0000-000000000004"

needs_c = pytest.mark.skipif(not usageread.NATIVE_USAGE, reason="the C read was not built")


def test_the_c_usage_read_was_built():
    assert usageread.NATIVE_USAGE, (
        f"vgpu_agent/shm/_usagec.c was not used: {usageread.NOT_NATIVE_USAGE_REASON}")
    assert usageread.usage_at is not None


def open_region(root: Path, devices: int) -> Region:
    ids = [f"{UUID}::{n}" for n in range(devices)]
    alloc_id = format_alloc_id(1, ids, 7)
    make_region(root, alloc_id, [DeviceSpec(UUID, 4 * GIB, 10.0)] * devices, ids)
    return Region.open(root / alloc_id)


def overwrite(region: Region, data: bytes) -> None:
    """The container rewrites its `state` in place (the agent's descriptor stays on it)."""
    with open(region.path / "state", "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def both_reads(region: Region) -> tuple[object, object]:
    region._last_read = None  # the Python read's cache of the last bytes: decode these
    return region._read_usage(), region._read_usage_in_python()


@needs_c
def test_the_c_decoder_agrees_with_the_python_decoder_on_scribbled_bytes():
    rng = random.Random(11)
    decode = usageread._usagec.decode_state
    kinds = {"processes": 0, "skipped": 0, "corrupt": 0, "extension": 0}
    for _ in range(4000):
        count = rng.randint(1, 4)
        data = scribbled_state(rng, count=count)
        asked = rng.choice((count,) * 6 + (None, count + 1, -1, 1 << 70))
        slots_read = rng.choice((None, None, 0, 1, 3, layout.MAX_PROCS))
        extension = rng.choice((None, None, extension_of(data), b"\x01" * 40, b""))
        want = layout.decode_state(data, asked, slots_read=slots_read, extension=extension)
        assert usageread.usage_of(decode(data, asked, slots_read, extension)) == want
        kinds["processes"] += bool(want.processes)
        kinds["skipped"] += want.skipped_records > 0
        kinds["corrupt"] += want.corrupt
        kinds["extension"] += any(want.memory_context)
    # the scribbles reached every outcome, not only refusals
    assert all(n > 150 for n in kinds.values()), kinds


@needs_c
def test_the_c_decoder_refuses_what_the_python_decoder_refuses():
    data = layout.encode_state(1)
    for slots_read in (-1, layout.MAX_PROCS + 1, 1 << 70):
        with pytest.raises(ValueError, match="slots_read"):
            layout.decode_state(data, 1, slots_read=slots_read)
        with pytest.raises(ValueError, match=f"slots_read={slots_read} is not allowed"):
            usageread._usagec.decode_state(data, 1, slots_read, None)
    with pytest.raises(TypeError):
        usageread._usagec.decode_state("not bytes", 1, None, None)


@needs_c
def test_a_sum_of_slots_past_64_bits_stands_in_for_a_nonsense_total(tmp_path):
    # five processes each near the plausible bound, the header's total nonsense: the slots'
    # sum stands in, exactly, though it does not fit a machine word
    region = open_region(tmp_path, 1)
    try:
        buf = bytearray((region.path / "state").read_bytes())
        layout.store_u64(buf, layout.STATE_OFFSETS["slot_high_water"], 5)
        for slot in range(5):
            base = layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
            layout.store_u64(buf, base + layout.SLOT_OFFSETS["pid"], 10 + slot)
            layout.store_u64(buf, base + layout.SLOT_OFFSETS["devices"]
                             + layout.PROC_DEVICE_OFFSETS["tokens_spent"],
                             layout.PLAUSIBLE_COUNTER)
        layout.store_u64(buf, layout.STATE_OFFSETS["devices"]
                         + layout.STATE_DEVICE_OFFSETS["tokens_spent"], (1 << 64) - 1)
        overwrite(region, bytes(buf))
        region.limit_slots(5)
        c_read, python_read = both_reads(region)
        assert c_read == python_read
        assert c_read.tokens_spent == (5 * layout.PLAUSIBLE_COUNTER,)  # type: ignore[attr-defined]
        assert c_read.skipped_records == 1  # type: ignore[attr-defined]
    finally:
        region.close()


@needs_c
def test_a_region_reads_the_same_usage_both_ways_whatever_its_file_holds(tmp_path):
    rng = random.Random(12)
    regions = {n: open_region(tmp_path / str(n), n) for n in (1, 2, 3)}
    try:
        seen = 0
        for _ in range(600):
            count = rng.choice((1, 2, 3))
            region = regions[count]
            region.limit_slots(rng.choice((0, 1, 4, 40)))  # the slots its budget reads
            mine = rng.random() < 0.85  # mostly a file of its own device count
            overwrite(region, scribbled_state(rng, max_devices=3,
                                              count=count if mine else None))
            c_read, python_read = both_reads(region)
            assert c_read == python_read
            seen += bool(python_read.processes)  # type: ignore[attr-defined]
        assert seen > 100
    finally:
        for region in regions.values():
            region.close()


@needs_c
def test_descriptors_that_cannot_be_read_fail_as_in_python(tmp_path):
    state = tmp_path / "state"
    state.write_bytes(layout.encode_state(1))
    directory = os.open(tmp_path, os.O_RDONLY)
    writer = os.open(state, os.O_WRONLY)
    closed = os.open(state, os.O_RDONLY)
    os.close(closed)
    try:
        for fd in (directory, writer, closed, -1):
            with pytest.raises(OSError) as c_error:
                usageread._usagec.usage_at(fd, 1, 2)
            with pytest.raises(OSError) as python_error:
                os.preadv(fd, [bytearray(layout.STATE_HEADER_SIZE)], 0)
            assert c_error.value.errno == python_error.value.errno
    finally:
        os.close(directory)
        os.close(writer)
    reader = os.open(state, os.O_RDONLY)
    try:
        for budget in (-1, layout.MAX_PROCS + 1):
            with pytest.raises(ValueError, match=f"slot_budget={budget} is not allowed"):
                usageread._usagec.usage_at(reader, 1, budget)
    finally:
        os.close(reader)


@needs_c
def test_a_region_whose_read_fails_reads_corrupt_and_says_so(tmp_path, capsys):
    region = open_region(tmp_path, 1)
    try:
        os.close(region._state_fd)  # type: ignore[arg-type]
        region._state_fd = os.open(tmp_path, os.O_RDONLY)  # EISDIR on every read
        usage = region.usage()
        assert usage.corrupt and region.corrupt_reads == 1
        assert "region_state_read_failed" in capsys.readouterr().out
    finally:
        region.close()


def fresh_usagec():  # type: ignore[no-untyped-def]
    return sanitized.fresh_copy(usageread._usagec)


def test_layouts_the_c_read_cannot_hold_are_not_used_and_say_why(monkeypatch):
    # a layout grown past what the built read holds (a newer ABI, an old build): the agent reads
    # in Python and says why, rather than failing to start
    module = fresh_usagec()
    for name, value, says in (("STATE_HEADER_SIZE", 8192, "header 8192 bytes"),
                              ("STATE_EXT_DEVICE_SIZE", 4096, "extension records of 4096")):
        monkeypatch.setattr(layout, name, value)
        if name == "STATE_HEADER_SIZE":  # the slots follow the header
            monkeypatch.setitem(layout.STATE_OFFSETS, "slots", value)
        reason = usageread.bind(module)
        assert reason is not None and reason.startswith(
            "vgpu_agent.shm._usagec was built for another state layout: ")
        assert says in reason, reason
        monkeypatch.undo()
    monkeypatch.setattr(layout, "PLAUSIBLE_BYTES", 1 << 60)  # 1,024 slots of it pass 64 bits
    assert "summed within 64 bits" in str(usageread.bind(module))
    monkeypatch.undo()
    monkeypatch.setitem(layout.PROC_DEVICE_OFFSETS, "last_launch_ns", 36)
    reason = usageread.bind(module)
    assert reason is not None and "process offset 36 not an aligned field" in reason
    monkeypatch.undo()
    monkeypatch.setitem(layout.STATE_OFFSETS, "slots", layout.STATE_HEADER_SIZE + 8)
    assert "it reads the slots right after the header" in str(usageread.bind(module))
    monkeypatch.undo()
    # each refusal kept the layout in force (the module is the process's one copy)
    assert usageread.usage_of(module.decode_state(layout.encode_state(1), 1, None, None)) == \
        layout.decode_state(layout.encode_state(1), 1)
    assert usageread.bind(module) is None  # the layout this tree has, it holds
    # a build whose bind takes other arguments is refused the same way, not raised at import
    reason = usageread.bind(types.SimpleNamespace(bind=lambda magic, major: None))
    assert reason is not None and "argument" in reason


CHILD = textwrap.dedent("""
    import os, random
    module = load("vgpu_agent.shm._usagec", sys.argv[1])
    for call in (lambda: module.decode_state(bytes(2000), 1, None, None),
                 lambda: module.usage_at(0, 1, 2)):
        try:
            call()
            raise AssertionError("decoded before bind")
        except RuntimeError as error:
            assert "bind() was not called" in str(error)
    from tests.fakes.hostilestate import extension_of, scribbled_state
    from vgpu_agent.shm import layout, usageread
    assert usageread._usagec is module
    rng = random.Random(7)
    path = sys.argv[2]
    whole = 0
    for trial in range(2500):
        data = scribbled_state(rng, max_devices=layout.MAX_DEVICES, max_slots=8)
        asked = rng.choice([None, 1, 2, layout.MAX_DEVICES, layout.MAX_DEVICES + 1])
        slots_read = rng.choice([None, 0, 2, 8, layout.MAX_PROCS])
        extension = rng.choice([None, extension_of(data), b"\\x02" * 24])
        want = layout.decode_state(data, asked, slots_read=slots_read, extension=extension)
        got = usageread.usage_of(module.decode_state(data, asked, slots_read, extension))
        assert got == want, trial
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            count = rng.randint(1, layout.MAX_DEVICES)
            usageread.usage_of(module.usage_at(fd, count, rng.choice([0, 1, 8, layout.MAX_PROCS])))
        finally:
            os.close(fd)
        whole += not want.corrupt
    print("whole", whole)
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_c_usage_read_is_clean_under_asan_and_ubsan(tmp_path):
    built = sanitized.build(SOURCE, tmp_path)
    out = sanitized.run(CHILD, str(built), str(tmp_path / "state"), cwd=tmp_path)
    assert int(out.split()[1]) > 300, out  # whole files decoded, not only refusals

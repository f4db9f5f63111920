"""The lean read of a `state` header from its file (`headerread.counters_at`, and in batches with
the rates in force, `readings_many`): the C read and the Python read give the same answer on the
same file, whatever the container left there, and the C read is clean under AddressSanitizer and
UBSan (it runs inside the agent's process)."""

from __future__ import annotations

import importlib
import os
import shutil
import struct
import textwrap
import time
import types
from pathlib import Path

import pytest

from tests import sanitized
from vgpu_agent.shm import headerread, layout

SOURCE = sanitized.REPO / "vgpu_agent" / "shm" / "_statec.c"
READS = [pytest.param(headerread.python_counters_at, id="python")]
# (rate, burst) words 1 and 2 of each device's 4: words enough for every device count
WORDS = (1, 2, 4)


def control_words(devices: int) -> memoryview:
    """A stand-in for a region's `control` words: device d's rate 100 + d, burst 200 + d."""
    words = memoryview(bytearray(8 * 4 * max(devices, 1))).cast("Q")
    for dev in range(devices):
        words[4 * dev + 1], words[4 * dev + 2] = 100 + dev, 200 + dev
    return words


def read_in_batch(fd: int, count: int) -> tuple[int, ...] | None:
    """The same read, one of a batch (`readings_many`). A batch is never asked for a device
    count no region can have: it refuses one by name."""
    if not 1 <= count <= layout.MAX_DEVICES:
        with pytest.raises(ValueError, match=f"{count} devices"):
            headerread._statec.readings_many([fd], [(control_words(count), ("strict",) * count,
                                                     0)], WORDS)
        return None
    reading = headerread._statec.readings_many(
        [fd], [(control_words(count), ("strict",) * count, 0)], WORDS)[0]
    assert reading[1] == tuple(v for dev in range(count) for v in (100 + dev, 200 + dev))
    return reading[0]


if headerread._statec is not None:
    READS.append(pytest.param(headerread._statec.counters_at, id="c"))
    READS.append(pytest.param(read_in_batch, id="c-many"))


def test_the_c_read_was_built():
    assert headerread.NATIVE_READ, "vgpu_agent/shm/_statec.c was not built: is a C compiler there?"
    assert headerread.counters_at is headerread._statec.counters_at


def state_file(path: Path, device_count: int, totals: list[int], size: int | None = None) -> int:
    buf = bytearray(layout.encode_state(device_count))
    for dev in range(device_count):
        base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for n, name in enumerate(("tokens_spent", "launches", "wait_ns")):
            struct.pack_into("<Q", buf, base + layout.STATE_DEVICE_OFFSETS[name],
                             totals[3 * dev + n])
    path.write_bytes(bytes(buf[: len(buf) if size is None else size]))
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("read", READS)
def test_a_state_file_is_read_from_its_start(tmp_path, read):
    fd = state_file(tmp_path / "state", 2, [1, 2, 3, 4, 5, 6])
    try:
        os.lseek(fd, 4096, os.SEEK_SET)  # where the descriptor points does not matter
        assert read(fd, 2) == (1, 2, 3, 4, 5, 6)
        assert read(fd, 1) is None  # another device count
    finally:
        os.close(fd)


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("size", [0, 1, layout.STATE_HEADER_SIZE - 1])
def test_a_file_cut_short_is_unreadable(tmp_path, read, size):
    fd = state_file(tmp_path / "state", 1, [7, 8, 9], size=size)
    try:
        assert read(fd, 1) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("read", READS)
def test_a_header_alone_is_enough(tmp_path, read):
    fd = state_file(tmp_path / "state", 1, [7, 8, 9], size=layout.STATE_HEADER_SIZE)
    try:
        assert read(fd, 1) == (7, 8, 9)
    finally:
        os.close(fd)


@pytest.mark.parametrize("read", READS)
def test_descriptors_that_read_nothing_are_unreadable_not_errors(tmp_path, read):
    fd = state_file(tmp_path / "state", 1, [7, 8, 9])
    os.close(fd)
    assert read(fd, 1) is None  # closed
    assert read(-1, 1) is None
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        assert read(directory, 1) is None  # EISDIR
    finally:
        os.close(directory)
    writer = os.open(tmp_path / "state", os.O_WRONLY)
    try:
        assert read(writer, 1) is None  # EBADF: not open for reading
    finally:
        os.close(writer)


@pytest.mark.parametrize("read", READS)
def test_implausible_totals_are_unreadable(tmp_path, read):
    fd = state_file(tmp_path / "state", 1, [1, layout.PLAUSIBLE_COUNTER + 1, 0])
    try:
        assert read(fd, 1) is None
    finally:
        os.close(fd)


def test_a_batch_reads_each_descriptor_between_its_two_stamps(tmp_path):
    if headerread._statec is None:
        pytest.skip("the C read was not built")
    many_fn = headerread._statec.readings_many
    fds = [state_file(tmp_path / f"state{n}", n % 2 + 1, list(range(3 * (n % 2 + 1))))
           for n in range(5)]
    controls = [(control_words(n % 2 + 1), ("strict",) * (n % 2 + 1), n) for n in range(5)]
    try:
        before = time.monotonic_ns()
        many = many_fn(fds, controls, WORDS)
        after = time.monotonic_ns()
        assert [m[0] for m in many] == [(0, 1, 2), (0, 1, 2, 3, 4, 5)] * 2 + [(0, 1, 2)]
        assert [m[1] for m in many] == [(100, 200), (100, 200, 101, 201)] * 2 + [(100, 200)]
        assert [m[2:4] for m in many] == [(c[1], c[2]) for c in controls]
        assert all(m[2] is c[1] for m, c in zip(many, controls, strict=True))  # shared
        # the stamps are time.monotonic_ns's clock, in the order of the reads
        stamps = [stamp for m in many for stamp in m[4:]]
        assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
        assert many_fn([], [], WORDS) == []
        with pytest.raises(ValueError, match="2 descriptors but 1 controls"):
            many_fn(fds[:2], controls[:1], WORDS)
        with pytest.raises(ValueError, match=f"{2**40} is no file descriptor"):
            many_fn([2**40], controls[:1], WORDS)
        with pytest.raises(TypeError):
            many_fn(["3"], controls[:1], WORDS)
        with pytest.raises(TypeError):
            many_fn(tuple(fds), controls, WORDS)
        with pytest.raises(TypeError, match="must be \\(words, policies, priority\\)"):
            many_fn(fds[:1], [(control_words(1), ["strict"], 0)], WORDS)
        with pytest.raises(ValueError, match="0 devices"):
            many_fn(fds[:1], [(control_words(1), (), 0)], WORDS)
        with pytest.raises(ValueError, match="words per device >= 1"):
            many_fn(fds[:1], controls[:1], (1, 2, 0))
        # words too few for the devices, or not 64-bit words: refused by name, nothing read
        with pytest.raises(ValueError, match="needs contiguous 64-bit words up to word 6"):
            many_fn(fds[:1], [(control_words(1), ("strict",) * 2, 0)], WORDS)
        with pytest.raises(ValueError, match="format B"):
            many_fn(fds[:1], [(memoryview(bytearray(64)), ("strict",), 0)], WORDS)
        released = control_words(1)
        released.release()
        with pytest.raises(ValueError):
            many_fn(fds[:1], [(released, ("strict",), 0)], WORDS)
    finally:
        for fd in fds:
            os.close(fd)


def fresh_statec():  # type: ignore[no-untyped-def]
    return sanitized.fresh_copy(headerread._statec)


def test_layouts_the_c_read_cannot_hold_are_refused_by_name():
    module = fresh_statec()
    with pytest.raises(ValueError, match="header 8192 bytes"):
        module.bind(1, 1, (0, 8, 16, 20, 24), 8192, 64, 64, 24, 1 << 62, 16)
    with pytest.raises(ValueError, match="prefix fields before it"):
        module.bind(1, 1, (0, 8, 16, 20, 60), 1088, 64, 64, 24, 1 << 62, 16)
    with pytest.raises(ValueError, match="devices"):
        module.bind(1, 1, (0, 8, 16, 20, 24), 1088, 64, 64, 48, 1 << 62, 16)


def test_a_c_read_built_for_smaller_headers_is_not_used_and_says_why(monkeypatch):
    # a layout grown past what the built read holds (a newer ABI, an old build): the agent reads
    # in Python and logs this reason, rather than failing to start
    module = fresh_statec()
    monkeypatch.setattr(layout, "STATE_HEADER_SIZE", 8192)
    reason = headerread.bind(module)
    assert reason is not None
    assert reason.startswith("vgpu_agent.shm._statec was built for another state layout: ")
    assert "header 8192 bytes" in reason
    monkeypatch.undo()
    assert headerread.bind(module) is None  # the layout this tree has, it holds
    # a build whose bind takes other arguments is refused the same way, not raised at import
    older = types.SimpleNamespace(bind=lambda magic, major: None)
    reason = headerread.bind(older)
    assert reason is not None and "argument" in reason


def test_a_c_read_built_before_its_batch_read_reads_one_region_a_call_and_says_why(
        monkeypatch):
    import sys

    import vgpu_agent.shm as shm

    # an in-place build older than the tree: the header read in C, no `readings_many`
    older = types.SimpleNamespace(bind=lambda *numbers: None,
                                  counters_at=headerread.python_counters_at)
    monkeypatch.setattr(shm, "_statec", older, raising=False)
    monkeypatch.setitem(sys.modules, "vgpu_agent.shm._statec", older)
    stale = importlib.reload(headerread)
    try:
        assert stale.NATIVE_READ and stale.readings_many is None
        assert stale.NOT_NATIVE_READ_REASON is None
        assert stale.NOT_BATCH_READ_REASON is not None
        assert "built before it had readings_many" in stale.NOT_BATCH_READ_REASON
    finally:
        monkeypatch.undo()
        importlib.reload(headerread)
    assert headerread.readings_many is not None and headerread.NOT_BATCH_READ_REASON is None


CHILD = textwrap.dedent("""
    import os, random, struct
    module = load("vgpu_agent.shm._statec", sys.argv[1])
    from vgpu_agent.shm import headerread, layout
    assert headerread._statec is module
    rng = random.Random(5)
    agreed = 0
    path = sys.argv[2]
    for trial in range(3000):
        count = rng.randint(1, layout.MAX_DEVICES)
        buf = bytearray(layout.encode_state(count)[: layout.STATE_HEADER_SIZE])
        for _ in range(rng.randint(0, 6)):  # what a container might scribble
            at = rng.randrange(len(buf))
            buf[at] = rng.randrange(256)
        for dev in range(count):
            base = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
            for n in range(3):
                value = rng.randrange(1 << 40) if rng.random() < 0.97 else rng.choice(
                    [layout.PLAUSIBLE_COUNTER, layout.PLAUSIBLE_COUNTER + 1, 2**64 - 1])
                struct.pack_into("<Q", buf, base + layout.STATE_DEVICE_OFFSETS["tokens_spent"]
                                 + 8 * n, value)
        data = bytes(buf[: len(buf) - rng.choice([0, 0, 0, 1, 500, len(buf)])])
        asked = rng.choice([count, count, count + 1, 0, layout.MAX_DEVICES + 1])
        want = layout.state_counters(data, asked)
        assert module.decode(data, asked) == want
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert module.counters_at(fd, asked) == want
            if 1 <= asked <= layout.MAX_DEVICES:
                words = memoryview(bytearray(8 * 4 * asked)).cast("Q")
                words[4 * (asked - 1) + 2] = 2**64 - 1
                controls = [(words, ("strict",) * asked, 0),
                            (words, ("strict",) * count, 1), (words, ("off",), 2)]
                many = module.readings_many([fd, fd, 10**6], controls, (1, 2, 4))
                assert many[0][0] == want and many[2][0] is None  # (no such descriptor)
                assert many[0][1][-1] == 2**64 - 1 and many[2][2:4] == (("off",), 2)
                assert many[0][4] <= many[0][5] <= many[1][4]
        finally:
            os.close(fd)
        agreed += want is not None

    # `readings_of`: the regions' loop, over stand-ins with a region's fields, every branch
    import threading

    class Stand:
        def __init__(self, fd, count, policed, finds=True):
            self._view, self._fd_lock, self._policed_ns = object(), threading.Lock(), policed
            self._state_fd, self._finds = fd, finds
            self._words = memoryview(bytearray(8 * 4 * count)).cast("Q")
            self._in_force = (("strict",) * count, 0)

        def _checks_find_nothing(self, now_ns):
            if self._finds is None:
                raise OSError("checks")
            return self._finds

    good = bytes(layout.encode_state(2)[: layout.STATE_HEADER_SIZE])
    bad = bytes(len(good))
    for name, data in (("good", good), ("bad", bad)):
        with open(path + name, "wb") as f:
            f.write(data)
    fds = [os.open(path + name, os.O_RDONLY) for name in ("good", "bad")]
    try:
        for trial in range(300):
            now = 10**12
            stands = []
            for _ in range(rng.randint(0, 12)):
                kind = rng.randrange(8)
                one = Stand(fds[kind % 2], 2, now - rng.choice([0, 10**9]),
                            rng.choice([True, False]))
                if kind == 2:
                    one._view = None
                elif kind == 3:
                    one._fd_lock.acquire()
                elif kind == 4:
                    one._state_fd = None
                elif kind == 5:
                    one._in_force = ("strict", 0)  # not a tuple of policies: refused
                elif kind == 6:
                    one._finds = None  # its checks raise
                stands.append(rng.choice([one, one, "not a region"]))
            held_before = [one for one in stands
                           if isinstance(one, Stand) and one._fd_lock.locked()]
            try:
                read, corrupt = module.readings_of(stands, Stand, now, 5 * 10**8, (1, 2, 4))
                assert len(read) == len(stands)
                assert all(read[i][0] is None for i in corrupt)
            except (OSError, TypeError):
                pass
            for one in stands:  # every lock it took given back, error or not
                if isinstance(one, Stand):
                    assert one._fd_lock.locked() == (one in held_before)
    finally:
        for fd in fds:
            os.close(fd)
    print("agreed", agreed)
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_c_read_is_clean_under_asan_and_ubsan(tmp_path):
    built = sanitized.build(SOURCE, tmp_path)
    out = sanitized.run(CHILD, str(built), str(tmp_path / "state"), cwd=tmp_path)
    assert int(out.split()[1]) > 300, out  # whole headers read, not only refusals

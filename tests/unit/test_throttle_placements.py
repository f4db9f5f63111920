"""Placements kept between the periods a time-sliced GPU gives each process
(`throttle/placements.py`), and a pid's start time read from the host's /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.hostproc import FakeHostProc
from vgpu_agent.throttle.identity import NamespacePidResolver
from vgpu_agent.throttle.placements import HeldPlacements

GPU, OTHER = "GPU-a", "GPU-b"
S = 1_000_000  # us


class Starts:
    """Start times by pid, as the host would read them (None: unreadable), and the reads."""

    def __init__(self, **starts: int | None) -> None:
        self.starts = {int(pid[1:]): start for pid, start in starts.items()}
        self.reads = 0

    def __call__(self, pid: int) -> int | None:
        self.reads += 1
        return self.starts.get(pid)


def test_a_placement_is_given_back_to_the_same_process_named_again_within_the_hold():
    starts = Starts(p7=100)
    held = HeldPlacements(starts, hold_s=10)
    held.keep(GPU, 7, "a", 0)
    assert held.take(GPU, 7, 9 * S) == "a"
    assert held.take(GPU, 7, 18 * S) == "a"  # each time named, the hold starts over
    assert held.take(OTHER, 7, 18 * S) is None  # per GPU
    assert starts.reads == 3  # at keep, and afresh at each take


def test_a_reused_pid_is_another_process_and_is_not_given_the_placement():
    starts = Starts(p7=100)
    held = HeldPlacements(starts, hold_s=10)
    held.keep(GPU, 7, "a", 0)
    starts.starts[7] = 250  # the process ended, the kernel gave its pid to another
    assert held.take(GPU, 7, S) is None
    starts.starts[7] = 100
    assert held.take(GPU, 7, 2 * S) is None  # dropped: placed afresh on host evidence


def test_a_process_gone_or_unreadable_is_not_kept():
    starts = Starts(p7=None, p8=100)
    held = HeldPlacements(starts, hold_s=10)
    held.keep(GPU, 7, "a", 0)
    assert held.take(GPU, 7, S) is None
    held.keep(GPU, 8, "a", 0)
    del starts.starts[8]  # ended
    assert held.take(GPU, 8, S) is None


def test_the_hold_ends_a_placement_not_named_again_in_time():
    held = HeldPlacements(Starts(p7=100, p8=100), hold_s=10)
    held.keep(GPU, 7, "a", 0)
    held.keep(GPU, 8, "a", 0)
    held.named(GPU, 8, 6 * S)  # named while placed lately: its hold starts over too
    assert held.take(GPU, 7, 10 * S + 1) is None
    assert held.take(GPU, 8, 10 * S + 1) == "a"


def test_prune_drops_expired_placements_and_containers_gone():
    held = HeldPlacements(Starts(p1=1, p2=1, p3=1), hold_s=10)
    held.keep(GPU, 1, "a", 0)
    held.keep(GPU, 2, "b", 5 * S)
    held.keep(GPU, 3, "c", 5 * S)
    held.prune(GPU, 12 * S, {"a", "b"})
    assert held.held[GPU] == {2: ("b", 1, 5 * S)}
    held.forget(GPU)
    assert held.take(GPU, 2, 12 * S) is None


def test_a_gpu_naming_more_processes_than_kept_starts_over():
    starts = Starts(**{f"p{n}": 1 for n in range(10)})
    held = HeldPlacements(starts, hold_s=10, most=4)
    for pid in range(5):
        held.keep(GPU, pid, "a", 0)
    assert list(held.held[GPU]) == [4]  # bounded whatever the samples name


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hold_s": 0}, r"hold must be in \(0, 3600\] s, got 0"),
    ({"hold_s": float("nan")}, "got nan"),
    ({"most": 0}, "must be an int >= 1, got 0"),
    ({"most": 2.5}, "got 2.5"),
])
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeldPlacements(Starts(), **kwargs)


def test_start_time_is_field_22_read_afresh_whatever_the_command_name(tmp_path: Path):
    host = FakeHostProc(tmp_path / "proc")
    host.process(41, start=777, comm="evil ) 1 2 3 (name")
    resolver = NamespacePidResolver(host.path)
    assert resolver.start_time(41) == 777
    host.end(41)
    host.process(41, start=901)
    assert resolver.start_time(41) == 901  # not cached: a reused pid shows at once
    assert resolver.start_time(42) is None  # no such process
    assert resolver.start_time(0) is None and resolver.start_time(-3) is None
    (tmp_path / "proc" / "41" / "stat").write_text("41 (truncated")
    assert resolver.start_time(41) is None
    (tmp_path / "proc" / "41" / "stat").write_bytes(b"\xff\xfe garbage")
    assert resolver.start_time(41) is None


@pytest.mark.parametrize("comm", [b"\xff\xfe)", b"x\nNSpid:\t1 2", b"\x80 ) 9 (", b"\\\t\xc3("])
def test_a_command_name_of_any_bytes_leaves_the_process_known(tmp_path: Path, comm: bytes):
    """A container sets its processes' names to whatever bytes it likes: the start time (which
    keeps a placement held on a time-sliced GPU) and the identity (which refutes claims) are
    read whatever they are, and a name cannot pass for another field."""
    host = FakeHostProc(tmp_path / "proc")
    host.process(41, inner_pid=7, start=777, comm=comm)
    resolver = NamespacePidResolver(host.path)
    assert resolver.start_time(41) == 777
    assert resolver.identity(41) == (7, 777)

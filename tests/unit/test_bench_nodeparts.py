"""`bench_node.py --by-part`'s split of the agent's CPU: its tasks and NVML's calls from its own
exposition, its threads from /proc, each window's difference in % of a core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bench import nodeparts

BODY = """\
# HELP vgpu_task_cpu_seconds_total CPU of the event loop's thread in each task.
# TYPE vgpu_task_cpu_seconds_total counter
vgpu_task_cpu_seconds_total{node="n1",task="throttle"} 12.5
vgpu_task_cpu_seconds_total{node="n1",task="backstop"} 0.25
# HELP vgpu_task_cpu_seconds_created When the series began.
# TYPE vgpu_task_cpu_seconds_created gauge
vgpu_task_cpu_seconds_created{node="n1",task="throttle"} 1.7e9
# HELP vgpu_gpu_nvml_process_utilization_call_seconds_total Seconds NVML's calls took.
# TYPE vgpu_gpu_nvml_process_utilization_call_seconds_total counter
vgpu_gpu_nvml_process_utilization_call_seconds_total{uuid="GPU-a"} 1.5
vgpu_gpu_nvml_process_utilization_call_seconds_total{uuid="GPU-b"} 2.0
# HELP vgpu_throttle_ticks_total Ticks.
# TYPE vgpu_throttle_ticks_total counter
vgpu_throttle_ticks_total 400.0
# HELP vgpu_gpu_nvml_process_utilization_calls_total NVML's calls.
# TYPE vgpu_gpu_nvml_process_utilization_calls_total counter
vgpu_gpu_nvml_process_utilization_calls_total{uuid="GPU-a"} 30.0
vgpu_gpu_nvml_process_utilization_calls_total{uuid="GPU-b"} 12.0
"""


def _stat(pid: int, name: str, utime: int, stime: int) -> str:
    # the command may hold spaces and parens: the fields are counted after the last paren
    return f"{pid} ({name} (x)) S 1 1 1 0 -1 4194560 1 0 0 0 {utime} {stime} 0 0 20 0 1 0\n"


def _proc(root: Path, pid: int, threads: dict[int, tuple[str, int]]) -> Path:
    """A /proc holding `pid` with `threads` (tid -> (name, clock ticks of CPU, all user))."""
    for tid, (name, ticks) in threads.items():
        task = root / str(pid) / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "stat").write_text(_stat(tid, name, ticks, 0))
        (task / "comm").write_text(name + "\n")
    total = sum(ticks for _, ticks in threads.values())
    (root / str(pid) / "stat").write_text(_stat(pid, "python3", total, 0))
    return root


def test_tasks_and_nvml_calls_come_from_the_exposition() -> None:
    assert nodeparts.from_metrics(BODY) == {
        "task:throttle": 12.5, "task:backstop": 0.25, "nvml calls": 3.5,
        "per s:throttle ticks": 400.0, "per s:nvml calls": 42.0}


def test_an_agent_without_the_families_gives_no_parts_not_zeros() -> None:
    older = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.0\n"
    assert nodeparts.from_metrics(older) == {}


def test_threads_by_tid_the_loop_named_and_the_process_total(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    proc = _proc(tmp_path, 100, {100: ("python3", 3 * tick), 101: ("python3", tick),
                                 102: ("event_engine", tick // 2)})
    got = nodeparts.from_threads(100, proc)
    assert got == pytest.approx({"thread:event loop#100": 3.0, "thread:python3#101": 1.0,
                                 "thread:event_engine#102": (tick // 2) / tick,
                                 "agent": (4 * tick + tick // 2) / tick})


def test_a_thread_gone_between_the_listing_and_its_read_is_skipped(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 100, {100: ("python3", 5), 101: ("python3", 5)})
    (proc / "100" / "task" / "101" / "stat").unlink()  # ended meanwhile
    assert set(nodeparts.from_threads(100, proc)) == {"thread:event loop#100", "agent"}


def test_shares_are_per_cent_of_a_core_threads_summed_by_name() -> None:
    before = {"agent": 10.0, "task:throttle": 4.0, "thread:python3#101": 1.0,
              "thread:python3#102": 2.0, "thread:python3#103": 9.0, "nvml calls": 1.0}
    after = {"agent": 12.0, "task:throttle": 5.0, "thread:python3#101": 1.5,
             "thread:python3#102": 2.5,  # 103 ended within the window: not counted
             "thread:python3#104": 0.2,  # started within it: counted from 0
             "task:health": 0.1,  # read at the end only: not a part of this window
             "nvml calls": 1.4}
    assert nodeparts.shares(before, after, 20.0) == pytest.approx(
        {"agent": 10.0, "task:throttle": 5.0, "thread:python3": 6.0, "nvml calls": 2.0})


def test_counts_are_per_second_not_per_cent() -> None:
    before = {"agent": 10.0, "per s:throttle ticks": 400.0, "per s:nvml calls": 42.0}
    after = {"agent": 11.0, "per s:throttle ticks": 410.0, "per s:nvml calls": 82.0}
    assert nodeparts.shares(before, after, 20.0) == pytest.approx(
        {"agent": 5.0, "per s:throttle ticks": 0.5, "per s:nvml calls": 2.0})


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_window_that_lasted_no_time_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="must last > 0 s"):
        nodeparts.shares({}, {}, seconds)


def test_read_takes_both_sources(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 7, {7: ("python3", 0)})
    got = nodeparts.read(7, BODY, proc)
    assert {"agent", "thread:event loop#7", "task:throttle", "nvml calls"} <= set(got)


def test_the_table_puts_the_agent_first_and_marks_what_a_tree_does_not_export() -> None:
    from tests.bench.bench_node import part_table

    table = part_table({
        "this tree": [{"agent": 7.0, "task:throttle": 5.0}, {"agent": 9.0, "task:throttle": 6.0}],
        "baseline": [{"agent": 8.0}],  # older: no task metrics
    }).splitlines()
    assert table[2].split() == ["agent", "8.00", "8.00"]  # medians of each tree's windows
    assert table[3].split() == ["task:throttle", "5.50", "-"]

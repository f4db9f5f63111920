"""The node agent's CPU by part: its supervised tasks, NVML's calls and its threads.

A bench that measures the whole agent's CPU (`bench_node.py --by-part`) takes `read` of the
agent at both ends of a window; `shares` turns the two into % of a core per part:
- `task:<name>`: a supervised task's steps on the event loop's thread
  (`vgpu_task_cpu_seconds_total`);
- `nvml calls`: the wall time of the throttle's NVML per-process calls
  (`vgpu_gpu_nvml_process_utilization_call_seconds_total`, summed over the GPUs), nearly all CPU
  on a real driver, the simulated driver's Python here;
- `thread:<name>`: the threads' CPU from `/proc`, by name, summed where several share one
  (the event loop's thread is `thread:event loop`); a thread that ended within the window is
  not counted;
- `agent`: the whole process;
- `per s:throttle ticks` and `per s:nvml calls`: not CPU, but how many of each the window saw a
  second (`vgpu_throttle_ticks_total`; `vgpu_gpu_nvml_process_utilization_calls_total`, summed),
  what the CPU parts are made of.
The tasks run on the event loop's thread, so `task:` parts are within `thread:event loop`.
A part an agent does not export (a tree older than the metric) is left out, not read as 0.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

TASK_FAMILY = "vgpu_task_cpu_seconds"
NVML_FAMILY = "vgpu_gpu_nvml_process_utilization_call_seconds"
NVML_CALLS_FAMILY = "vgpu_gpu_nvml_process_utilization_calls"
TICKS_FAMILY = "vgpu_throttle_ticks"
PER_SECOND = "per s:"  # a count per second, not % of a core
LOOP_THREAD = "event loop"


def from_metrics(body: str) -> dict[str, float]:
    """`task:<name>` and `nvml calls` seconds, and the counts of ticks and NVML calls, from
    a text-format exposition."""
    out: dict[str, float] = {}
    summed = {NVML_FAMILY: "nvml calls", NVML_CALLS_FAMILY: f"{PER_SECOND}nvml calls",
              TICKS_FAMILY: f"{PER_SECOND}throttle ticks"}
    for family in text_string_to_metric_families(body):
        totals = [s for s in family.samples if s.name.endswith("_total")]
        if family.name == TASK_FAMILY:
            for sample in totals:
                out[f"task:{sample.labels['task']}"] = sample.value
        elif family.name in summed and totals:
            out[summed[family.name]] = sum([sample.value for sample in totals])
    return out


def from_threads(pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds of each of `pid`'s threads, as `thread:<name>#<tid>`, and `agent` for the
    process. A thread that ended between the listing and its read is skipped."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in sorted((proc / str(pid) / "task").iterdir()):
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        name = LOOP_THREAD if task.name == str(pid) else name
        out[f"thread:{name}#{task.name}"] = stat_cpu_seconds(stat, tick)
    out["agent"] = cpu_seconds(pid, proc)
    return out


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """A process's CPU seconds so far (user and system), from `proc`."""
    return stat_cpu_seconds((proc / str(pid) / "stat").read_text(), os.sysconf("SC_CLK_TCK"))


def stat_cpu_seconds(stat: str, tick: int) -> float:
    """utime + stime of a `/proc` stat line (the fields after the command's closing paren), in
    seconds of `tick` clock ticks each."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick


def read(pid: int, body: str, proc: Path = Path("/proc")) -> dict[str, float]:
    """Every part's CPU seconds so far: the threads from `proc`, the rest from `body`."""
    return {**from_threads(pid, proc), **from_metrics(body)}


def shares(before: dict[str, float], after: dict[str, float], seconds: float
           ) -> dict[str, float]:
    """% of a core per part over a window of `seconds`, threads summed by name. A part must be
    read at both ends, but for a thread started within the window (counted from 0)."""
    if not seconds > 0:
        raise ValueError(f"a window must last > 0 s, got {seconds!r}")
    spent: dict[str, float] = defaultdict(float)
    for part, end in after.items():
        thread = part.startswith("thread:")
        start = before.get(part, 0.0 if thread else None)
        if start is not None:
            spent[part.rsplit("#", 1)[0] if thread else part] += end - start
    return {part: round(value / seconds * (1 if part.startswith(PER_SECOND) else 100), 3)
            for part, value in spent.items()}

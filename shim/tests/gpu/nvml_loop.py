"""The NVML backend and the throttle controller on a real GPU, with real processes under the shim.

    python3 shim/tests/gpu/nvml_loop.py CHECK SHIM_LIB [--out DIR] [--quick]

CHECK is `gpu_check` (built by run.sh), SHIM_LIB `libvgpu.so`. Uses GPU 0. Each part prints its
findings as it goes and writes its raw readings as JSON lines under --out:

1. the backend: inventory, readings, running processes, the XID event wait, and what each NVML
   call the controller makes costs on this driver;
2. NVML's per-process samples of one process held at a fixed token rate (unthrottled, then at
   rates for 50 % and 20 %): the sample period, the values, their spread, against the share the
   shim's own counters show (tokens spent over the unthrottled tokens per second); then two at
   once, and where both read one figure above their work together and below 97 (a time-sliced
   GPU counting itself busy beyond the work), that excess per launch: the busy time each launch
   holds (`simulation/imperfections.py`'s `launch_hold_s`);
3. the agent's controller (`ThrottleController`, its defaults) steering real processes through
   their region files from real NVML samples: two strict containers (30 % and 50 %), together
   from the start and, with the shortest kernels, each alone first for `--alone` s (what the
   split learns of a container's tokens alone bounds what it shares out of a GPU counted busy
   beyond the work), then two work-conserving ones (20 % each, both hungry). Shares are judged
   by the shim's counters, not by NVML, so the controller's own reading cannot flatter it.
   Where the GPU reads time-sliced, strict containers together from the start get a turn alone
   (`throttle/soloturn.py`): each case says how many, and when the others were paused.

With --mps every process runs under an MPS control daemon of the run's own, and part 2 says for
each case whether NVML gave every process samples of its own and what they add up to.

Exit status 0 when every part ran and the controller held the strict shares within 5 points
(where one container's process is replaced, `--phase`, the windows before the new one first
spends are left out: a process starting up has no share to hold).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_region.py, beside this one

from make_region import write_region

from vgpu_agent.gpu.nvml import NvmlBackend
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.throttle.attribution import NONE_OF_THEM, RegionMarks
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.timesliced import TimeSlicedSplit

GRID, BLOCK, SPIN_US = 1024, 128, 20  # as run.sh: about 20 us per kernel, the whole GPU busy
COST = GRID * BLOCK  # tokens per launch
STRICT, WORK_CONSERVING, OFF = (layout.POLICY_STRICT, layout.POLICY_WORK_CONSERVING,
                                layout.POLICY_OFF)
SEQ = itertools.count(1)  # each region its own allocation number


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(values: Sequence[float]) -> str:
    if not values:
        return "none"
    return (f"n={len(values)} median={statistics.median(values):.3g} "
            f"p10={percentile(values, 10):.3g} p90={percentile(values, 90):.3g} "
            f"min={min(values):.3g} max={max(values):.3g}")


class Out:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory

    def write(self, name: str, rows: Iterable[dict]) -> None:
        with open(self.directory / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def say(*parts: object) -> None:
    print(*parts, flush=True)


# ---- regions and processes ----------------------------------------------------------------------

def make_region(root: Path, uuid: str, limit_pct: float, policy: int,
                rate: int = 0, burst: int = 0) -> Region:
    """A one-device region as the agent writes it at Allocate (memory unlimited), in a
    directory named by its allocation, as the agent's regions are."""
    seq = next(SEQ)
    device_id = f"{uuid}::{seq}"
    path = root / format_alloc_id(seq, (device_id,), time.monotonic_ns())
    core = min(layout.CORE_LIMIT_FULL, max(1, round(limit_pct * layout.CORE_LIMIT_FULL / 100)))
    write_region(path, uuid, 0, core, rate, burst, policy, seq=seq, device_id=device_id)
    return Region.open(path)


def start(check: str, shim: str, region: Region, seconds: float, spin_us: int = SPIN_US
          ) -> subprocess.Popen[str]:
    env = dict(os.environ, LD_PRELOAD=shim, VGPU_REGION_DIR=str(region.path), VGPU_FAIL_CLOSED="1")
    return subprocess.Popen([check, "throughput", str(seconds), str(GRID), str(BLOCK),
                             str(spin_us)], env=env, stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if proc.returncode != 0:
        say(f"  process {proc.pid} exited {proc.returncode}: {out.strip()}")
    return out.strip()


def tokens(region: Region) -> int:
    counters = region.counters()
    return counters[0] if counters else 0


class Sampler:
    """Polls NVML's per-process samples as the controller does (since the newest seen)."""

    def __init__(self, backend: NvmlBackend, uuid: str):
        self.backend, self.uuid = backend, uuid
        self.since_us = 0
        self.rows: list[dict] = []

    def poll(self) -> None:
        t = time.monotonic()
        samples = self.backend.process_utilization(self.uuid, self.since_us)
        for s in samples:
            self.since_us = max(self.since_us, s.timestamp_us)
            self.rows.append({"t": t, "pid": s.pid, "ts_us": s.timestamp_us, "sm": s.sm_util})

    def of(self, pid: int, after: float) -> list[dict]:
        return [r for r in self.rows if r["pid"] == pid and r["t"] >= after]


# ---- MPS -----------------------------------------------------------------------------------------

class MpsError(RuntimeError):
    """The MPS control daemon did not start."""


MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@contextlib.contextmanager
def mps_daemon(control: str, directory: Path) -> Iterator[Path]:
    """An MPS control daemon of the run's own, its pipe and log directories under `directory`:
    the processes started meanwhile find it through the environment (`start` passes this
    process's on). Told to quit at the end, the environment as it was. The GPU's compute mode
    is left as it is, so other users of the GPU are not turned away."""
    pipe, logs = directory / "pipe", directory / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    saved = {name: os.environ.get(name) for name in MPS_ENV}
    os.environ.update(dict(zip(MPS_ENV, (str(pipe), str(logs)), strict=True)))
    try:
        try:
            started = subprocess.run([control, "-d"], capture_output=True, text=True,
                                     timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise MpsError(f"{control} -d: {err}") from err
        if started.returncode != 0:
            said = (started.stderr or started.stdout).strip()
            raise MpsError(f"{control} -d exited {started.returncode}: {said}")
        say(f"  MPS control daemon started, its pipes in {pipe}")
        try:
            yield pipe
        finally:
            try:
                told = subprocess.run([control], input="quit\n", capture_output=True, text=True,
                                      timeout=30, check=False)
                say(f"  MPS control daemon told to quit: exit {told.returncode}")
            except (OSError, subprocess.TimeoutExpired) as err:
                say(f"  MPS control daemon not told to quit: {err}")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- part 1: the backend ------------------------------------------------------------------------

def pynvml_samples(handle: object, since_us: int) -> int:
    """NVML's samples through pynvml's own wrapper, which asks for the size first."""
    try:
        return len(pynvml.nvmlDeviceGetProcessUtilization(handle, since_us))
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
            return 0
        raise


def part_backend(backend: NvmlBackend, out: Out) -> str:
    inventory = backend.discover()
    for gpu in inventory.gpus:
        say(f"  GPU {gpu}")
    uuid = inventory.gpus[0].uuid
    say(f"  driver {backend.driver_version}")
    say(f"  readings {backend.readings(uuid)}")
    say(f"  running processes {backend.running_processes(uuid)}")
    t = time.monotonic()
    try:
        event = backend.wait_xid(200)
        say(f"  XID wait 200 ms: {event!r} after {time.monotonic() - t:.3f} s")
    except Exception as err:  # what a real driver says here is the finding
        say(f"  XID wait failed: {type(err).__name__}: {err}")
    costs = []
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    for name, call in (
        ("nvmlDeviceGetProcessUtilization", lambda: backend.process_utilization(uuid, 0)),
        ("nvmlDeviceGetProcessUtilization(recent)",
         lambda: backend.process_utilization(uuid, int(time.time() * 1e6) - 200_000)),
        # the agent's one call a read against pynvml's two (a sizing call, then the fill)
        ("nvmlDeviceGetProcessUtilization via pynvml (2 calls)",
         lambda: pynvml_samples(handle, 0)),
        ("nvmlDeviceGetProcessUtilization(recent) via pynvml (2 calls)",
         lambda: pynvml_samples(handle, int(time.time() * 1e6) - 200_000)),
        ("nvmlDeviceGetComputeRunningProcesses", lambda: backend.running_processes(uuid)),
        ("readings (memory, utilization, temperature, power)", lambda: backend.readings(uuid)),
    ):
        times, cpu = [], []
        for _ in range(200):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            call()
            cpu.append((time.thread_time_ns() - c0) / 1000)
            times.append((time.perf_counter_ns() - t0) / 1000)
        say(f"  cost of {name} (us): wall {summary(times)}; CPU {summary(cpu)}")
        costs.append({"call": name, "us": times, "cpu_us": cpu})
    out.write("backend_costs.jsonl", costs)
    return uuid


# ---- part 2: NVML's samples at fixed rates ------------------------------------------------

class Held:
    """One process held at a fixed share of the GPU's unthrottled rate (None: unthrottled)."""

    def __init__(self, pct: float | None, spin_us: int):
        self.pct, self.spin_us = pct, spin_us

    @property
    def label(self) -> str:
        share = "unthrottled" if self.pct is None else f"{self.pct:g}%"
        return f"{share}@{self.spin_us}us"


def hold(check: str, shim: str, backend: NvmlBackend, root: Path, uuid: str,
         held: Sequence[Held], full: dict[int, float], seconds: float,
         others: list[dict] | None = None) -> list[tuple[float, list[dict], list[float]]]:
    """Processes at fixed rates, together: per process its tokens/s and NVML's samples of it,
    and (the same for all) the device's utilization readings over the window. `others`, where
    given, gets the window's samples of every other process (under MPS, perhaps its server)."""
    regions = []
    for h in held:
        if h.pct is None:
            regions.append(make_region(root, uuid, 100, OFF))  # as run.sh's "policy off"
        else:
            rate = int(full[h.spin_us] * h.pct / 100)
            regions.append(make_region(root, uuid, h.pct, STRICT, rate, max(COST, rate // 20)))
    sampler = Sampler(backend, uuid)
    procs = [start(check, shim, r, seconds, h.spin_us) for r, h in zip(regions, held, strict=True)]
    t0 = time.monotonic()
    begin: float | None = None
    spent0 = [0] * len(regions)
    device: list[float] = []
    while all(p.poll() is None for p in procs):
        sampler.poll()
        now = time.monotonic()
        # past start-up and the first samples, and every process not paused spending: on a
        # loaded machine a process's start may take seconds, and a window before it measured 0
        if begin is None and now - t0 >= 1.5:
            spent0 = [tokens(r) for r in regions]
            if all(n > 0 for n, h in zip(spent0, held, strict=True) if h.pct != 0):
                begin = now
        if begin is not None:
            utilization = backend.readings(uuid).utilization
            if utilization is not None:  # (NVML could not say: no reading, not a 0)
                device.append(utilization)
            if now - begin >= seconds - 2.5:
                break
        time.sleep(0.02)
    end = time.monotonic()
    spent1 = [tokens(r) for r in regions]
    if begin is None:
        say(f"  no window measured: a process ended {end - t0:.1f} s after the start, before "
            "every process not paused had spent")
    for proc, h in zip(procs, held, strict=True):
        if h.pct == 0:  # paused for good: it would wait for tokens past its run
            proc.kill()
        finish(proc)
    found = []
    for i, (proc, region) in enumerate(zip(procs, regions, strict=True)):
        per_s = (spent1[i] - spent0[i]) / (end - begin) if begin is not None and end > begin \
            else 0.0
        rows = sampler.of(proc.pid, begin or t0)
        for r in rows:
            r["label"] = held[i].label
        found.append((per_s, rows, device))
        region.close()
    if others is not None:
        ours = {proc.pid for proc in procs}
        others += [r for r in sampler.rows if r["pid"] not in ours and r["t"] >= (begin or t0)]
    return found


# Stamps of two processes' samples this close are read as one period: a driver attributing
# periods per process may stamp each process's sample a little apart (not seen yet; the H200's
# time-sliced samples were a whole period, 1/6 s, apart), and a grouping by exact stamps would
# then read per-process attribution as time-sliced. A quarter of the H200's period.
NEAR_STAMPS_US = 40_000


def periods_together(per_process: Sequence[Sequence[dict]], others: Sequence[dict],
                     near_us: int = NEAR_STAMPS_US) -> dict:
    """How NVML attributed the periods of processes running together: the periods (distinct
    stamps) their samples came in, those in which every one of them had a sample (per-process
    attribution; a time-sliced driver gives each period to one), the sum of their values in
    those (does a full GPU's add up to 100?), and the samples of processes outside the case.
    The same again with stamps within `near_us` of a period's first read as that period
    (`near_*`), and how far apart the stamps of one such period lay."""
    exact, near = _periods(per_process, 0), _periods(per_process, near_us)
    sums = [sum(sm for _, sm in p.values()) for p in exact if len(p) >= len(per_process)]
    near_full = [p for p in near if len(p) >= len(per_process)]
    near_sums = [sum(sm for _, sm in p.values()) for p in near_full]
    spreads = [max(ts for ts, _ in p.values()) - min(ts for ts, _ in p.values())
               for p in near_full]
    return {
        "periods": len(exact), "shared": len(sums),
        "sum_median": statistics.median(sums) if sums else None,
        "sum_p90": percentile(sums, 90) if sums else None,
        "sum_max": max(sums) if sums else None,
        "near_us": near_us, "near_shared": len(near_sums),
        "near_sum_median": statistics.median(near_sums) if near_sums else None,
        "near_spread_us_max": max(spreads) if spreads else None,
        "others": len(others), "other_pids": sorted({r["pid"] for r in others}),
    }


def _periods(per_process: Sequence[Sequence[dict]], near_us: int
             ) -> list[dict[int, tuple[int, int]]]:
    """The periods the samples came in, in order, each as process -> (stamp, value) of its
    first sample there; a stamp within `near_us` of a period's first belongs to that period
    (0: only equal stamps do)."""
    stamped = sorted((r["ts_us"], n, r["sm"]) for n, rows in enumerate(per_process)
                     for r in rows)
    periods: list[dict[int, tuple[int, int]]] = []
    start = None
    for ts, n, sm in stamped:
        if start is None or ts - start > near_us:
            start = ts
            periods.append({})
        periods[-1].setdefault(n, (ts, sm))
    return periods


def describe_together(found: dict) -> str:
    """`periods_together`'s finding as a line."""
    text = f"periods {found['periods']}, with a sample of every process {found['shared']}"
    if found["shared"]:
        text += (f", their sum median {found['sum_median']:g} (p90 {found['sum_p90']:g}, "
                 f"max {found['sum_max']:g})")
    if found["near_shared"] > found["shared"]:
        text += (f"; stamps within {found['near_us'] / 1000:g} ms read as one period: "
                 f"{found['near_shared']}, their sum median {found['near_sum_median']:g}, "
                 f"stamps up to {found['near_spread_us_max'] / 1000:g} ms apart")
    if found["others"]:
        text += f"; {found['others']} samples of other processes, pids {found['other_pids']}"
    return text


def describe_samples(label: str, rows: list[dict], truth_pct: float, device: list[float]
                     ) -> dict:
    stamps = sorted({r["ts_us"] for r in rows})
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
    values = [r["sm"] for r in rows]
    stdev = statistics.stdev(values) if len(values) > 1 else None
    found: dict[str, object] = {
        "label": label, "truth_pct": round(truth_pct, 1), "samples": len(rows),
        "period_ms_median": statistics.median(gaps) if gaps else None,
        "period_ms_p90": percentile(gaps, 90) if gaps else None,
        "sm_mean": statistics.fmean(values) if values else None,
        "sm_stdev": stdev,
        "sm_values": sorted(set(values)),
        "device_util_mean": statistics.fmean(device) if device else None,
    }
    say(f"  {label}: shim counters say {truth_pct:.1f} %; NVML {len(rows)} samples, "
        f"period ms {summary(gaps)}; sm {summary(values)}, stdev "
        f"{'-' if stdev is None else round(stdev, 2)}; device util mean "
        f"{'-' if not device else round(statistics.fmean(device), 1)}")
    return found


# Each case: processes run together at fixed rates (share of the unthrottled rate, None for
# unthrottled) and kernel lengths. Alone first (is NVML proportional to the work?), then two
# at once: contexts of two processes are time-sliced, and what NVML says of each is the finding.
CASES: tuple[tuple[Held, ...], ...] = (
    (Held(None, 20),), (Held(50, 20),), (Held(20, 20),), (Held(5, 20),),
    (Held(None, 20), Held(None, 20)),
    (Held(20, 20), Held(20, 20)),
    (Held(30, 20), Held(50, 20)),
    (Held(5, 20), Held(None, 20)),
    (Held(None, 200),), (Held(20, 200),),
    (Held(None, 200), Held(None, 200)),
    (Held(20, 200), Held(20, 200)),
    (Held(30, 200), Held(50, 200)),
    # where two read one figure below saturation: the busy time each launch holds, at several
    # launch rates and kernel lengths (the one such reading so far: 20 + 20 % of 200 us)
    (Held(10, 200), Held(10, 200)),
    (Held(5, 200), Held(5, 200)),
    (Held(None, 50),), (Held(5, 50), Held(5, 50)),
    (Held(None, 1000),), (Held(20, 1000), Held(20, 1000)), (Held(40, 1000), Held(20, 1000)),
)

RATE_CASES = ((Held(None, 20),), (Held(None, 200),))
# the unthrottled rates, and the pairs below saturation that pin the busy a launch holds
HOLD_CASES = (
    *RATE_CASES,
    (Held(20, 200), Held(20, 200)), (Held(10, 200), Held(10, 200)), (Held(5, 200), Held(5, 200)),
    (Held(None, 50),), (Held(5, 50), Held(5, 50)),
)
QUICK_CASES = ((Held(None, 20),), (Held(50, 20),), (Held(20, 20),),
               (Held(20, 20), Held(20, 20)))


def parse_cases(spec: str) -> tuple[tuple[Held, ...], ...]:
    """Fixed-rate cases from `--cases`: comma-separated, each case's processes joined by '+',
    each process SHARE@US (SHARE a percent of the unthrottled rate, or 'full'; 0 is a process
    paused once its first kernel ran, holding its context, as a container is in another's turn
    alone). The unthrottled rates the rest need come first."""
    cases = []
    for text in (c for c in spec.split(",") if c.strip()):
        held = []
        for part in text.split("+"):
            share, sep, spin = part.strip().partition("@")
            try:
                pct = None if share == "full" else float(share)
                spin_us = int(spin)
            except ValueError:
                pct, spin_us = -1.0, 0
            if not sep or spin_us <= 0 or (pct is not None and not 0 <= pct <= 100):
                raise argparse.ArgumentTypeError(
                    f"case {text!r}: each process is SHARE@US, SHARE 0-100 or 'full', US > 0")
            held.append(Held(pct, spin_us))
        cases.append(tuple(held))
    spins = sorted({h.spin_us for case in cases for h in case})
    return (*((Held(None, spin),) for spin in spins), *cases)


def part_samples(check: str, shim: str, backend: NvmlBackend, root: Path, uuid: str,
                 out: Out, seconds: float, cases: Sequence[tuple[Held, ...]] = CASES
                 ) -> dict[int, float]:
    """The unthrottled rate per kernel length (the first case of each alone), then each case."""
    full: dict[int, float] = {}
    rows: list[dict] = []
    found: list[dict] = []
    for case in cases:
        others: list[dict] = []
        results = hold(check, shim, backend, root, uuid, case, full, seconds, others)
        if len(case) == 1 and case[0].pct is None and case[0].spin_us not in full:
            per_s = full[case[0].spin_us] = results[0][0]
            say(f"  unthrottled {case[0].spin_us} us kernels: {per_s / COST:.0f} launches/s "
                f"({per_s:.3g} tokens/s)")
        together = 0.0
        for h, (per_s, got, device) in zip(case, results, strict=True):
            truth = 100 * per_s / full[h.spin_us]
            together += truth
            name = h.label + (f" (with {len(case) - 1} other)" if len(case) > 1 else "")
            found.append(describe_samples(name, got, truth, device) | {"case": len(found)})
            rows += got
        attributed = periods_together([got for _, got, _ in results], others)
        found[-1]["periods_together"] = attributed
        if len(case) > 1 or others:
            say(f"    {describe_together(attributed)}")
        if len(case) > 1:
            say(f"    together {together:.1f} % of one process's unthrottled work")
            hold_us = launch_hold_us(case, found[-len(case):], together, full)
            if hold_us is not None:
                found[-1]["hold_us"] = round(hold_us, 1)
                say(f"    busy beyond the work: {hold_us:.0f} us a launch")
    out.write("nvml_samples.jsonl", rows)
    out.write("nvml_summary.jsonl", found)
    return full


# ---- part 2b: reads further apart than a sample period ------------------------------------------

# (share of the unthrottled rate, kernel us) per process, run together
LATE_CASES: tuple[tuple[tuple[float, int], ...], ...] = (
    ((50, 20),), ((20, 200), (20, 200)), ((30, 20), (50, 20)),
)
READ_GAPS_S = (0.02, 0.4, 1.0)  # the gap between reads, each for LATE_READS_S
LATE_READS_S = 3.0


def part_late_reads(check: str, shim: str, backend: NvmlBackend, root: Path, uuid: str,
                    out: Out, full: dict[int, float]) -> None:
    """Processes at fixed rates while NVML is read every 20 ms, then every 0.4 s, then every
    second: what the samples of the periods one read brings together say (each period's own
    use, or one period's use shared out among them)."""
    rows: list[dict] = []
    for case in LATE_CASES:
        if any(spin not in full for _, spin in case):
            continue
        regions = []
        for pct, spin in case:
            rate = int(full[spin] * pct / 100)
            regions.append(make_region(root, uuid, pct, STRICT, rate, max(COST, rate // 20)))
        total_s = 1.5 + LATE_READS_S * len(READ_GAPS_S) + 1
        procs = [start(check, shim, r, total_s, spin)
                 for r, (_, spin) in zip(regions, case, strict=True)]
        label = " + ".join(f"{pct}%@{spin}us" for pct, spin in case)
        time.sleep(1.5)
        since = 0
        for gap in READ_GAPS_S:
            per_read: list[list[int]] = []
            end = time.monotonic() + LATE_READS_S
            while time.monotonic() < end:
                samples = sorted(backend.process_utilization(uuid, since),
                                 key=lambda x: x.timestamp_us)
                if since and samples:
                    per_read.append([x.sm_util for x in samples])
                    rows.append({"case": label, "gap_s": gap, "t": time.monotonic(),
                                 "samples": [[x.pid, x.timestamp_us, x.sm_util]
                                             for x in samples]})
                if samples:
                    since = samples[-1].timestamp_us
                time.sleep(gap)
            say(f"  {label}, read every {gap:g} s: values per read "
                + " ".join("/".join(map(str, v)) for v in per_read))
        for proc in procs:
            finish(proc)
        for region in regions:
            region.close()
    out.write("late_reads.jsonl", rows)


# ---- part 3: the controller ------------------------------------------------------------------

class Phase(NamedTuple):
    """At `at_s`, container `container`'s process gives way to one of `spin_us` kernels."""
    container: int
    at_s: float
    spin_us: int


class KnownPids:
    """Host evidence for processes this script started itself (no containers here)."""

    def __init__(self) -> None:
        self.owner_of: dict[int, str] = {}

    def owner(self, host_pid: int, marks: RegionMarks) -> str | None:
        alloc_id = self.owner_of.get(host_pid)
        return alloc_id if alloc_id in marks else NONE_OF_THEM

    def forget_except(self, live: Iterable[int]) -> None:
        pass


@contextlib.contextmanager
def traced(backend: NvmlBackend, rows: list[dict] | None) -> Iterator[None]:
    """With `rows`, every NVML per-process read the controller makes and every split of a
    time-sliced GPU's use (its inputs and the shares it gave) are appended to them, for replay
    without a GPU."""
    if rows is None:
        yield
        return
    read, share = backend.process_utilization, TimeSlicedSplit.share

    def reading(uuid: str, since_us: int) -> list:
        samples = read(uuid, since_us)
        rows.append({"t": time.monotonic(), "since_us": since_us,
                     "samples": [[s.pid, s.timestamp_us, s.sm_util] for s in samples]})
        return samples

    def sharing(split: TimeSlicedSplit, owners: list[list[str]], busy: float, spent: dict,
                dt_s: float = 0.0, untrusted: Collection[str] = (), solo: str = "",
                per_launch: Mapping[str, float] | None = None) -> dict:
        shares = share(split, owners, busy, spent, dt_s, untrusted, solo, per_launch)
        rows.append({"t": time.monotonic(), "owners": owners, "busy": busy, "spent": spent,
                     "dt_s": dt_s, "untrusted": sorted(untrusted), "solo": solo,
                     "per_launch": dict(per_launch or {}),
                     "shares": shares, "beyond_work": list(split.beyond_work),
                     "margin": split.margin})
        return shares

    backend.process_utilization = reading  # type: ignore[method-assign]
    TimeSlicedSplit.share = sharing  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del backend.process_utilization
        TimeSlicedSplit.share = share  # type: ignore[method-assign]


@contextlib.contextmanager
def running(controller: ThrottleController) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    task = loop.create_task(controller.run())
    try:
        yield
    finally:
        task.cancel()


def launch_hold_us(case: Sequence[Held], found: Sequence[dict], together: float,
                   full: dict[int, float]) -> float | None:
    """The busy time a launch held beyond the work, in us, where every process of the case
    read one figure (within 3 points: a time-sliced GPU's) above their work together by 2 points
    or more, below 97 (a saturated figure bounds nothing); None otherwise."""
    means = [f["sm_mean"] for f in found]
    if None in means or any(h.pct is None for h in case):
        return None
    busy = statistics.fmean(means)
    if max(means) - min(means) > 3 or not together + 2 <= busy < 97:
        return None
    launches_per_s = sum((h.pct or 0.0) / 100 * full[h.spin_us] / COST for h in case)
    return (busy - together) / 100 / launches_per_s * 1e6


async def closed_loop(check: str, shim: str, backend: NvmlBackend, root: Path, uuid: str,
                      full: dict[int, float], name: str,
                      specs: Sequence[tuple[float, int, int]], seconds: float, out: Out,
                      alone_s: float = 0.0, phase: Phase | None = None, trace: bool = False
                      ) -> list[dict]:
    """Containers of (limit %, policy, kernel us), all hungry, steered by the controller for
    `seconds`; each one's share is its tokens per second over its kernels' unthrottled rate.
    With `alone_s`, each container first runs a process of its own alone for that long, one
    after the other (the controller steering meanwhile), and `seconds` count from when they
    all run. With `phase`, one container's process is replaced by one of other kernels."""
    regions = [make_region(root, uuid, pct, policy) for pct, policy, _ in specs]
    evidence = KnownPids()
    controller = ThrottleController(backend, lambda: regions, tick_s=0.1, max_tick_s=0.4,
                                    evidence=evidence)
    trail: list[dict] | None = [] if trace else None
    with traced(backend, trail), running(controller):
        if alone_s:
            for region, (_, _, spin) in zip(regions, specs, strict=True):
                first = start(check, shim, region, alone_s, spin)
                evidence.owner_of[first.pid] = region.alloc_id
                await asyncio.to_thread(finish, first)  # the controller steers meanwhile
        rows = await _together(check, shim, controller, evidence, regions, full, name, specs,
                               seconds, phase)
    errors = dict(controller.error_counts)
    for region in regions:
        region.close()
    say(f"  {name}: ticks {controller.ticks}, errors {errors or 'none'}, "
        f"open loop {sorted(controller.open_loop_gpus) or 'no'}, "
        f"read time-sliced {sorted(controller.time_sliced_gpus) or 'no'}, "
        f"turns alone {sum(controller.solo_turns_given.values())}")
    paused = [r for r in rows if r["paused"]]
    if paused:
        # a turn alone: what the others' launches saw (their shares through it are in the rows)
        say(f"    paused for a turn alone at t = {min(r['t'] for r in paused)}-"
            f"{max(r['t'] for r in paused)} s (status every 0.5 s; shares of those windows "
            + " ".join(f"{r['share']:.0f}" for r in paused) + ")")
    for i, (pct, policy, spin) in enumerate(specs):
        mine = [r for r in rows if r["container"] == i]
        line = " ".join(f"{r['share']:.0f}" for r in mine)
        kernels = (f"{spin} us kernels, {phase.spin_us} us from {phase.at_s:g} s"
                   if phase and phase.container == i else f"{spin} us kernels")
        say(f"    container {i} ({pct} %, {layout.POLICY_NAMES[policy]}, {kernels}) "
            f"share per 0.5 s: {line}")
    out.write(f"loop_{name}.jsonl", rows)
    if trail is not None:
        out.write(f"trace_{name}.jsonl", trail)
    return rows


async def _together(check: str, shim: str, controller: ThrottleController, evidence: KnownPids,
                    regions: list[Region], full: dict[int, float], name: str,
                    specs: Sequence[tuple[float, int, int]], seconds: float,
                    phase: Phase | None = None) -> list[dict]:
    """Every container's process at once for `seconds`: its share every 0.5 s, and whether
    it was paused for a turn alone in that window. With `phase`, at its second one container's
    process is stopped and one of other kernels started in its place (a change of phase: its
    tokens buy another amount of GPU time); its share counts against the new kernels' rate
    from the first window after. The windows before the new process first spends are marked
    `starting` (a process starting up, a CUDA context made: no container's share to hold),
    and the judgement leaves them out."""
    spins = [spin for _, _, spin in specs]
    procs = [start(check, shim, r, seconds + 2, spin)
             for r, spin in zip(regions, spins, strict=True)]
    for proc, region in zip(procs, regions, strict=True):
        evidence.owner_of[proc.pid] = region.alloc_id
    rows: list[dict] = []
    t0 = time.monotonic()
    last = [(t0, tokens(r)) for r in regions]
    changing = phase
    starting: int | None = None  # the container whose new process has not spent yet
    try:
        while time.monotonic() - t0 < seconds:
            if changing and time.monotonic() - t0 >= changing.at_s:
                i, spins[changing.container] = changing.container, changing.spin_us
                changing = None
                procs[i].terminate()
                await asyncio.to_thread(finish, procs[i])
                left = seconds + 2 - (time.monotonic() - t0)
                procs[i] = start(check, shim, regions[i], left, spins[i])
                evidence.owner_of[procs[i].pid] = regions[i].alloc_id
                last[i] = (time.monotonic(), tokens(regions[i]))
                starting = i
            # paused at any of the window's looks (a turn alone lasts a second or two)
            paused = set()
            for _ in range(5):
                await asyncio.sleep(0.1)
                paused |= {key for key, st in controller.status.items() if st.paused}
            now = time.monotonic()
            status = controller.status
            for i, region in enumerate(regions):
                spent = tokens(region)
                was_t, was_spent = last[i]
                last[i] = (now, spent)
                st = status.get((region.alloc_id, 0))
                if starting == i and spent > was_spent:
                    starting = None
                rows.append({
                    "case": name, "t": round(now - t0, 2), "container": i,
                    "limit": specs[i][0], "kernel_us": spins[i],
                    "share": 100 * max(0, spent - was_spent) / (now - was_t) / full[spins[i]],
                    "nvml": st.measured_util if st else None,
                    "target": st.target if st else None,
                    "rate": st.rate if st else None,
                    "paused": (region.alloc_id, 0) in paused,
                    "starting": starting == i,
                })
    finally:
        for proc in procs:
            finish(proc)
    return rows


def settle_and_error(rows: list[dict], container: int, goal: float, band: float
                     ) -> tuple[float | None, float]:
    """When the share entered `band` points of `goal` for good, and the mean error after 5 s;
    the windows of a process starting up (`starting`) left out."""
    mine = [r for r in rows if r["container"] == container and not r["starting"]]
    settled = None
    for r in mine:
        if abs(r["share"] - goal) > band:
            settled = None
        elif settled is None:
            settled = r["t"]
    tail = [abs(r["share"] - goal) for r in mine if r["t"] >= 5]
    return settled, statistics.fmean(tail) if tail else float("nan")


def share_by_halves(rows: list[dict], container: int, seconds: float) -> str:
    """Mean share in each half of the run after its first 5 s, and its highest 5 s."""
    mine = [r for r in rows if r["container"] == container]
    middle = 5 + (seconds - 5) / 2
    halves = [[r["share"] for r in mine if lo <= r["t"] < hi]
              for lo, hi in ((5, middle), (middle, seconds + 1))]
    shares = [r["share"] for r in mine]
    windows = [statistics.fmean(shares[j:j + 10]) for j in range(max(1, len(shares) - 9))]
    means = " / ".join(f"{statistics.fmean(h):.1f}" if h else "-" for h in halves)
    return f"mean share by halves {means}, highest 5 s {max(windows, default=0):.1f}"


async def part_controller(check: str, shim: str, backend: NvmlBackend, root: Path, uuid: str,
                          full: dict[int, float], out: Out, seconds: float,
                          alone_s: float = 0.0, phase_s: float = 0.0,
                          only: Collection[str] = (), trace: bool = False) -> bool:
    """Two strict containers (30 % and 50 %) at 20 and 200 us kernels (at every length
    measured where neither was), then with unequal kernels (the 30 % one's the shorter), then
    (with `alone_s`) at the shorter, each alone first, then (with `phase_s`) at the shorter, the
    30 % one changing to the longer at `phase_s`, then two work-conserving ones (20 % each) at
    the longer; ok when every strict share is held within 5 points."""
    ok = True
    spins = sorted(spin for spin in full if spin in (20, 200)) or sorted(full)
    short, long = min(spins), max(spins)
    cases: list[tuple[str, tuple[tuple[float, int, int], ...], float, Phase | None]] = [
        (f"strict{spin}", ((30, STRICT, spin), (50, STRICT, spin)), 0.0, None)
        for spin in spins]
    if short != long:
        cases.append(("strict_mixed", ((30, STRICT, short), (50, STRICT, long)), 0.0, None))
    if alone_s:
        cases.append((f"strict{short}_alone_first", ((30, STRICT, short), (50, STRICT, short)),
                      alone_s, None))
    if phase_s:
        cases.append((f"strict{short}_phase", ((30, STRICT, short), (50, STRICT, short)), 0.0,
                      Phase(0, phase_s, long)))
    lending = f"lending{long}"
    for name, specs, alone, phase in cases:
        if only and name not in only:
            continue
        rows = await closed_loop(check, shim, backend, root, uuid, full, name, specs, seconds,
                                 out, alone, phase, trace)
        for i, (goal, _, spin) in enumerate(specs):
            settled, err = settle_and_error(rows, i, goal, 3)
            started = sum(1 for r in rows if r["container"] == i and r["starting"])
            say(f"    strict {goal} % ({spin} us kernels): within 3 points from {settled} s; "
                f"mean |error| after 5 s {err:.2f} points; {share_by_halves(rows, i, seconds)}"
                + (f"; {started} windows of its new process starting left out" if started
                   else ""))
            ok &= err <= 5
    if only and lending not in only:
        return ok
    lent = await closed_loop(check, shim, backend, root, uuid, full, lending,
                             ((20, WORK_CONSERVING, long), (20, WORK_CONSERVING, long)),
                             seconds, out, trace=trace)
    tail = [r["share"] for r in lent if r["t"] >= 5]
    total = sum(tail) / (len(tail) / 2) if tail else 0.0
    say(f"    work-conserving 20 % + 20 % ({long} us kernels), both hungry: together "
        f"{total:.1f} % after 5 s (the GPU's idle time lent out)")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check")
    parser.add_argument("shim")
    parser.add_argument("--out", type=Path, default=Path("nvml-loop"))
    parser.add_argument("--nvml-library", default=None)
    parser.add_argument("--seconds", type=float, default=15.0, help="each controller case")
    parser.add_argument("--hold", type=float, default=6.0, help="each fixed-rate case")
    parser.add_argument("--alone", type=float, default=4.0,
                        help="each container alone first this long, in the controller case that "
                             "has them so (0: no such case)")
    for flag, what in (
        ("--quick", "four fixed-rate cases, one kernel length (for checking the script)"),
        ("--controller-only",
         "of the fixed-rate cases, only the unthrottled rates the controller cases need"),
        ("--holds", "of the fixed-rate cases, the unthrottled rates and the pairs that pin the "
                    "busy a launch holds"),
        ("--late-reads", "read NVML every 20 ms, 0.4 s and 1 s beside processes at fixed "
                         "rates: what periods read together say"),
        ("--trace", "write every NVML read and time-sliced split of the controller cases to "
                    "trace_CASE.jsonl"),
        ("--mps", "run every process under an MPS control daemon of the run's own (pipes under "
                  "OUT/mps, told to quit at the end): does NVML then give each process samples "
                  "of its own, and do a full GPU's add up to 100?"),
    ):
        parser.add_argument(flag, action="store_true", help=what)
    parser.add_argument("--mps-control", default="nvidia-cuda-mps-control",
                        help="the MPS control program --mps starts and stops")
    parser.add_argument("--phase", type=float, default=12.0,
                        help="in a case of its own, the first container's process is replaced "
                             "at this second by one with the longest kernels (0: no such case)")
    parser.add_argument("--cases", type=parse_cases, default=None,
                        help="the fixed-rate cases instead of the built-in ones, e.g. "
                             "'80@200,80@200+0@20' (SHARE@US joined by '+'; 0: paused)")
    parser.add_argument("--only", default="",
                        help="comma-separated controller cases to run (default: all), e.g. "
                             "strict20,strict_mixed")
    args = parser.parse_args(argv)
    out = Out(args.out)
    root = args.out / "regions"
    backend = NvmlBackend(args.nvml_library)
    backend.start()
    try:
        with contextlib.ExitStack() as stack:
            if args.mps:
                say("0. an MPS control daemon")
                try:
                    stack.enter_context(mps_daemon(args.mps_control, args.out / "mps"))
                except MpsError as err:
                    say(f"  {err}")
                    return 1
            ok = run_parts(args, out, root, backend)
    finally:
        backend.shutdown()
    say("result:", "ok" if ok else "FAIL")
    return 0 if ok else 1


def run_parts(args: argparse.Namespace, out: Out, root: Path, backend: NvmlBackend) -> bool:
    """Parts 1-3 as the command line asks; whether they ran and the controller held its
    shares."""
    say("1. the NVML backend")
    uuid = part_backend(backend, out)
    say("2. NVML's per-process samples at fixed rates")
    full = part_samples(args.check, args.shim, backend, root, uuid, out, args.hold,
                        args.cases if args.cases
                        else QUICK_CASES if args.quick
                        else RATE_CASES if args.controller_only
                        else HOLD_CASES if args.holds else CASES)
    if not full or min(full.values()) <= 0:
        say("  no unthrottled rate measured: the controller cases need it")
        return False
    if args.late_reads:
        say("2b. reads further apart than a sample period")
        part_late_reads(args.check, args.shim, backend, root, uuid, out, full)
    say("3. the controller on real processes")
    return asyncio.run(part_controller(args.check, args.shim, backend, root, uuid, full, out,
                                       args.seconds, args.alone, args.phase,
                                       {c for c in args.only.split(",") if c}, args.trace))


if __name__ == "__main__":
    sys.exit(main())

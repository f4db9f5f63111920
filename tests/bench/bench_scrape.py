"""Scrape and control cost on a busy node, at 16, 64, 144 and 256 busy container-devices.

    python tests/bench/bench_scrape.py [--gpus 8] [--sizes 16,64,144,256] [--seconds 30]
                                       [--allocates 600] [--nvml-call-ms 2.2]
                                       [--policy strict|work-conserving] [--idle-every N]
                                       [--changing-gpus N] [--time-sliced]

The agent is the whole agent, as `vgpu-agent run` composes it (`Agent` on the agent's own
event loop: device plugin, PodResources, health checks, NVML poll, controller, backstop,
metrics), in a child process of its own on simulated GPUs, so that its CPU time and RSS are its
own. The kubelet stand-in runs in a second child: the agent registers with it, and its
PodResources lists the bench's containers, which the agent adopted from their region files at
start (as after an agent restart) and binds to their pods. This process plays the containers (a
shim-like writer updating every region's `state` every 50 ms, each container spending what
its bucket lets through of 5 million tokens a second; the simulated GPUs report each
container's process in their per-process samples) and Prometheus (scrapes). Every figure is
checked to come from an agent doing its job: each pod must be named in the scrape with its
utilization. Measured:

- steady state: CPU seconds per minute of the agent over `--seconds` without scrapes, then
  over `--seconds` with a scrape every `--interval` s (after two scrapes at that interval, so
  that the agent reads its regions once per scrape, just before it, as it does in the long run);
- scrape latency: `--scrapes` back-to-back scrapes with Prometheus's headers (OpenMetrics
  preferred, gzip), p50 and p99 (ms), agent CPU per scrape, exposition sizes;
- Allocate latency: `Allocate` on the agent's own plugin socket, as the kubelet calls it (for
  devices no container holds; every call creates a real region, which the agent collects at
  its next PodResources answer since no container holds it, so the node keeps about its size;
  a pair of calls every 40 ms);
  `--allocates` calls alternate with calls to a bare grpc.aio server answering the same RPC
  with an empty response in its own process on the same kind of unix socket (bench_plugin.py's
  "bare call"), so both see the same machine noise.
  They run while the controller ticks, the containers' counters move and a scraper thread
  scrapes every `--allocate-scrape-s` s (more often than Prometheus would, so that scrapes and
  calls meet within the window); p50/p99 of each and the p99 ratio, goal <= 2;
- RSS (and peak RSS) of the agent at the end.

Two configurations per size. The simulated GPUs report each container's use from the tokens
it spent (`Accounting`: 5.6 % for the 1.1 million tokens a second a full GPU's 18th allows),
so the law's rates move its use, as on a real GPU. Steady shares: the work a token buys stays
put, and the controller converges, then slows down; measured `--settle` s after start (where
nothing is lent it ticks every 2 s once all has been calm for 19 s). Shares that change: the
work a token buys doubles every other 2 s for each container, out of step with half the
others, so estimates and rates move, and the tick is held at 100 ms, as if something changed
every tick (the law would otherwise learn flips this regular as noise and calm down): the
cost of a controller that never does.
The node is full and valid: one container in eight has a second GPU (the next one), spread so
that every GPU holds as many container-devices (18 at 144), its limits adding up to 100 %.
With `--idle-every N` the last container of every N holds its slices and never launches (a
notebook between sessions): its share is lent where the policy lends, and it has no rate.
With `--changing-gpus N` a third configuration: the work a token buys changes as above for
the containers of the first N GPUs only, and the agent runs at its own pace, as steady (each
GPU keeps its own tick: what a node pays while one GPU's containers change).

With `--time-sliced` two configurations more, steady and changing, in which the simulated
drivers sample as an H200 without MPS does: each period goes whole to one process, drawn with
odds in proportion to its use, valued at the GPU's use (`samples_from`), so that the controller
shares each GPU's use out by the tokens spent and the periods, and gives containers turns alone:
what a node without MPS costs. Its steady window comes once the first turns are over (a window of
`--seconds` without a turn alone, or `--first-turns-most` seconds), and what the agent cost while
they came is printed beside it.

Goals: scrape p99 <= 50 ms, agent CPU <= 2 % of one core steady and <= 5 % while shares change,
Allocate p99 <= 2x a bare call (at 144 container-devices), RSS <= 150 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import mmap
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vgpu_agent.gpu.model import ProcessSample

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.nodeparts import cpu_seconds  # noqa: E402  (bench_node's windows use it too)

GIB = 1 << 30
# Slices per GPU the agent advertises: more than the largest node's containers hold (32 per GPU
# at 256), so that Allocate has free devices to be asked for, as a kubelet asks.
SPLIT = 40
HOST_PID_BASE = 200_000
GOAL_P99_MS = 50.0
GOAL_CPU_PERCENT = 2.0
GOAL_CHANGING_CPU_PERCENT = 5.0
SAMPLE_PERIOD_US = 166_667  # NVML's per-process sample period on the bench node (1/6 s)
# SM percent per million tokens a second (a container held to 1.1 M tokens a second, its share
# of 18 on a GPU, uses its 5.6 %; unthrottled, its 5 M would take 25 %)
TOKENS_PER_PERCENT = 200_000
SHIM_STEP_S = 0.05  # the containers' counters move this often (a real shim's move continuously)
GOAL_RSS_MB = 150.0
GOAL_ALLOCATE_RATIO = 2.0
ALLOCATE_WARMUP = 20  # calls of each kind left out of the figures
# A pair of calls (the agent's, the bare one) this often: each Allocate makes a region that
# lives until the next PodResources answer, and a faster storm would grow the node far past its
# size (a kubelet admits a few containers a second, not hundreds).
ALLOCATE_PAIR_S = 0.04


# ------------------------------------------------------------------ the node's region files


def build_regions(root: Path, gpus: int, containers: int,
                  regions_dir: Path | None = None, policy: str = "strict"
                  ) -> list[dict[str, object]]:
    """Region directories (in `regions_dir`, else `root`) as Allocate leaves them on a full
    node: each GPU split into as many equal slices as it holds container-devices (its limits add
    up to 100 %); two containers in every `gpus` x `gpus` have a second GPU, the next one, so
    every GPU holds as many. The layout goes to `root/layout.json`."""
    from collections import defaultdict

    from tests.fakes.hostproc import FakeHostProc
    from tests.fakes.shimstate import DeviceSpec, make_region
    from vgpu_agent.gpu.sim import build_inventory
    from vgpu_agent.shm.regions import format_alloc_id

    inventory = build_inventory(f"{gpus}xA100-80GB")
    placed = []
    for n in range(containers):
        first = n % gpus
        placed.append([first, (first + 1) % gpus] if (n // gpus) % gpus == first else [first])
    per_gpu = Counter(d for devices in placed for d in devices)
    next_slice: dict[int, int] = defaultdict(int)
    layout_rows = []
    for n, devices in enumerate(placed):
        specs = [DeviceSpec(inventory[d].uuid, 4 * GIB, 100 / per_gpu[d], policy)
                 for d in devices]
        ids = []
        for d in devices:
            ids.append(f"{inventory[d].uuid}::{next_slice[d]}")
            next_slice[d] += 1
        seq = n + 1
        alloc_id = format_alloc_id(seq, ids, 1_000 + n)
        make_region(regions_dir or root, alloc_id, specs, ids, seq=seq)
        layout_rows.append(
            {"alloc_id": alloc_id, "devices": len(devices), "device_ids": ids,
             "host_pid": HOST_PID_BASE + n,
             "identity": ["bench", f"pod-{n // 2}", f"ctr-{n % 2}"]}
        )
    (root / "layout.json").write_text(json.dumps(layout_rows))
    # the host's /proc as the agent reads it for these processes beyond whose they are (the
    # simulated backend proves that): their start times, by which a placement is known to be
    # the same process's when a time-sliced GPU names it again
    host = FakeHostProc(root / "proc")
    for row in layout_rows:
        host.process(int(row["host_pid"]), start=1_000)
    return layout_rows


class ShimSide:
    """What the containers' shims do to `state`: one process each, wanting 5 million tokens a
    second (50 launches of 1,000 every 10 ms) and spending what its bucket lets through, by
    the rate and burst the agent wrote into `control`, as an honest shim does (the agent does
    not believe more: `throttle/audit.py`)."""

    DEMAND_PER_STEP = 50_000  # tokens wanted every 10 ms
    COST = 1_000  # tokens a launch

    def __init__(self, root: Path, rows: list[dict[str, object]],
                 clock: Callable[[], int] = time.monotonic_ns,
                 accounting: Accounting | None = None, idle_every: int = 0):
        from tests.fakes.shimstate import store_words
        from vgpu_agent.shm import layout

        # containers that hold their slices and never launch (notebooks between sessions): the
        # last of every `idle_every` (none with 0)
        self.idle = {n for n in range(len(rows)) if idle_every and n % idle_every == idle_every - 1}

        self.accounting = accounting  # the GPUs' drivers, told what was spent

        self.layout = layout
        self.store_words = store_words
        self.clock = clock  # the controller's, where it is not the monotonic one
        self.maps = []
        for row in rows:
            fd = os.open(root / str(row["alloc_id"]) / "state", os.O_RDWR)
            state = mmap.mmap(fd, 0)
            os.close(fd)
            fd = os.open(root / str(row["alloc_id"]) / "control", os.O_RDONLY)
            control = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            os.close(fd)
            self.maps.append((state, control, int(row["devices"]), int(row["host_pid"])))
        self.step = 0
        # steps a tick may spend after the last one: all of them on the controller's clock (the
        # bench moves the time), few where the counters move in real time (`moving`)
        self.catch_up_steps = 1_000
        self._lock = threading.Lock()  # `moving`'s thread and the bench's own calls
        self.started_ns = clock()
        # per (container, device): [tokens spent, launches, ns waited, bucket balance, ns of
        # its last refill, the rate found then] (the shims' own clock: 10 ms steps since the
        # start)
        self.totals = {(n, dev): [0, 0, 0, 0, 0, 0] for n, (_, _, devices, _)
                       in enumerate(self.maps) for dev in range(devices)}
        self.pods = {str(row["identity"][1]) for row in rows}  # type: ignore[index]
        self.device_ids = {str(i) for row in rows for i in row["device_ids"]}  # type: ignore[attr-defined]

    def _spend(self, control: mmap.mmap, dev: int, totals: list, steps: int,  # type: ignore[type-arg]
               idle: bool = False) -> None:
        """`steps` of 10 ms on one device, by the shim's own bucket rule (`shm.layout`, the
        twin of `bucket.h`): each step, the launches its balance admits, up to the demand
        (none where the container is `idle`)."""
        layout = self.layout
        per_step = 0 if idle else self.DEMAND_PER_STEP
        want = per_step * steps
        rate, burst, policy, core_limit = (
            layout.load_u64(control, layout.control_device_offset(dev, field))
            for field in ("rate", "burst", "policy", "core_limit"))
        step_ns = 10_000_000
        end_ns = self.step * step_ns
        if layout.is_unlimited(policy, core_limit, rate, burst):
            spent = want
            totals[3], totals[4] = burst, end_ns  # unlimited, the bucket stands full
            totals[5] = 0
        else:
            balance, last_ns, spent = totals[3], totals[4], 0
            # The rate found now was written some time since the last run: the steps before
            # the newest are spent at the lower of it and the one found then (a real shim
            # refills at each launch, at the rate in force at that moment).
            before = totals[5] if 0 < totals[5] < rate else rate
            totals[5] = rate
            # After a pause longer than the catch-up (on a real node: its process did not run),
            # the bucket refills up to its burst and the launches start again.
            for n in range(max(0, steps - self.catch_up_steps), steps):
                now_ns = end_ns - (steps - 1 - n) * step_ns
                balance, last_ns = layout.refill(balance, last_ns or now_ns, now_ns,
                                                 rate if n == steps - 1 else before, burst)
                if layout.admits(balance, self.COST, burst):
                    launches = min(per_step // self.COST, balance // self.COST)
                    balance = layout.spend(balance, launches * self.COST)
                    spent += launches * self.COST
            totals[3], totals[4] = balance, last_ns
        totals[0] += spent
        totals[1] += spent // self.COST
        totals[2] += (want - spent) * steps * step_ns // want if want else 0

    @contextlib.contextmanager
    def moving(self) -> Iterator[None]:
        """The counters move every SHIM_STEP_S in a thread of their own, whatever the bench
        does meanwhile (a real shim's move at every launch). A real shim counts a launch as it
        admits it; this thread, late by more than a step or two (the bench process busy on a
        loaded machine), is a shim whose process did not run meanwhile, not one that launched
        and counts it afterwards: caught up at once, it would claim more than the bucket let
        through between two reads, and the agent would rightly cut the claim."""
        stop = threading.Event()
        self.catch_up_steps = round(SHIM_STEP_S / 0.01) + 1

        def run() -> None:
            while not stop.wait(SHIM_STEP_S):
                self.tick()

        mover = threading.Thread(target=run, name="bench-shims", daemon=True)
        mover.start()
        try:
            yield
        finally:
            stop.set()
            mover.join()

    def tick(self) -> None:
        with self._lock:
            self._tick()

    def _tick(self) -> None:
        layout = self.layout
        # counters follow the clock, so the spending rate is the same however often this runs
        step = (self.clock() - self.started_ns) // 10_000_000
        steps, self.step = step - self.step, step
        now = time.monotonic_ns()
        slot = layout.STATE_OFFSETS["slots"]
        mark = layout.STATE_OFFSETS["slot_high_water"]
        fields, store_words = layout.STATE_DEVICE_OFFSETS, self.store_words
        # one 8-byte store a field, as the shim's atomics (`store_words`: the agent reads while
        # this thread writes, and a field written in parts can read as a total fallen to 0)
        for n, (buf, control, devices, host_pid) in enumerate(self.maps):
            layout.store_u64(buf, mark, 1)  # slot 0 claimed, as the shim marks it
            store_words(buf, slot, 100 + n, host_pid)
            for dev in range(devices):
                totals = self.totals[(n, dev)]
                if steps > 0:
                    self._spend(control, dev, totals, steps, n in self.idle)
                spent, launches, waited = totals[:3]
                base = slot + layout.SLOT_OFFSETS["devices"] + dev * layout.PROC_DEVICE_SIZE
                store_words(buf, base, GIB, launches, spent, waited, now)
                header = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
                store_words(buf, header + fields["memory_used"], GIB)
                # the totals the shim keeps in the header beside the slots
                store_words(buf, header + fields["tokens_spent"], spent)
                store_words(buf, header + fields["launches"], launches)
                store_words(buf, header + fields["wait_ns"], waited)
        if self.accounting is not None:
            self.accounting.update(self.totals)


def devices_on_gpus(rows: list[dict[str, object]]
                    ) -> dict[str, list[tuple[tuple[int, int], int]]]:
    """Per GPU, its (container, device) pairs and their processes, in the order `Accounting`
    writes them and `samples_from` reads them."""
    on_gpu: dict[str, list[tuple[tuple[int, int], int]]] = {}
    for n, row in enumerate(rows):
        device_ids: list[str] = row["device_ids"]  # type: ignore[assignment]
        pid: int = row["host_pid"]  # type: ignore[assignment]
        for dev, device_id in enumerate(device_ids):
            on_gpu.setdefault(device_id.split("::")[0], []).append(((n, dev), pid))
    return on_gpu


class Accounting:
    """The simulated GPUs' drivers: each sample period (1/6 s), each container's SM percent
    from the tokens its shim spent, as a real GPU's samples follow the work its processes
    launched: tokens a second over TOKENS_PER_PERCENT, in whole percent as NVML gives it.
    While shares change (`changing`), the work a token buys doubles every other 2 s for each
    container (on the GPUs in `changing_gpus` only, where it is a set), out of step with half
    the others: the same spend shows as twice the use, and the law must learn `k` anew.

    Kept here, beside the shims, and written per GPU into `directory/<uuid>` (the last HISTORY
    periods): the agent's fake NVML (`samples_from`) reads one small file per call, so that
    its process pays for the call, not for accounting a real driver does in the kernel."""

    HISTORY = 10
    RECORD = struct.Struct("<Q")  # a period's index, then one u16 per container on the GPU

    def __init__(self, directory: Path, rows: list[dict[str, object]],
                 clock: Callable[[], int] = time.time_ns):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.clock = clock  # ns, on NVML's clock (the wall clock, as a driver stamps)
        self.changing = False
        self.changing_gpus: set[str] | None = None  # None: all of them
        # While changing: 0, the work a token buys flips every other 2 s, half the containers
        # out of step with the others; else each container's flips every this many us, at a
        # moment of its own within that interval (its phases changing at its own pace).
        self.phase_every_us = 0
        # |exact use - limit| summed over container-device periods, and their count: how
        # closely the agent holds each to its share (`tracking`)
        self.error_sum = 0.0
        self.error_count = 0
        self.on_gpu = devices_on_gpus(rows)
        self.read_us = clock() // 1000
        self.period = self.read_us // SAMPLE_PERIOD_US
        self.spent: dict[tuple[int, int], int] = {}
        self.kept: dict[str, list[bytes]] = {uuid: [] for uuid in self.on_gpu}

    def per_percent(self, uuid: str, pid: int, stamp_us: int) -> float:
        if not self.changing or (self.changing_gpus is not None
                                 and uuid not in self.changing_gpus):
            return TOKENS_PER_PERCENT
        every = self.phase_every_us
        flips = ((stamp_us + pid * 7_919_000 % every) // every if every
                 else stamp_us // 2_000_000 + pid)
        return TOKENS_PER_PERCENT / 2 if flips % 2 else TOKENS_PER_PERCENT

    def tracking(self) -> tuple[float, int]:
        """(|use - limit| summed in points, container-device periods) so far: each period's
        exact use (not NVML's whole percents) against the device's limit, the GPU's share
        among the container-devices on it (the bench node's strict containers all want more
        than that)."""
        return self.error_sum, self.error_count

    def update(self, totals: dict[tuple[int, int], list[int]]) -> None:
        """After the shims moved: the periods that ended since the last call, each given the
        average use over that time."""
        now_us = self.clock() // 1000
        newest = now_us // SAMPLE_PERIOD_US
        if newest == self.period:
            return
        elapsed_s = max(1e-6, (now_us - self.read_us) / 1e6)
        ended = range(max(self.period + 1, newest - self.HISTORY + 1), newest + 1)
        for uuid, pairs in self.on_gpu.items():
            kept = self.kept[uuid]
            limit = 100 / len(pairs)
            for n in ended:
                uses = [(totals[pair][0] - self.spent.get(pair, totals[pair][0]))
                        / elapsed_s / self.per_percent(uuid, pid, n * SAMPLE_PERIOD_US)
                        for pair, pid in pairs]
                self.error_sum += sum([abs(min(100.0, use) - limit) for use in uses])
                self.error_count += len(uses)
                values = [min(100, round(use)) for use in uses]
                kept.append(self.RECORD.pack(n) + struct.pack(f"<{len(values)}H", *values))
            del kept[:-self.HISTORY]
            scratch = self.directory / f".{uuid}"
            scratch.write_bytes(b"".join(kept))
            os.replace(scratch, self.directory / uuid)  # never read half-written
        self.spent = {pair: totals[pair][0] for pair in totals}
        self.period, self.read_us = newest, now_us


# ------------------------------------------------------------------ the agent side (child)


def samples_from(directory: Path, rows: list[dict[str, object]], sliced: bool = False
                 ) -> Callable[[str, int], list[ProcessSample]]:
    """The per-process samples `Accounting` keeps for a GPU: those after `since_us` (the newest
    period only when 0), stamped at each period's end; none until its first periods end.
    `sliced`: as a time-sliced driver answers (`time_sliced`)."""
    from vgpu_agent.gpu.model import ProcessSample

    pids = {uuid: [pid for _, pid in pairs] for uuid, pairs in devices_on_gpus(rows).items()}

    def samples(uuid: str, since_us: int) -> list[ProcessSample]:
        on_gpu = pids.get(uuid, [])
        try:
            data = (directory / uuid).read_bytes()
        except FileNotFoundError:
            return []
        record = 8 + 2 * len(on_gpu)
        found = [(n, data[at + 8:at + record])
                 for at in range(0, len(data) - record + 1, record)
                 for n in Accounting.RECORD.unpack_from(data, at)]
        if not found:
            return []
        first = since_us // SAMPLE_PERIOD_US + 1 if since_us else found[-1][0]
        periods = [(n, struct.unpack(f"<{len(on_gpu)}H", values)) for n, values in found
                   if n >= first]
        if sliced:
            return time_sliced(uuid, on_gpu, periods)
        return [ProcessSample(pid, n * SAMPLE_PERIOD_US, value)
                for n, values in periods for pid, value in zip(on_gpu, values, strict=True)]

    return samples


def time_sliced(uuid: str, pids: list[int], periods: list[tuple[int, tuple[int, ...]]]
                ) -> list[ProcessSample]:
    """Periods' per-process uses as a time-sliced driver reports them (measured on an H200,
    driver 580; `throttle/timesliced.read_as_periods`): each period given to one process, drawn
    with odds in proportion to its use (the same draw for the same period, whoever asks), and
    one sample per process given any of them, stamped with the last, valued at the GPU's use
    in the periods it was given over all the periods asked for. An idle period goes to
    nobody."""
    from vgpu_agent.gpu.model import ProcessSample

    given: dict[int, tuple[int, float]] = {}  # pid -> (its last period, the use it was given)
    for n, values in periods:
        if not any(values):
            continue
        pid = random.Random(n * 1_000_003 + zlib.crc32(uuid.encode())).choices(
            pids, weights=values)[0]
        given[pid] = (n, given.get(pid, (0, 0.0))[1] + min(100, sum(values)))
    return [ProcessSample(pid, n * SAMPLE_PERIOD_US, round(use / len(periods)))
            for pid, (n, use) in given.items()]


def agent_config(root: Path, gpus: int, changing: bool, nvml_poll_periods: int | None = None,
                 policy: str = "strict") -> object:
    """The agent's configuration on the bench node: its defaults but for the paths, the
    simulated GPUs, the node's core policy (the bench's regions' own), while shares change a
    tick held at 100 ms, and NVML's poll periods where given (None: the agent's)."""
    from vgpu_agent.config import Config

    return Config(
        backend="sim",
        sim_gpus=f"{gpus}xA100-80GB",
        split_count=SPLIT,
        device_plugin_dir=str(root / "dp"),
        pod_resources_socket=str(root / "pr" / "kubelet.sock"),
        state_dir=str(root / "state"),
        host_proc_dir=str(root / "proc"),
        metrics_address="127.0.0.1:0",
        # Allocate's regions (nobody holds them) go at the next PodResources answer, as GC
        # does after its grace, so that the node keeps its size while Allocate is measured
        region_gc_grace_seconds=0,
        # as if something changed every tick: the cost of a controller that never calms down
        throttle_calm_slowdown=1 if changing else 4,
        core_policy=policy,
        **({} if nvml_poll_periods is None
           else {"throttle_nvml_poll_periods": nvml_poll_periods}),
    )


def cpu_burner(ms: float) -> Callable[[], None]:
    """Something that takes about `ms` of one core without holding the GIL, as an NVML call
    does in C (hashlib hashes large buffers with the GIL released)."""
    if ms <= 0:
        return lambda: None
    data = bytes(1 << 20)
    started, rounds = time.thread_time(), 0
    while time.thread_time() - started < 0.05:
        hashlib.sha256(data).digest()
        rounds += 1
    per_ms = rounds * len(data) / ((time.thread_time() - started) * 1000)
    chunk = bytes(int(per_ms * ms))

    def burn() -> None:
        hashlib.sha256(chunk).digest()

    return burn


async def serve(root: Path, gpus: int, port_file: Path, changing: bool = False,
                reference_law: bool = False, nvml_call_ms: float = 0.0,
                nvml_poll_periods: int | None = None, policy: str = "strict",
                sliced: bool = False
                ) -> None:
    """The whole agent, as `vgpu-agent run` composes it (`Agent` on its own event loop), on
    simulated GPUs whose per-process samples are the containers' and whose processes belong to
    their containers (what /proc proves on a real node)."""
    import structlog

    from vgpu_agent.agent import Agent
    from vgpu_agent.gpu.sim import SimBackend

    # warnings too: a claim the agent cuts (`throttle_tokens_overclaimed`) is then named with
    # its numbers when the bench stops at its check that the fake shims were believed
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    rows = json.loads((root / "layout.json").read_text())
    backend = SimBackend(f"{gpus}xA100-80GB")
    owner = {int(row["host_pid"]): str(row["alloc_id"]) for row in rows}
    read = samples_from(root / "nvml", rows, sliced)
    burn = cpu_burner(nvml_call_ms)

    def samples(uuid: str, since_us: int) -> list[ProcessSample]:
        burn()  # what the call costs on a real driver, whatever it returns
        return read(uuid, since_us)

    backend.set_sample_source(samples)
    backend.set_process_owner(owner.get)
    agent = Agent(agent_config(root, gpus, changing, nvml_poll_periods,  # type: ignore[arg-type]
                               policy),
                  backend=backend)
    if reference_law:
        from vgpu_agent.throttle.control import control_step

        agent.controller.law = control_step
    run = asyncio.create_task(agent.run())
    serving = asyncio.create_task(agent.serving.wait())
    await asyncio.wait([run, serving], return_when=asyncio.FIRST_COMPLETED)
    if run.done():
        run.result()  # the agent failed to start: say why
        raise SystemExit("the agent stopped before serving")
    port_file.write_text(str(agent.metrics.port))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, agent.stop)
    await run


async def kubelet_side(root: Path, ready_file: Path) -> None:
    """The kubelet, in its own process: the agent registers with it, and its PodResources
    lists the bench's containers (admitted before the agent started, as after an agent
    restart), so that the agent binds each region to its container and collects the rest."""
    from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2
    from vgpu_agent.kubelet.standin import Admission, KubeletStandIn

    (root / "dp").mkdir(exist_ok=True)
    kubelet = KubeletStandIn(str(root / "dp"), str(root / "pr" / "kubelet.sock"))
    for row in json.loads((root / "layout.json").read_text()):
        namespace, pod, container = row["identity"]
        kubelet.admissions.append(Admission(namespace, pod, container, "nvidia.com/gpu",
                                            list(row["device_ids"]),
                                            api_pb2.ContainerAllocateResponse()))
    await kubelet.start()
    ready_file.write_text("ready")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await kubelet.stop()


# ------------------------------------------------------------------ measuring (parent)


def rss_mb(pid: int) -> tuple[float, float]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


# what Prometheus 2.x sends with every scrape
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(port: int, accept: str = "", gzipped: bool = False) -> tuple[float, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if accept:
        request.add_header("Accept", accept)
    if gzipped:
        request.add_header("Accept-Encoding", "gzip")
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return (time.perf_counter() - started) * 1000, body


def check_bound(body: bytes, pods: set[str], policy: str = "strict") -> None:
    """Figures of an agent that is not doing its job say nothing: every container's pod must be
    named (PodResources bound its region) with its utilization (its samples attributed), and
    under the core policy the bench asked for."""
    named = {m.decode() for m in re.findall(
        rb'vgpu_container_core_utilization_ratio\{[^}]*pod="([^"]+)"', body)}
    if named != pods:
        raise SystemExit(f"the agent names {len(named)} of {len(pods)} pods with their "
                         f"utilization; missing e.g. {sorted(pods - named)[:3]}")
    in_force = {m.decode() for m in re.findall(
        rb'vgpu_container_core_policy_info\{[^}]*policy="([^"]+)"[^}]*\} 1', body)}
    if in_force != {policy}:
        raise SystemExit(f"the agent's containers run under {sorted(in_force)}, not {policy!r}")
    # and the bench's shims are honest ones: the agent believed every token they claimed
    cut = re.search(rb'vgpu_region_events_total\{[^}]*event="tokens_overclaimed"[^}]*\} (\S+)',
                    body)
    if cut is None or float(cut.group(1)) != 0:
        raise SystemExit("the agent cut the bench shims' token claims "
                         f"({cut.group(1).decode() if cut else 'no count exported'}): they "
                         "spend more than their buckets let through (the agent's "
                         "throttle_tokens_overclaimed warning above says by how much)")
    # and their use follows their rates: none was capped for use above its target
    over = re.search(rb'vgpu_region_events_total\{[^}]*event="use_over_target"[^}]*\} (\S+)',
                     body)
    if over is None or float(over.group(1)) != 0:
        raise SystemExit("the agent capped honest bench containers for use above their targets "
                         f"({over.group(1).decode() if over else 'no count exported'}; the "
                         "agent's throttle_use_over_target warning above names the first)")


def pct(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted values (of 100, the 99th is the second largest)."""
    return ordered[max(0, min(len(ordered), math.ceil(len(ordered) * q - 1e-9)) - 1)]


def free_device_ids(gpus: int, held: set[str]) -> list[str]:
    """The slices the agent advertises that no container holds: what Allocate asks for. A
    kubelet never asks for one in use, and a region made for a device a listed container holds
    is the newer allocation of it, so the agent would rightly bind that container's pod to it
    until it is collected."""
    from vgpu_agent.gpu.sim import build_inventory

    return [f"{gpu.uuid}::{n}" for gpu in build_inventory(f"{gpus}xA100-80GB")
            for n in range(SPLIT) if f"{gpu.uuid}::{n}" not in held]


def measure_allocate(args: argparse.Namespace, shim: ShimSide, port: int, plugin: Path,
                     bare: Path) -> dict:
    """Allocate against the agent side and the bare server, alternating, with scrapes."""
    import grpc

    from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

    ids = free_device_ids(args.gpus, shim.device_ids)
    rng = random.Random(7)
    stop = threading.Event()
    scrapes = [0]

    def scraper() -> None:
        while not stop.wait(args.allocate_scrape_s):
            scrape(port, PROMETHEUS_ACCEPT, gzipped=True)
            scrapes[0] += 1

    agent_ms: list[float] = []
    bare_ms: list[float] = []
    with grpc.insecure_channel(f"unix:{plugin}") as agent_channel, \
            grpc.insecure_channel(f"unix:{bare}") as bare_channel:
        calls = [(api_pb2_grpc.DevicePluginStub(agent_channel).Allocate, agent_ms),
                 (api_pb2_grpc.DevicePluginStub(bare_channel).Allocate, bare_ms)]
        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        next_tick = time.monotonic()
        try:
            for i in range(args.allocates + ALLOCATE_WARMUP):
                if time.monotonic() >= next_tick:  # the containers' counters keep moving
                    shim.tick()
                    next_tick = time.monotonic() + SHIM_STEP_S
                request = api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=rng.sample(ids, rng.choice((1, 2))))
                ])
                for call, sink in (calls if i % 2 else calls[::-1]):
                    started = time.perf_counter()
                    call(request, timeout=10)
                    if i >= ALLOCATE_WARMUP:
                        sink.append((time.perf_counter() - started) * 1000)
                time.sleep(ALLOCATE_PAIR_S)
        finally:
            stop.set()
            thread.join()
    agent_ms.sort()
    bare_ms.sort()
    return {
        "alloc_p50_ms": statistics.median(agent_ms),
        "alloc_p99_ms": pct(agent_ms, 0.99),
        "bare_p50_ms": statistics.median(bare_ms),
        "bare_p99_ms": pct(bare_ms, 0.99),
        "alloc_p99_ratio": pct(agent_ms, 0.99) / pct(bare_ms, 0.99),
        "alloc_scrapes": scrapes[0],
    }


def pause_with_shim(shim: ShimSide, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        shim.tick()
        time.sleep(SHIM_STEP_S)


def start_child(args: list[str], ready: Path, what: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, __file__, *args], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)
    return child


def stop_child(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


@contextlib.contextmanager
def running_node(root: Path, gpus: int, changing: bool = False, reference_law: bool = False,
                 nvml_call_ms: float = 0.0, nvml_poll_periods: int | None = None,
                 policy: str = "strict",
                 sliced: bool = False) -> Iterator[tuple[subprocess.Popen, int]]:
    """The kubelet stand-in and the whole agent, each in its own process, on the node built in
    `root`: yields the agent's process and its metrics port once it serves."""
    config = f"{int(changing)}-{int(reference_law)}-{int(sliced)}"
    port_file = root / f"port-{config}"
    kubelet_ready = root / f"kubelet-{config}"
    kubelet = start_child(["--kubelet", "--root", str(root), "--port-file", str(kubelet_ready)],
                          kubelet_ready, "the kubelet stand-in")
    try:
        child = start_child(
            ["--serve", "--root", str(root), "--gpus", str(gpus),
             *(["--changing"] if changing else []),
             *(["--reference-law"] if reference_law else []),
             *(["--time-sliced"] if sliced else []),
             "--nvml-call-ms", str(nvml_call_ms),
             *([] if nvml_poll_periods is None
               else ["--nvml-poll-periods", str(nvml_poll_periods)]),
             "--policy", policy, "--port-file", str(port_file)],
            port_file, "the agent")
        try:
            yield child, int(port_file.read_text())
        finally:
            stop_child(child)
            port_file.unlink()  # a later configuration of the same kind waits for its own
    finally:
        stop_child(kubelet)
        kubelet_ready.unlink()


def measure(args: argparse.Namespace, root: Path, shim: ShimSide, changing: bool = False,
            reference_law: bool = False, bare: Path | None = None,
            changing_gpus: int = 0, sliced: bool = False) -> dict:
    """One configuration. `changing`: every container's `k` changes and the agent's tick is
    held at 100 ms; `changing_gpus`: the containers of that many GPUs change, the agent runs
    at its own pace (as steady); `sliced`: the drivers sample as time-sliced ones do."""
    if shim.accounting is not None:
        shim.accounting.changing = changing or changing_gpus > 0
        shim.accounting.changing_gpus = (
            set(sorted(shim.accounting.on_gpu)[:changing_gpus]) if changing_gpus else None)
    with running_node(root, args.gpus, changing, reference_law, args.nvml_call_ms,
                      args.nvml_poll_periods, args.policy, sliced) as (child, port):
        return measure_agent(args, shim, child, port, root / "dp" / "vgpu-agent.sock",
                             changing, bare, sliced)


def series_sum(port: int, name: str) -> float | None:
    """A metric's series summed over the agent's GPUs as a scrape shows them; None where it
    has none."""
    found = re.findall(rb"%s\{[^}]*\} (\S+)" % re.escape(name.encode()), scrape(port)[1])
    return sum(float(v) for v in found) if found else None


def solo_turns(port: int) -> float:
    """The turns alone the agent has given, over all its GPUs (its own counter)."""
    return series_sum(port, "vgpu_gpu_throttle_solo_turns_total") or 0.0


def wait_first_turns(args: argparse.Namespace, shim: ShimSide, child: subprocess.Popen,
                     port: int) -> dict:
    """On time-sliced drivers: waits, window by window (`--seconds`), until a window in which
    the agent gave no turn alone, or `--first-turns-most` seconds: each container's first
    turns (and retries) come over minutes, and a window among them is no steady state. What
    the wait took, the turns given, the agent's CPU over it, and whether it ended calm."""
    started, turns, before = time.monotonic(), solo_turns(port), cpu_seconds(child.pid)
    calm = False
    while time.monotonic() - started < args.first_turns_most:
        pause_with_shim(shim, args.seconds)
        now = solo_turns(port)
        calm, turns = now == turns, now
        if calm:
            break
    waited = time.monotonic() - started
    return {"first_turns_s": waited, "first_turns": turns, "first_turns_calm": calm,
            "first_turns_cpu_s_per_min": (cpu_seconds(child.pid) - before) / waited * 60}


def measure_agent(args: argparse.Namespace, shim: ShimSide, child: subprocess.Popen, port: int,
                  plugin: Path, changing: bool, bare: Path | None, sliced: bool = False) -> dict:
    # caches filled, imports done; a steady controller settled and slowed down
    pause_with_shim(shim, args.settle if not changing else 3.0)
    first_turns = wait_first_turns(args, shim, child, port) if sliced and not changing else {}
    scrape(port)

    before = cpu_seconds(child.pid)
    pause_with_shim(shim, args.seconds)
    idle_cpu = (cpu_seconds(child.pid) - before) / args.seconds * 60

    # Two scrapes first, so that the agent has learned the rhythm (its region round comes
    # just before each scrape) and the window holds one round per scrape, as under a
    # Prometheus that has been scraping for a while.
    for _ in range(2):
        scrape(port)
        pause_with_shim(shim, args.interval)
    before = cpu_seconds(child.pid)
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        scrape(port)
        pause_with_shim(shim, args.interval)
    scraped_cpu = (cpu_seconds(child.pid) - before) / (time.monotonic() - started) * 60

    latencies, body = [], b""
    before = cpu_seconds(child.pid)
    for _ in range(args.scrapes):
        shim.tick()
        took, packed = scrape(port, PROMETHEUS_ACCEPT, gzipped=True)
        latencies.append(took)
    cpu_per_scrape_ms = (cpu_seconds(child.pid) - before) / args.scrapes * 1000
    allocate = {}
    if bare is not None:
        allocate = measure_allocate(args, shim, port, plugin, bare)
    _, body = scrape(port)
    check_bound(body, shim.pods, args.policy)
    _, om_body = scrape(port, "application/openmetrics-text; version=1.0.0")
    rss, peak = rss_mb(child.pid)
    latencies.sort()
    return {
        **allocate,
        **first_turns,
        "idle_cpu_s_per_min": idle_cpu,
        "scraped_cpu_s_per_min": scraped_cpu,
        "p50_ms": statistics.median(latencies),
        "p99_ms": pct(latencies, 0.99),
        "cpu_per_scrape_ms": cpu_per_scrape_ms,
        "bytes": len(body),
        "gzip_bytes": len(packed),
        "om_bytes": len(om_body),
        "series": sum(1 for line in body.splitlines() if line and not line.startswith(b"#")),
        "rss_mb": rss,
        "peak_rss_mb": peak,
    }


def containers_for(devices: int) -> int:
    """Containers whose devices (every 8th has two) add up to about `devices`."""
    return max(1, round(devices * 8 / 9))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--sizes", default="16,64,144,256", help="container-devices, comma list")
    parser.add_argument("--seconds", type=float, default=30.0, help="each steady-state window")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape interval, s")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="steady controller: seconds from start to the first window")
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--allocates", type=int, default=600,
                        help="Allocate calls (and as many bare calls) per configuration; 0: none")
    parser.add_argument("--allocate-scrape-s", type=float, default=0.5,
                        help="scrape interval while Allocate is measured, s")
    parser.add_argument("--nvml-call-ms", type=float, default=0.0,
                        help="CPU each per-process utilization call takes, with the GIL "
                             "released (an H200 with driver 580: about 2.2 ms through "
                             "pynvml's two driver calls, which the agent makes one; default: "
                             "none)")
    parser.add_argument("--nvml-poll-periods", type=int,
                        help="the agent's throttle_nvml_poll_periods: NVML asked once every "
                             "this many sample periods (default: the agent's)")
    parser.add_argument("--policy", choices=("strict", "work-conserving"), default="strict",
                        help="every container's core policy (its region's and the node's "
                             "core_policy)")
    parser.add_argument("--changing-gpus", type=int, default=0,
                        help="also measure the agent at its own pace while the containers of "
                             "this many GPUs change (the rest steady)")
    parser.add_argument("--idle-every", type=int, default=0,
                        help="the last container of every N never launches (it holds its "
                             "slices, as a notebook between sessions does); 0: none")
    parser.add_argument("--time-sliced", action="store_true",
                        help="also measure the agent on drivers that give each sample period "
                             "whole to one process (an H200 without MPS), steady and changing")
    parser.add_argument("--first-turns-most", type=float, default=600.0,
                        help="time-sliced, steady: seconds at most to wait for a window without "
                             "a turn alone before measuring")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kubelet", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--changing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-law", action="store_true",
                        help="also measure the controller running the reference law")
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.first_turns_most < math.inf:
        parser.error(f"--first-turns-most must be a number of seconds > 0, got "
                     f"{args.first_turns_most!r}")
    if args.serve:
        from vgpu_agent.agent import SlackEventLoop  # the loop `vgpu-agent run` runs on

        with asyncio.Runner(loop_factory=SlackEventLoop) as runner:
            runner.run(serve(args.root, args.gpus, args.port_file, args.changing,
                             args.reference_law, args.nvml_call_ms, args.nvml_poll_periods,
                             args.policy, args.time_sliced))
        return 0
    if args.kubelet:
        asyncio.run(kubelet_side(args.root, args.port_file))
        return 0

    from tests.bench import machine

    load_before = os.getloadavg()[0]
    print(f"{machine.describe()}, {args.gpus} GPUs, "
          f"windows {args.seconds:g} s, {args.scrapes} scrapes, {args.allocates} Allocate calls, "
          f"NVML per-process call {args.nvml_call_ms:g} ms of CPU, containers {args.policy}"
          + (f", every {args.idle_every}th idle" if args.idle_every else ""))
    configs: tuple[tuple[str, bool, bool, int, bool], ...] = (
        ("steady", False, False, 0, False), ("changing", True, False, 0, False))
    if args.changing_gpus:
        configs += ((f"{args.changing_gpus} GPU changing", False, False, args.changing_gpus,
                     False),)
    if args.reference_law:  # the same, with the reference law, side by side
        configs += (("ref law", False, True, 0, False), ("ref, changing", True, True, 0, False))
    if args.time_sliced:
        configs += (("sliced", False, False, 0, True), ("sliced, changing", True, False, 0, True))
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as bare_dir:
        bare = start_bare(Path(bare_dir)) if args.allocates > 0 else None
        try:
            for size in (int(v) for v in args.sizes.split(",")):
                report_size(args, configs, size, bare[1] if bare is not None else None)
        finally:
            if bare is not None:
                bare[0].terminate()
                bare[0].wait()
    print(f"\nload average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after")
    return 0


def start_bare(directory: Path) -> tuple[subprocess.Popen, Path]:
    """bench_plugin.py's bare server: the same RPC answered empty, in its own process."""
    from tests.bench.bench_plugin import BARE_SERVER

    socket = directory / "bare.sock"
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(socket)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the bare gRPC server did not start")
        time.sleep(0.05)
    return proc, socket


def report_size(args: argparse.Namespace,
                configs: tuple[tuple[str, bool, bool, int, bool], ...],
                size: int, bare: Path | None) -> None:
    from vgpu_agent.shm.regions import REGIONS_DIR

    # short: the agent's and the kubelet's unix sockets live under it
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        root = Path(tmp)
        regions = root / "state" / REGIONS_DIR
        regions.mkdir(parents=True)
        rows = build_regions(root, args.gpus, containers_for(size), regions, args.policy)
        shim = ShimSide(regions, rows, accounting=Accounting(root / "nvml", rows),
                        idle_every=args.idle_every)
        with shim.moving():
            results = {name: measure(args, root, shim, changing, reference, bare, gpus, sliced)
                       for name, changing, reference, gpus, sliced in configs}
    devices = sum(int(r["devices"]) for r in rows)
    print(f"\n{len(rows)} containers, {devices} container-devices; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'':40}" + "".join(f"{name:>16}" for name in results))
    rows_out = [
        ("scrape p50 (ms)", "p50_ms", "{:.1f}"),
        ("scrape p99 (ms)", "p99_ms", "{:.1f}"),
        ("agent CPU per scrape (ms)", "cpu_per_scrape_ms", "{:.1f}"),
        ("exposition (bytes, as scraped: OM+gzip)", "gzip_bytes", "{:,}"),
        ("samples per scrape", "series", "{:,}"),
        ("agent CPU % of a core, no scrapes", "idle_cpu_s_per_min", "{:.2f}"),
        (f"agent CPU % of a core, scrape/{args.interval:g}s", "scraped_cpu_s_per_min",
         "{:.2f}"),
        ("agent RSS (MB)", "rss_mb", "{:.1f}"),
    ]
    if bare is not None:
        rows_out += [
            ("Allocate p50 (ms)", "alloc_p50_ms", "{:.2f}"),
            ("Allocate p99 (ms)", "alloc_p99_ms", "{:.2f}"),
            ("bare call p50 (ms)", "bare_p50_ms", "{:.2f}"),
            ("bare call p99 (ms)", "bare_p99_ms", "{:.2f}"),
            ("Allocate p99 / bare p99", "alloc_p99_ratio", "x{:.2f}"),
            ("scrapes during the Allocate calls", "alloc_scrapes", "{:d}"),
        ]
    for label, key, fmt in rows_out:
        scale = 100 / 60 if key.endswith("s_per_min") else 1
        print(f"{label:40}" + "".join(
            f"{fmt.format(r[key] * scale if scale != 1 else r[key]):>16}"
            for r in results.values()))
    steady, changing = results["steady"], results["changing"]
    print(f"  goals: steady CPU {steady['scraped_cpu_s_per_min'] / 60 * 100:.2f} % "
          f"(<= {GOAL_CPU_PERCENT}), changing {changing['scraped_cpu_s_per_min'] / 60 * 100:.2f}"
          f" % (<= {GOAL_CHANGING_CPU_PERCENT}), scrape p99 "
          f"{max(r['p99_ms'] for r in results.values()):.1f} ms (<= {GOAL_P99_MS:g})"
          + (f", Allocate p99 x{steady['alloc_p99_ratio']:.2f} steady, "
             f"x{changing['alloc_p99_ratio']:.2f} changing (<= x{GOAL_ALLOCATE_RATIO:g})"
             if bare is not None else ""))
    if "sliced" in results:
        sliced, sliced_changing = results["sliced"], results["sliced, changing"]
        print(f"  time-sliced: steady CPU {sliced['scraped_cpu_s_per_min'] / 60 * 100:.2f} % "
              f"(<= {GOAL_CPU_PERCENT}), changing "
              f"{sliced_changing['scraped_cpu_s_per_min'] / 60 * 100:.2f} % "
              f"(<= {GOAL_CHANGING_CPU_PERCENT})"
              + (f", Allocate p99 x{sliced['alloc_p99_ratio']:.2f} steady, "
                 f"x{sliced_changing['alloc_p99_ratio']:.2f} changing"
                 if bare is not None else ""))
        print(f"  time-sliced, steady: measured after {sliced['first_turns_s']:.0f} s of first "
              f"turns ({sliced['first_turns']:.0f} turns alone given by then; "
              + ("a window without one" if sliced["first_turns_calm"] else
                 f"still coming at --first-turns-most {args.first_turns_most:g} s")
              + f"), the agent at {sliced['first_turns_cpu_s_per_min'] / 60 * 100:.2f} % of a "
              f"core meanwhile, no scrapes")


if __name__ == "__main__":
    raise SystemExit(main())

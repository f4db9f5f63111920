"""A discrete-time model of one GPU shared by containers (1 ms steps by default).

Each simulated process launches kernels of one kind (duration alone on the GPU, occupancy, token
cost, grid size) whenever its launch queue has room and its launch gate admits them. The gate is
the shim's token rule on a region (`ShimGate`) or the peer model (`peer.PeerGate`). Kernels of
different processes time-share the GPU: every step the busy processes split the step equally
(what the driver's time-slicing does between contexts), and a process with less queued work than
its slice leaves the rest to the others. A process's SM time is the GPU time it held times the
occupancy of its kernels. The shim charges a launch when it admits it, and the kernel runs when
the queue reaches it: with `Workload.queue_s` of work queued (10 ms of its kernels by default; a
framework running ahead of the GPU queues as much or more) a process's SM time lags its spending,
by the queue over its share (0.1 s at 10 %), and most after a spell unthrottled, when every queue
is full. The controller's law sees that lag as noise: with exact readings ten new containers
still take 1.9 s to settle, against the bound's 0.9 s on an ideal plant, the drain after their
unthrottled tick part of it (BENCHMARKS.md). A hostile process (`Workload.alone_kernel_s`) runs
lighter (or heavier) kernels for the same tokens whenever no other process has held the GPU for
a while, as a tenant gaming the controller's turns alone would, or other ones each time
(`alone_kernels_s`).

NVML's view: every `sample_period_s` each process with a context gets one sample whose `sm_util`
is its integer SM percent over that period, stamped with the period's end; readers see only
finished periods, so what they read describes the recent past, like the real driver's samples.

A real GPU is not that tidy: `imperfections.Imperfections` adds NVML noise, missed samples and
longer sampling windows, kernel duration jitter, context switch costs, partially overlapping
contexts and small grids that pack unevenly; its module note gives the defaults and why.
`imperfections.IDEAL` turns all of it off for comparison. Randomness comes from a generator
seeded by the GPU's UUID and `seed`, so a run repeats exactly.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vgpu_agent.gpu.model import GpuError, ProcessSample
from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.simulation import tokens
from vgpu_agent.simulation.imperfections import REAL, Imperfections
from vgpu_agent.simulation.region import ProcessCounters, SimRegion

if TYPE_CHECKING:
    from vgpu_agent.throttle.attribution import RegionMarks

NVML_ERROR_NOT_SUPPORTED = 3  # pynvml's code, repeated so the pure simulator needs no pynvml
START_NS = 1_000 * tokens.NS_PER_S  # a monotonic clock never starts at zero


@dataclass(frozen=True)
class Workload:
    """One process's kernels and when it runs them."""

    kernel_s: float  # duration of one kernel alone on the GPU
    blocks: int = 1024
    threads_per_block: int = 256
    occupancy: float = 1.0  # fraction of the SMs a kernel keeps busy
    queue_s: float = 0.01  # how much work the process keeps queued ahead of the GPU
    busy: tuple[tuple[float, float], ...] = ((0.0, math.inf),)  # [start, end) seconds
    streams: int = 1  # kernels of the process that may run at once when their grids leave room
    # A tenant gaming a turn alone: kernels this long (same grid, so the same tokens a launch)
    # while no other process has held the GPU for `alone_after_s`, which it can tell from its
    # own kernels finishing sooner. None: an honest process, whose kernels never change. (Grids
    # that pack several kernels at once are counted resident by `kernel_s`, not by these.)
    alone_kernel_s: float | None = None
    alone_after_s: float = 0.02
    # ... or, varying from one time alone to the next, these in turn (one per time it finds
    # itself alone; overrides `alone_kernel_s`)
    alone_kernels_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.kernel_s > 0:
            raise ValueError(f"kernel duration must be > 0 s, got {self.kernel_s!r}")
        if self.blocks < 1 or self.threads_per_block < 1:
            raise ValueError(
                f"blocks and threads per block must be >= 1, got {self.blocks}, "
                f"{self.threads_per_block}"
            )
        if not 0 < self.occupancy <= 1:
            raise ValueError(f"occupancy must be in (0, 1], got {self.occupancy!r}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams!r}")
        if self.alone_kernel_s is not None and not self.alone_kernel_s > 0:
            raise ValueError(f"kernel duration alone must be > 0 s or None, got "
                             f"{self.alone_kernel_s!r}")
        if not self.alone_after_s >= 0:
            raise ValueError(f"alone_after_s must be >= 0 s, got {self.alone_after_s!r}")
        if not all(kernel_s > 0 for kernel_s in self.alone_kernels_s):
            raise ValueError(f"kernel durations alone must all be > 0 s, got "
                             f"{self.alone_kernels_s!r}")

    @property
    def cost(self) -> int:
        """What the shim charges per launch: blocks x threads per block."""
        return self.blocks * self.threads_per_block

    def busy_at(self, t_s: float) -> bool:
        return any(start <= t_s < end for start, end in self.busy)

    def next_change(self, t_s: float) -> float:
        """The first moment after `t_s` when `busy_at` may change."""
        edges = [edge for interval in self.busy for edge in interval if edge > t_s]
        return min(edges, default=math.inf)


class LaunchGate(Protocol):
    def admit(self, now_ns: int, want: int) -> int:
        """How many of `want` launches run now (the rest wait)."""


class NoShim:
    """A process launching without the shim (a stranger, or a tenant that bypasses it): every
    launch it wants runs at once."""

    def admit(self, now_ns: int, want: int) -> int:
        return want


class ShimGate:
    """The shim's token rule on one device of a region: refill, admit, spend, bounded waits."""

    def __init__(self, region: SimRegion, dev: int, slot: ProcessCounters, cost: int):
        self.region, self.dev, self.slot, self.cost = region, dev, slot, cost
        self.blocked_until_ns = 0
        self.waiting_since_ns = -1

    def _unlimited(self, policy: CorePolicy, limit: float, rate: int, burst: int) -> bool:
        return policy == "off" or limit >= 100 or (rate == 0 and burst == 0)

    def admit(self, now_ns: int, want: int) -> int:
        region, dev, cost = self.region, self.dev, self.cost
        rate, burst = region.rates[dev]
        if self._unlimited(region.policies[dev], region.core_limits[dev], rate, burst):
            region.last_refill_ns[dev], self.waiting_since_ns = now_ns, -1
            region.balances[dev] = burst
            return self._record(now_ns, want)
        if now_ns < self.blocked_until_ns:
            return 0
        balance, region.last_refill_ns[dev] = tokens.refill(
            region.balances[dev], region.last_refill_ns[dev] or now_ns, now_ns, rate, burst
        )
        admitted = 0
        if tokens.admits(balance, cost, burst):
            admitted = min(want, balance // cost) if cost <= burst else 1
            balance = tokens.spend(balance, cost * admitted)
        elif self.waiting_since_ns >= 0 and now_ns - self.waiting_since_ns >= tokens.MAX_WAIT_NS:
            admitted = 1  # waited as long as the shim ever waits: runs anyway, in debt
            balance = tokens.spend(balance, cost)
        region.balances[dev] = balance
        if admitted < want:
            if admitted or self.waiting_since_ns < 0:
                self.waiting_since_ns = now_ns
            need = tokens.wait_ns_for(balance, cost, rate, burst)
            sleep = max(1, min(need, tokens.MAX_SLEEP_NS))
            self.blocked_until_ns = now_ns + sleep
            self.slot.wait_ns[dev] += sleep
        else:
            self.waiting_since_ns = -1
        return self._record(now_ns, admitted)

    def _record(self, now_ns: int, admitted: int) -> int:
        if admitted:
            slot, dev = self.slot, self.dev
            slot.launches[dev] += admitted
            slot.tokens_spent[dev] += admitted * self.cost
            slot.last_launch_ns[dev] = now_ns
        return admitted


@dataclass(eq=False)
class SimProcess:
    name: str
    pid: int
    workload: Workload
    gate: LaunchGate
    queued_s: float = 0.0
    window_sm_s: float = 0.0  # SM time in the current NVML sample period
    window_launches: int = 0  # launches admitted in the current NVML sample period
    total_sm_s: float = 0.0  # ground truth, cumulative
    bins: list[float] = field(default_factory=list)  # SM seconds per recording bin
    busy: bool = False  # whether the workload is in a busy interval, valid until `recheck_s`
    recheck_s: float = -1.0
    fill: float = 1.0  # fraction of the SMs one of its kernels occupies (grid / SMs)
    packable: int = 1  # how many of its kernels fit on the GPU at once
    recent_sm_s: deque[float] = field(default_factory=deque)  # per finished sample period
    last_ran_ns: int = -1  # the last step it held the GPU (-1: never)
    alone_times: int = 0  # times it found itself alone (a gaming workload's)
    was_alone: bool = False


class SimGpu:
    """One simulated GPU. `advance` moves time; the samples and ground truth are read after."""

    def __init__(
        self,
        uuid: str,
        *,
        step_s: float = 0.001,
        sample_period_s: float = 1 / 6,
        bin_s: float = 0.1,
        per_process_samples: bool = True,
        sample_history_s: float = 5.0,
        start_ns: int = START_NS,
        imperfections: Imperfections = REAL,
        seed: int = 0,
    ):
        if not 0 < step_s <= 0.01:
            raise ValueError(f"step must be in (0, 10 ms], got {step_s!r}")
        if not 0 < sample_period_s <= 2:
            raise ValueError(f"NVML sample period must be in (0, 2] s, got {sample_period_s!r}")
        self.imperfections = imperfections
        self.rng = random.Random(f"{uuid}/{seed}")
        self.uuid = uuid
        self.step_ns = round(step_s * tokens.NS_PER_S)
        self.sample_ns = round(sample_period_s * tokens.NS_PER_S)
        self.bin_ns = round(bin_s * tokens.NS_PER_S)
        self.per_process_samples = per_process_samples
        self.start_ns = self.now_ns = start_ns
        self.processes: list[SimProcess] = []
        self._samples: deque[ProcessSample] = deque()
        # time-sliced attribution: each period's values per pid since the driver was last
        # asked (`process_utilization` turns them into one sample per process)
        self._unread: list[tuple[int, dict[int, int]]] = []
        # periods sampled but not readable yet (`Imperfections.sample_lag_s`): (readable at,
        # stamp, values per pid)
        self._pending: deque[tuple[int, int, dict[int, int]]] = deque()
        self._history_ns = round(sample_history_s * tokens.NS_PER_S)
        self._next_sample_ns = start_ns + self.sample_ns
        self._next_bin_ns = start_ns + self.bin_ns
        self._next_pid = 10_000
        self.containers: dict[int, str] = {}  # pid -> alloc_id of the container it runs in

    @property
    def elapsed_s(self) -> float:
        return (self.now_ns - self.start_ns) / tokens.NS_PER_S

    def add_process(self, name: str, workload: Workload, gate: LaunchGate,
                    pid: int | None = None) -> SimProcess:
        if pid is None:
            pid = self._next_pid
            self._next_pid += 1
        past_bins = (self._next_bin_ns - self.start_ns) // self.bin_ns - 1
        proc = SimProcess(name, pid, workload, gate, bins=[0.0] * past_bins)
        sms = self.imperfections.sm_count
        if sms:
            proc.fill = min(1.0, workload.blocks / sms)
            proc.packable = max(1, min(workload.streams, int(1 / proc.fill + 1e-9)))
        self.processes.append(proc)
        return proc

    def shim_process(self, name: str, workload: Workload, region: SimRegion, dev: int = 0,
                     pid: int | None = None, report_host_pid: bool = True) -> SimProcess:
        """A process whose launches go through the shim's rule on `region`'s device `dev`."""
        if pid is None:
            pid = self._next_pid
            self._next_pid += 1
        slot = region.add_process(pid=pid, host_pid=pid if report_host_pid else 0)
        self.containers[pid] = region.alloc_id
        return self.add_process(name, workload, ShimGate(region, dev, slot, workload.cost), pid)

    def advance(self, seconds: float) -> None:
        end_ns = self.now_ns + round(seconds * tokens.NS_PER_S)
        step_ns = self.step_ns
        step_s = step_ns / tokens.NS_PER_S
        procs = self.processes
        jitter = self.imperfections.kernel_jitter
        gauss = self.rng.gauss
        while self.now_ns < end_ns:
            now = self.now_ns
            t_s = (now - self.start_ns) / tokens.NS_PER_S
            for p in procs:
                w = p.workload
                if t_s >= p.recheck_s:
                    p.busy, p.recheck_s = w.busy_at(t_s), w.next_change(t_s)
                kernel_s = w.kernel_s
                if w.alone_kernels_s or w.alone_kernel_s is not None:
                    alone = self._alone(p, now, w.alone_after_s)
                    if alone and not p.was_alone:
                        p.alone_times += 1
                    p.was_alone = alone
                    if alone and w.alone_kernels_s:
                        kernel_s = w.alone_kernels_s[(p.alone_times - 1) % len(w.alone_kernels_s)]
                    elif alone and w.alone_kernel_s is not None:
                        kernel_s = w.alone_kernel_s
                room = max(w.queue_s, kernel_s) - p.queued_s
                if p.busy and room >= kernel_s * 0.999:
                    want = int(room / kernel_s + 1e-9)
                    admitted = p.gate.admit(now, want)
                    p.window_launches += admitted
                    if admitted and jitter:
                        # n launches of relative spread j add up to a spread of j / sqrt(n)
                        spread = jitter / math.sqrt(admitted)
                        p.queued_s += admitted * kernel_s * max(0.2, 1 + gauss(0, spread))
                    else:
                        p.queued_s += admitted * kernel_s
            self._execute(step_s)
            self.now_ns = now + step_ns
            if self.now_ns >= self._next_sample_ns:
                self._sample()
            if self._pending:
                self._release()
            if self.now_ns >= self._next_bin_ns:
                for p in procs:
                    p.bins.append(p.total_sm_s)
                self._next_bin_ns += self.bin_ns

    def _alone(self, p: SimProcess, now_ns: int, after_s: float) -> bool:
        """Whether no process but `p` has held the GPU for `after_s` (and `p` has run since)."""
        since_ns = now_ns - round(after_s * tokens.NS_PER_S)
        return p.last_ran_ns >= since_ns and all(
            q is p or q.last_ran_ns < since_ns for q in self.processes)

    def _execute(self, step_s: float) -> None:
        busy = [p for p in self.processes if p.queued_s > 0]
        if not busy:
            return
        imp = self.imperfections
        left = step_s
        if len(busy) > 1:
            left -= step_s * imp.switch_s / imp.timeslice_s  # contexts take turns
            shared = left * imp.overlap
            if shared > 0:
                # Draining and starting contexts run side by side, dividing SMs by grid size.
                blocks = sum(p.workload.blocks for p in busy)
                for p in busy:
                    self._run(p, shared * p.workload.blocks / blocks)
                left -= shared
                busy = [p for p in busy if p.queued_s > 0]
        # Time-slicing: equal turns; a context with less work than its turn leaves the rest.
        busy.sort(key=self._time_needed)
        for i, p in enumerate(busy):
            left -= self._run(p, left / (len(busy) - i))

    def _speed(self, p: SimProcess) -> tuple[float, float]:
        """(work done per second held, SM fraction while held) with the kernels it has queued."""
        if p.packable == 1:
            return 1.0, p.fill * p.workload.occupancy
        resident = max(1, min(p.packable, math.ceil(p.queued_s / p.workload.kernel_s - 1e-9)))
        speed = resident ** self.imperfections.packing_efficiency
        return speed, min(1.0, resident * p.fill) * p.workload.occupancy

    def _time_needed(self, p: SimProcess) -> float:
        return p.queued_s / self._speed(p)[0]

    def _run(self, p: SimProcess, held_s: float) -> float:
        """Let `p` hold the GPU for up to `held_s`; returns the time it used."""
        speed, sm_fraction = self._speed(p)
        used = min(held_s, p.queued_s / speed)
        if used > 0:
            p.last_ran_ns = self.now_ns
        p.queued_s -= used * speed
        if p.queued_s < 1e-12:
            p.queued_s = 0.0
        sm = used * sm_fraction
        p.window_sm_s += sm
        p.total_sm_s += sm
        return used

    def _sample(self) -> None:
        imp = self.imperfections
        period_s = self.sample_ns / tokens.NS_PER_S
        stamp_us = self._next_sample_ns // 1000
        rng = self.rng
        ran = [(p, p.window_sm_s) for p in self.processes if p.window_sm_s > 0]
        # what the GPU counts busy beyond the work while processes take turns (none alone)
        held_s = imp.launch_hold_s * sum(p.window_launches for p, _ in ran) if len(ran) > 1 else 0
        for p in self.processes:
            p.window_launches = 0
            recent = p.recent_sm_s
            recent.append(p.window_sm_s)
            if len(recent) > imp.window_periods:
                recent.popleft()
            p.window_sm_s = 0.0
        sliced = imp.nvml_attribution == "time-sliced"
        # the H200 gave every period to someone, read often or seldom (see `_deliver`)
        missed = 0.0 if sliced else imp.missed_samples
        period: dict[int, int] = {}
        if sliced and len(ran) > 1:
            # the period, to one of those that ran, with the whole GPU's use
            chosen = rng.choices([p for p, _ in ran], weights=[sm for _, sm in ran])[0]
            busy = 100 * (sum(sm for _, sm in ran) + held_s) / period_s
            period[chosen.pid] = imp.observe(min(100.0, busy), rng)
        else:
            for p in self.processes:
                if missed and rng.random() < missed:
                    continue
                recent = p.recent_sm_s
                value = 100 * sum(recent) / (len(recent) * period_s)
                period[p.pid] = imp.observe(value, rng)
        lag_s, jitter_s = imp.sample_lag_s, imp.sample_lag_jitter_s
        if lag_s or jitter_s:
            lag_s += rng.uniform(0.0, jitter_s) if jitter_s else 0.0
            self._pending.append((self._next_sample_ns + round(lag_s * tokens.NS_PER_S),
                                  stamp_us, period))
        else:
            self._publish(stamp_us, period)
        self._next_sample_ns += self.sample_ns
        oldest_us = (self.now_ns - self._history_ns) // 1000
        while self._samples and self._samples[0].timestamp_us < oldest_us:
            self._samples.popleft()
        if self._unread and self._unread[0][0] < oldest_us:  # asked by nobody for a while
            self._unread = [u for u in self._unread if u[0] >= oldest_us]

    def _publish(self, stamp_us: int, period: dict[int, int]) -> None:
        """A sampled period made readable."""
        if self.imperfections.nvml_attribution == "time-sliced":
            self._unread.append((stamp_us, period))
        else:
            self._samples.extend(ProcessSample(pid, stamp_us, value)
                                 for pid, value in period.items())

    def _release(self) -> None:
        """The pending periods readable by now, in stamp order (a later one drawn a shorter
        lag waits for those before it: a driver's buffer is read in order)."""
        pending = self._pending
        while pending and pending[0][0] <= self.now_ns:
            _, stamp_us, period = pending.popleft()
            self._publish(stamp_us, period)

    def process_utilization(self, since_us: int) -> list[ProcessSample]:
        if not self.per_process_samples:
            raise GpuError("per-process utilization is not supported",
                           call="nvmlDeviceGetProcessUtilization", code=NVML_ERROR_NOT_SUPPORTED)
        return [s for s in self.samples if s.timestamp_us > since_us]

    @property
    def samples(self) -> deque[ProcessSample]:
        """The driver's samples as a reader asking now gets them (asking delivers the periods
        not yet asked for, with time-sliced attribution)."""
        self._deliver()
        return self._samples

    def _deliver(self) -> None:
        """Time-sliced attribution: the periods since the driver was last asked, as the H200
        (driver 580) answered: one sample per process given any of them, stamped with the last
        it was given, its value the GPU's use in the periods it was given over all of them
        (asked every period, the one process given it, with the whole use; asked every second
        beside one given 2 periods of 5 and one 3, 40 and 60 where each period read 99)."""
        unread = self._unread
        if not unread:
            return
        totals: dict[int, int] = {}
        last: dict[int, int] = {}
        for stamp_us, period in unread:
            for pid, value in period.items():
                totals[pid] = totals.get(pid, 0) + value
                if value or pid not in last:  # listed idle: not given the period
                    last[pid] = stamp_us
        self._samples.extend(ProcessSample(pid, last[pid], round(totals[pid] / len(unread)))
                             for pid in sorted(last, key=last.__getitem__))
        unread.clear()

    def shares(self, proc: SimProcess, window_s: float) -> list[tuple[float, float]]:
        """(end time s, SM percent over the preceding `window_s`) for every recorded bin."""
        per = max(1, round(window_s * tokens.NS_PER_S / self.bin_ns))
        bin_s = self.bin_ns / tokens.NS_PER_S
        cumulative = [0.0, *proc.bins]
        return [
            (i * bin_s, 100 * (cumulative[i] - cumulative[i - per]) / (per * bin_s))
            for i in range(per, len(cumulative))
        ]


class SimHostEvidence:
    """The simulated host's answer to "which container runs this pid" (what /proc says on a
    real node): the container each shim process was started in, never what its slot claims."""

    def __init__(self, gpus: Sequence[SimGpu]):
        self.gpus = list(gpus)

    def owner(self, host_pid: int, marks: RegionMarks) -> str | None:
        for gpu in self.gpus:
            alloc_id = gpu.containers.get(host_pid)
            if alloc_id is not None:
                return alloc_id if alloc_id in marks else ""
        return ""  # a host process, in no container

    def forget_except(self, live: Iterable[int]) -> None:
        pass


class SimBackend:
    """The slice of a GPU backend the controller uses, served by simulated GPUs."""

    def __init__(self, gpus: Sequence[SimGpu]):
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        self.calls = 0

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self.calls += 1
        gpu = self.gpus.get(uuid)
        if gpu is None:
            raise GpuError(f"no simulated GPU {uuid!r}", call="nvmlDeviceGetHandleByUUID", code=13)
        return gpu.process_utilization(since_us)

"""When each GPU's NVML samples are asked for, and how much time a batch of them describes.

Per GPU: the newest stamp read (the next call asks for what came after it), NVML's sample
period as the stamps show it (the shortest gap between two; longer ones span missed periods),
and when the next period is over on this clock. The call costs about 2 ms of CPU on an H200
(driver 580) whatever it returns, so a GPU is not asked again before its next period is over
(or its next `poll_periods`: the driver keeps the samples in between). When that is: the
stamp that many periods on plus the least delay, over the last LAG_READINGS, between a stamp
and the tick that first read it (which takes in the offset between NVML's clock and this
one), less ASK_EARLY_NS, a millisecond (a tick that lands on the period's end asks then, not
a tick later). Asked a quarter tick earlier, as it once was, a fifth of a changing node's
calls found nothing new, each costing what a full one does (BENCHMARKS.md). Until the period
is known, every tick asks.

A GPU the controller marks (`every_period`) is asked every period whatever `poll_periods`
says: one whose containers' estimates are still loose (a newcomer, a far reading awaiting the
next to confirm it, a change of workload being re-learned), where a sample is worth most and
two periods read at once came a period late for a cold start's (simulated: a cold start at
sigma 8 settled in 9.8 s asked every other period, 3.6 s asked every period, BENCHMARKS.md);
and one whose periods are time-sliced among two containers or more, where the driver answers
a read of several periods with one sample per process for all of them, and who was given which
period is lost.

Pure: no I/O; the controller passes its clock's time.
"""

from __future__ import annotations

import itertools
from collections import deque

from vgpu_agent.gpu.model import ProcessSample

LAG_READINGS = 20  # readings over which the least delay from stamp to reading is taken
# NVML samples a GPU every 1/6 s to 1 s, by product (nvidia-smi's documentation; 200 ms on the
# H200): stamps closer than this are one sampling instant, however a driver stamps each
# process's sample within it. Read as they came, a few microseconds between two processes'
# stamps would be taken for the sample period, and the two for periods given to one each.
# (Well under the shortest period, so that simulated GPUs sampled every 0.1 s or 0.05 s keep
# their periods apart.)
SAME_INSTANT_US = 20_000
# how long before the moment a period should be there it is asked for (see the module note)
ASK_EARLY_NS = 1_000_000


class SampleClock:
    """The sample bookkeeping of a node's GPUs, by uuid."""

    __slots__ = ("_delays_us", "_due_ns", "_every", "_first_read_ns", "_newest_us",
                 "_period_us", "_since_us", "poll_periods", "tick_s")

    def __init__(self, tick_s: float, poll_periods: int = 1) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick must be > 0 s, got {tick_s!r}")
        if not (type(poll_periods) is int and 1 <= poll_periods <= 10):
            raise ValueError(f"NVML poll periods must be an int in [1, 10], got {poll_periods!r}")
        self.tick_s, self.poll_periods = tick_s, poll_periods
        self._since_us: dict[str, int] = {}  # the newest stamp any call returned
        self._due_ns: dict[str, int] = {}  # when NVML may have a new sample
        self._delays_us: dict[str, deque[int]] = {}  # stamp to first reading
        self._newest_us: dict[str, int] = {}  # the newest stamp of a batch read
        self._period_us: dict[str, int] = {}  # NVML's sample period, as seen (0: not yet)
        self._first_read_ns: dict[str, int] = {}  # when its samples were first asked for
        self._every: set[str] = set()  # asked every period (see the module note)

    def due(self, uuid: str, now_ns: int) -> bool:
        """Whether to ask NVML for `uuid`'s samples now (its next period may be over)."""
        self._first_read_ns.setdefault(uuid, now_ns)
        return self._due_ns.get(uuid, 0) <= now_ns

    def since_us(self, uuid: str) -> int:
        """The stamp after which to ask for samples (0: all the driver holds)."""
        return self._since_us.get(uuid, 0)

    def newest_us(self, uuid: str) -> int | None:
        """The newest stamp of the batches read (`span`), None before the first."""
        return self._newest_us.get(uuid)

    def period_us(self, uuid: str) -> int:
        """NVML's sample period on `uuid` as its stamps show it, 0 while not known."""
        return self._period_us.get(uuid, 0)

    def periods_s(self) -> dict[str, float]:
        """Every GPU's sample period known so far, in seconds."""
        return {uuid: period / 1e6 for uuid, period in self._period_us.items() if period}

    def poll_periods_now(self) -> dict[str, int]:
        """Per GPU whose sample period is known, the periods between its asks now: 1 where
        marked (`every_period`), `poll_periods` elsewhere."""
        every, periods = self._every, self.poll_periods
        return {uuid: 1 if uuid in every else periods
                for uuid, period in self._period_us.items() if period}

    def every_period(self, uuid: str, wanted: bool) -> None:
        """Whether `uuid` is asked every period (see the module note) or every `poll_periods`;
        a GPU turning to every period has its next ask brought forward to its next period."""
        marked = self._every
        if not wanted:
            marked.discard(uuid)
            return
        if uuid in marked:
            return
        marked.add(uuid)
        newest, period = self._newest_us.get(uuid), self._period_us.get(uuid, 0)
        delays = self._delays_us.get(uuid)
        if self.poll_periods > 1 and newest is not None and period and delays:
            self._due_ns[uuid] = min(self._due_ns.get(uuid, 0),
                                     (newest + period + min(delays)) * 1000 - ASK_EARLY_NS)

    def accepted(self, uuid: str, samples: list[ProcessSample]) -> list[ProcessSample]:
        """What of a call's non-empty answer describes the present, its stamps one per
        sampling instant (`one_stamp_per_instant`). The first call returns the driver's whole
        history, from before the spending the law knows of: only its newest period counts, and
        the history tells the sample period."""
        samples = one_stamp_per_instant(samples)
        since = self._since_us.get(uuid, 0)
        newest = max(s.timestamp_us for s in samples)
        self._since_us[uuid] = max(since, newest)
        if since == 0:
            stamps = sorted({s.timestamp_us for s in samples})
            if len(stamps) > 1:
                self._period_us[uuid] = min(b - a for a, b in itertools.pairwise(stamps))
            samples = [s for s in samples if s.timestamp_us == newest]
        return samples

    def span(self, uuid: str, samples: list[ProcessSample], now_ns: int) -> tuple[float, int]:
        """(seconds the samples describe, samples per process) for the law's evidence; the
        next call is scheduled by them."""
        stamps = sorted({s.timestamp_us for s in samples})
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        previous = self._newest_us.get(uuid)
        if previous is not None and previous < stamps[0]:
            gaps.insert(0, stamps[0] - previous)
        # (an instant's samples split between two reads are no period)
        gaps = [gap for gap in gaps if gap > SAME_INSTANT_US]
        self._newest_us[uuid] = stamps[-1]
        period = self._period_us.get(uuid, 0)
        if gaps:
            # the sample period: the shortest gap seen (longer ones span missed periods)
            period = min([period, *gaps]) if period else min(gaps)
            self._period_us[uuid] = period
        self._schedule(uuid, stamps[-1], period, now_ns)
        if not period:
            # A first sample and no history: it cannot describe more than the time since the
            # GPU was first read (and a second at most; no driver samples less often).
            watched_s = (now_ns - self._first_read_ns.setdefault(uuid, now_ns)) / 1e9
            return min(1.0, watched_s + self.tick_s), len(stamps)
        return len(stamps) * period / 1e6, len(stamps)

    def _schedule(self, uuid: str, newest_us: int, period_us: int, now_ns: int) -> None:
        """When the next call may find a new period (see the module note)."""
        delays = self._delays_us.setdefault(uuid, deque(maxlen=LAG_READINGS))
        delays.append(now_ns // 1000 - newest_us)
        if period_us:
            periods = 1 if uuid in self._every else self.poll_periods
            self._due_ns[uuid] = (newest_us + period_us * periods
                                  + min(delays)) * 1000 - ASK_EARLY_NS


def one_stamp_per_instant(samples: list[ProcessSample]) -> list[ProcessSample]:
    """`samples` with every stamp within SAME_INSTANT_US after the first of its instant moved
    to the instant's last: one stamp per sampling instant. The list itself where nothing
    moves (every driver seen so far stamps a period's samples alike)."""
    stamps = sorted({s.timestamp_us for s in samples})
    if len(stamps) < 2 or min(b - a for a, b in itertools.pairwise(stamps)) > SAME_INSTANT_US:
        return samples
    moved: dict[int, int] = {}
    instant: list[int] = []
    for stamp in [*stamps, None]:
        if instant and (stamp is None or stamp - instant[0] > SAME_INSTANT_US):
            moved.update((early, instant[-1]) for early in instant[:-1])
            instant = []
        if stamp is not None:
            instant.append(stamp)
    return [ProcessSample(s.pid, moved[s.timestamp_us], s.sm_util)
            if s.timestamp_us in moved else s for s in samples]

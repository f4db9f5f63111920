"""Caches that scrapes read: per-GPU NVML readings and per-region limits and usage.

A scrape must never wait on NVML (a call can hang for seconds on a sick GPU) nor decode a
hundred region files on the event loop, so both are read here, in a worker thread, on a fixed
interval; the scrape takes whatever the last round left. Each cache replaces its whole mapping
at the end of a round, so a reader on the loop never sees half a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from vgpu_agent.gpu.model import GpuBackend, GpuError, GpuInfo, GpuReadings
from vgpu_agent.shm.api import CorePolicy, RegionHandle, RegionUsage

log = structlog.get_logger(__name__)


STEP_ASIDE_S = 0.0002  # long enough for a thread waiting for the GIL to take it
STEP_ASIDE_EVERY = 16  # regions read between two pauses (about 1-2 ms of reading)


def step_aside() -> None:
    """Let the event loop have the GIL, from a worker thread between two steps of its work.

    A thread that wants the GIL waits up to the switch interval (5 ms) before it may take it
    from a busy one; a region round or a render is several such slices, and an Allocate or a
    controller tick on the loop would wait for each. A short sleep releases the GIL at once, so
    the loop waits at most for one step (a millisecond or two at 144 container-devices)."""
    time.sleep(STEP_ASIDE_S)


def _check_interval(interval_s: float) -> float:
    if not interval_s > 0:
        raise ValueError(f"poll interval {interval_s!r} s is not allowed: it must be > 0")
    return interval_s


# ---------------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GpuSample:
    """The last poll of one GPU. `readings` is None until a poll has succeeded."""

    readings: GpuReadings | None
    stale: bool  # the last poll failed: `readings` (if any) are from an earlier round
    error: str = ""
    polled_at: float = 0.0  # time.monotonic() of the last successful poll
    failures: int = 0  # failed polls since start


class GpuPoller:
    """Polls `backend.readings` for every GPU each `interval_s`; one failing GPU marks only its
    own sample stale."""

    def __init__(
        self,
        backend: GpuBackend,
        gpus: Callable[[], Sequence[GpuInfo]],
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backend = backend
        self.gpus = gpus
        self.interval_s = _check_interval(interval_s)
        self.rounds = 0
        self._clock = clock
        self._samples: Mapping[str, GpuSample] = {}

    @property
    def samples(self) -> Mapping[str, GpuSample]:
        return self._samples

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> Mapping[str, GpuSample]:
        uuids = [gpu.uuid for gpu in self.gpus()]
        if not uuids:
            return self._samples
        results = await asyncio.to_thread(self._read_all, uuids)
        now = self._clock()
        previous = self._samples
        samples: dict[str, GpuSample] = {}
        for uuid, readings, error in results:
            before = previous.get(uuid)
            failures = before.failures if before else 0
            if readings is not None:
                samples[uuid] = GpuSample(readings, False, "", now, failures)
                continue
            if not before or not before.stale:
                log.warning("gpu_readings_failed", uuid=uuid, error=error)
            samples[uuid] = GpuSample(
                before.readings if before else None,
                True,
                error,
                before.polled_at if before else 0.0,
                failures + 1,
            )
        self._samples = samples
        self.rounds += 1
        return samples

    def _read_all(self, uuids: list[str]) -> list[tuple[str, GpuReadings | None, str]]:
        out: list[tuple[str, GpuReadings | None, str]] = []
        for uuid in uuids:
            try:
                out.append((uuid, self.backend.readings(uuid), ""))
            except GpuError as err:
                out.append((uuid, None, str(err) or err.call))
            except Exception as err:  # a backend bug must not stop the other GPUs' readings
                log.exception("gpu_readings_crashed", uuid=uuid)
                out.append((uuid, None, repr(err)))
        return out


# ---------------------------------------------------------------------------------- regions


@dataclass(frozen=True)
class DeviceLimits:
    """One region device's limits as written in its `control` file."""

    uuid: str
    memory_limit: int  # bytes, 0 = none
    core_limit: float  # percent of SM time
    policy: CorePolicy
    rate: int  # tokens per second
    burst: int


@dataclass(frozen=True)
class RegionSample:
    """One region as read in one round. `usage` is None when the `state` file could not be read
    at all (then `error` says why); a corrupt header gives `usage.corrupt`."""

    alloc_id: str
    seq: int
    device_ids: tuple[str, ...]
    devices: tuple[DeviceLimits, ...]
    usage: RegionUsage | None
    error: str = ""
    priority: int = 0


def read_region(region: RegionHandle) -> RegionSample:
    """Read one region's limits and usage; raises whatever the handle raises for `control`."""
    uuids = tuple(region.device_uuids)
    devices = []
    for dev, uuid in enumerate(uuids):
        rate, burst = region.rate(dev)
        devices.append(
            DeviceLimits(
                uuid=uuid,
                memory_limit=int(region.memory_limit(dev)),
                core_limit=float(region.core_limit(dev)),
                policy=region.policy(dev),
                rate=int(rate),
                burst=int(burst),
            )
        )
    usage: RegionUsage | None
    error = ""
    try:
        usage = region.usage()
    except Exception as err:  # the state file belongs to the container: never trust it
        usage, error = None, f"state unreadable: {err}"
    return RegionSample(
        alloc_id=region.alloc_id,
        seq=int(region.seq),
        device_ids=tuple(region.device_ids),
        devices=tuple(devices),
        usage=usage,
        error=error,
        priority=int(region.priority),
    )


class RegionCache:
    """Reads every region in a worker thread, timed to the scrapes; scrapes read `samples`.

    Reading a region costs a few hundred microseconds (its whole `state` file is copied), so
    re-reading a hundred regions on a fixed short period would cost several percent of a core
    for data that is looked at once every 15-60 s. Instead the cache learns the gap between
    scrapes and reads all regions once, `lead_s` before the next scrape is due: one round per
    scrape, data about `lead_s` old when served. A scrape that finds the data older than
    `max_age_s` (the first scrape, an irregular scraper, after a pause) waits for a fresh round.
    Without scrapes nothing is read, and `run` sleeps until the next round is due or a scrape
    comes: no wake-ups of its own on an idle node.
    """

    def __init__(
        self,
        regions: Callable[[], Iterable[RegionHandle]],
        max_age_s: float = 5.0,
        lead_s: float = 2.0,  # the loop's timer slack may fire a far timer up to 1 s late
        clock: Callable[[], float] = time.monotonic,
    ):
        self.regions = regions
        self.max_age_s = _check_interval(max_age_s)
        self.lead_s = lead_s
        self.rounds = 0
        self.waited_rounds = 0  # rounds a scrape had to wait for
        self.read_errors = 0  # regions whose control could not be read, cumulative
        self.refreshed_at: float | None = None
        self.scraped_at: float | None = None
        self.scrape_gap: float | None = None  # shortest recent gap between scrapes
        self._clock = clock
        self._samples: tuple[RegionSample, ...] = ()
        self._round: asyncio.Future[tuple[RegionSample, ...]] | None = None
        self._scraped = asyncio.Event()  # a scrape came: the rhythm, and the next round, moved

    @property
    def samples(self) -> tuple[RegionSample, ...]:
        return self._samples

    async def run(self) -> None:
        """Read each round when it is due, sleeping in between (`clock` must be the loop's)."""
        while True:
            await self.refresh_if_due()
            self._scraped.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.due_in(self._clock())):
                    await self._scraped.wait()

    def _read_at(self) -> float | None:
        """When the round for the next expected scrape is due; None with no rhythm yet."""
        if self.scraped_at is None or self.scrape_gap is None:
            return None
        return self.scraped_at + self.scrape_gap - self.lead_s

    def due(self, now: float) -> bool:
        """True when the next scrape is expected within `lead_s` and no round has run since
        that point (so each expected scrape gets exactly one round)."""
        read_at = self._read_at()
        if read_at is None:
            return False
        return now >= read_at and (self.refreshed_at is None or self.refreshed_at < read_at)

    def due_in(self, now: float) -> float | None:
        """Seconds until the next round is due; None when none is, until the next scrape."""
        read_at = self._read_at()
        if read_at is None or (self.refreshed_at is not None and self.refreshed_at >= read_at):
            return None
        return max(0.0, read_at - now)

    async def refresh_if_due(self) -> None:
        if self.due(self._clock()):
            await self.refresh()

    async def fresh(self) -> tuple[RegionSample, ...]:
        """What a scrape reads: the cache, refreshed first if it is older than `max_age_s`."""
        now = self._clock()
        if self.scraped_at is not None:
            gap = now - self.scraped_at
            # the shortest gap wins (two Prometheus replicas interleave); a long pause is not a
            # new rhythm, so the estimate only grows slowly
            self.scrape_gap = gap if self.scrape_gap is None else min(
                gap, self.scrape_gap * 1.25
            )
        self.scraped_at = now
        self._scraped.set()
        if self.refreshed_at is None or now - self.refreshed_at > self.max_age_s:
            self.waited_rounds += 1
            return await self.refresh()
        return self._samples

    async def refresh(self) -> tuple[RegionSample, ...]:
        """Read every region now; a caller arriving during a round shares that round."""
        if self._round is None:
            self._round = asyncio.ensure_future(self._read_round())
            self._round.add_done_callback(self._round_done)
        # shielded: a scrape that gives up must not cancel the round others wait for
        return await asyncio.shield(self._round)

    def _round_done(self, _: object) -> None:
        self._round = None

    async def _read_round(self) -> tuple[RegionSample, ...]:
        # the list is taken on the loop, where the region store changes it
        handles = list(self.regions())
        samples, failed = await asyncio.to_thread(self._read_all, handles)
        self._samples = samples
        self.read_errors += failed
        self.rounds += 1
        self.refreshed_at = self._clock()
        return samples

    @staticmethod
    def _read_all(handles: list[RegionHandle]) -> tuple[tuple[RegionSample, ...], int]:
        samples: list[RegionSample] = []
        failed = 0
        for n, handle in enumerate(handles, 1):
            if n % STEP_ASIDE_EVERY == 0:
                step_aside()
            try:
                samples.append(read_region(handle))
            except Exception as err:  # removed or unmapped while we read: skip this round
                if handle.closed:
                    # Collected by the region store (its container is gone) while this round
                    # read it: nothing was wrong with it, and a node whose pods come and go
                    # would otherwise count read errors and log warnings at every departure.
                    continue
                failed += 1
                log.warning("region_unreadable", alloc_id=_safe_alloc_id(handle), error=str(err))
        return tuple(samples), failed


def _safe_alloc_id(handle: RegionHandle) -> str:
    try:
        return handle.alloc_id
    except Exception:
        return "?"

"""How soon any law could settle on the simulated GPU's NVML: a lower bound for settling goals.

After a change, a law must learn what each new workload's tokens buy, and the only evidence is
NVML: each container's own samples (`per-process` attribution) or which process a period's one
sample went to (`time-sliced`), plus, while the GPU is full, the fact that the shares add up to
what the GPU gives. `settling_bound` plays an estimator that uses all of it as well as it can be
used, and measures its settling as the bench measures a law's: from the change to the first
window end after which every container stays within `tolerance` points of its share for
`hold_s`, shares taken over windows of `window_s`.

- per-process: a container's share error is the mean error of all its samples so far (the best
  unbiased estimate of a constant from unbiased samples). While the GPU is full the errors are
  projected so that they add up to zero, each in proportion to its variance (least squares
  under that constraint): a container alone on a full GPU is known from its first unthrottled
  tick, and of n new containers the last is known once the others are.
- time-sliced: a period's one sample goes to one process with odds in proportion to its SM
  time, so a container's share is estimated as what the new containers share times the fraction
  of their periods that went to its processes. The samples' values are the whole GPU's and say
  nothing of the split. A single process gets samples of its own, as with per-process.

Samples follow the plant's noise model as `Imperfections` states it (a sampled proportion's
spread with `nvml_noise` "sampled", sigma with "additive", rounded to the whole percent NVML
reports, a process missed with `missed_samples`), drawn from a normal distribution rather than
by counting the driver's instants, which would cost minutes per cell. An estimate acts from the
first tick after its sample's period ends. Everything else is ideal: each container's share is
exactly what its estimate aims at (no kernel jitter, no lumpy spending, no transient), the cost
per token never changes, and nothing is spent on caution (no strict margin, no outlier test).
So no law that learns costs from the samples reaches this figure, it can only approach it: a
settling goal below it asks for more than the samples hold. A law that assumes more can beat
it where the assumption happens to hold: the law's cold start gives newcomers equal parts of
the GPU, which is exact for three containers of one workload and one process each (the bench's
scenario 1, settled at one sample a second before the first sample came), and wrong for others.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from vgpu_agent.simulation.imperfections import Imperfections


@dataclass(frozen=True)
class Learner:
    """One container after a change: the share it should get, and whether its cost is known."""

    share: float  # percent of the GPU
    processes: int = 1
    known: bool = False  # its workload did not change at this change: nothing to learn

    def __post_init__(self) -> None:
        if not 0 < self.share <= 100:
            raise ValueError(f"Learner.share must be in (0, 100], got {self.share!r}")
        if self.processes < 1:
            raise ValueError(f"Learner.processes must be >= 1, got {self.processes!r}")


@dataclass(frozen=True)
class BoundSpec:
    """The plant's NVML and the bench's settling rule."""

    imperfections: Imperfections
    sample_period_s: float = 1 / 6
    tick_s: float = 0.1
    full: bool = True  # the shares fill the GPU, so they add up to what it gives
    tolerance: float = 2.0
    hold_s: float = 2.0
    window_s: float = 0.5
    horizon_s: float = 30.0  # not settled by then: never

    def __post_init__(self) -> None:
        for name in ("sample_period_s", "tick_s", "tolerance", "window_s", "horizon_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"BoundSpec.{name} must be > 0, got {value!r}")
        if self.hold_s < 0:
            raise ValueError(f"BoundSpec.hold_s must be >= 0, got {self.hold_s!r}")
        if self.window_s < self.tick_s:
            raise ValueError(f"BoundSpec.window_s must be at least one tick ({self.tick_s!r} "
                             f"s), got {self.window_s!r}")


def reading_sd(percent: float, imp: Imperfections) -> float:
    """The standard deviation of one process's NVML sample at `percent` true use (before the
    rounding to a whole percent): the plant's own (`Imperfections.spread`)."""
    return imp.spread(percent)


class _Estimates:
    """The estimator's share errors, per learner, after the samples so far (None: unknown)."""

    def __init__(self, learners: Sequence[Learner], spec: BoundSpec, rng: random.Random):
        self.learners = [c for c in learners if not c.known]
        self.spec, self.rng = spec, rng
        imp = spec.imperfections
        self.time_sliced = (imp.nvml_attribution == "time-sliced"
                            and sum(c.processes for c in learners) > 1)
        # per process: its share, the spread of its sample, and the variance of a container's
        # sample (each process rounded to a whole percent: 1/12 point^2 more)
        self.per_process = [c.share / c.processes for c in self.learners]
        self.sds = [reading_sd(q, imp) for q in self.per_process]
        self.variances = [c.processes * (sd * sd + 1 / 12)
                          for c, sd in zip(self.learners, self.sds, strict=True)]
        self.sums = [0.0] * len(self.learners)
        self.counts = [0] * len(self.learners)
        self.weights = [c.share for c in self.learners]  # odds of a period, time-sliced

    def sample(self) -> None:
        """One NVML sample period."""
        imp, rng = self.spec.imperfections, self.rng
        if not self.learners:
            return
        if self.time_sliced:
            # one sample, to a process drawn by SM time; what the new containers share is
            # known (the GPU less the known ones), so only its split is estimated
            if imp.missed_samples and rng.random() < imp.missed_samples:
                return
            chosen = rng.choices(range(len(self.learners)), weights=self.weights)[0]
            self.counts[chosen] += 1
            return
        for i, c in enumerate(self.learners):
            reading = 0
            missed = False
            for _ in range(c.processes):
                if imp.missed_samples and rng.random() < imp.missed_samples:
                    missed = True  # the estimator knows which processes were listed
                    break
                reading += round(min(100.0, max(
                    0.0, self.per_process[i] + rng.gauss(0, self.sds[i]))))
            if not missed:
                self.sums[i] += reading - c.share
                self.counts[i] += 1

    def errors(self) -> list[float | None]:
        if self.time_sliced:
            periods = sum(self.counts)
            if not periods:
                return [None] * len(self.learners)
            shared = sum(c.share for c in self.learners)
            return [shared * n / periods - c.share
                    for c, n in zip(self.learners, self.counts, strict=True)]
        errors: list[float | None] = [s / n if n else None
                                      for s, n in zip(self.sums, self.counts, strict=True)]
        if not self.spec.full:
            return errors
        unknown = [i for i, e in enumerate(errors) if e is None]
        if len(unknown) > 1:
            return errors
        known = [e for e in errors if e is not None]
        excess = sum(known)
        if unknown:  # the one not yet sampled is what the others leave
            errors[unknown[0]] = -excess
            return errors
        spreads = [v / n for v, n in zip(self.variances, self.counts, strict=True)]
        total = sum(spreads)
        if total <= 0:
            return [0.0] * len(errors)
        return [e - s / total * excess for e, s in zip(known, spreads, strict=True)]


def _within(window: Sequence[Sequence[float | None]], n: int, tolerance: float) -> bool:
    """Whether every learner's share over the window (the mean of the errors in force in its
    ticks) is within tolerance; an error not yet known is not."""
    for i in range(n):
        total = 0.0
        for row in window:
            error = row[i]
            if error is None:
                return False
            total += error
        if abs(total / len(window)) > tolerance:
            return False
    return True


def _errors_in_force(learners: Sequence[Learner], spec: BoundSpec, rng: random.Random
                     ) -> Iterator[list[float | None]]:
    """One run: per tick from the change, the estimator's share errors in force during it."""
    estimates = _Estimates(learners, spec, rng)
    next_sample = spec.sample_period_s
    current: list[float | None] = [None] * len(estimates.learners)
    for tick in range(1, round(spec.horizon_s / spec.tick_s) + 1):
        yield current
        # samples whose period ended by the end of this tick act from the next one
        end = tick * spec.tick_s + 1e-9
        while next_sample <= end:
            estimates.sample()
            next_sample += spec.sample_period_s
        current = estimates.errors()


def _settling(learners: Sequence[Learner], spec: BoundSpec, rng: random.Random) -> float:
    """One run: seconds from the change to settled, `math.inf` when not within the horizon."""
    per_window = max(1, round(spec.window_s / spec.tick_s))
    hold = round(spec.hold_s / spec.tick_s)
    n = sum(1 for c in learners if not c.known)
    if not n:
        return per_window * spec.tick_s
    in_force: list[list[float | None]] = []  # per tick, the errors in force during it
    good_from: int | None = None  # first window end of the current run of good windows
    for tick, current in enumerate(_errors_in_force(learners, spec, rng), start=1):
        in_force.append(current)
        if len(in_force) >= per_window:
            good = _within(in_force[-per_window:], n, spec.tolerance)
            if not good:
                good_from = None
            elif good_from is None:
                good_from = tick
            if good_from is not None and tick - good_from >= hold:
                return good_from * spec.tick_s
    return math.inf


def _steady_error(learners: Sequence[Learner], spec: BoundSpec, rng: random.Random,
                  from_s: float) -> tuple[float, int]:
    """One run: the sum of |share error| over every container's windows that end `from_s` or
    later after the change (as the bench's steady state), and how many there are. A window in
    which an error was not yet known counts as 100 points off."""
    per_window = max(1, round(spec.window_s / spec.tick_s))
    first = math.ceil(from_s / spec.window_s - 1e-9)  # windows ending before from_s: not steady
    total, windows = 0.0, 0
    known = sum(1 for c in learners if c.known)
    rows: list[list[float | None]] = []
    for tick, current in enumerate(_errors_in_force(learners, spec, rng), start=1):
        rows.append(current)
        if tick % per_window:
            continue
        if tick // per_window > first:
            for i in range(len(current)):
                values = [row[i] for row in rows]
                total += 100.0 if None in values else abs(
                    sum(v for v in values if v is not None) / per_window)
            windows += len(current) + known  # the known ones: 0 points off
        rows = []
    return total, windows


def steady_error_bound(segments: Sequence[tuple[Sequence[Learner], BoundSpec]],
                       from_s: float = 5.0, runs: int = 200, seed: int = 0) -> float:
    """The median, over `runs` runs, of the estimator's mean absolute share error in steady
    state (windows ending `from_s` or more after each change), over the segments between a
    run's changes (each its containers and its spec, `horizon_s` its length): what the
    bench's steady-state error would be for a law as good as the samples allow. A goal below
    it asks for more than the samples hold."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs!r}")
    if not segments:
        raise ValueError("steady_error_bound needs at least one segment")
    rng = random.Random(seed)
    means = []
    for _ in range(runs):
        total, windows = 0.0, 0
        for learners, spec in segments:
            part, count = _steady_error(learners, spec, rng, from_s)
            total, windows = total + part, windows + count
        means.append(total / windows if windows else 0.0)
    return statistics.median(means)


def settling_bound(learners: Sequence[Learner], spec: BoundSpec, runs: int = 200,
                   seed: int = 0) -> list[float]:
    """The bound's settling time over `runs` runs, sorted (`math.inf`: not within the horizon).
    The bench compares its median with the law's median over plant seeds."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs!r}")
    if not learners:
        raise ValueError("settling_bound needs at least one container")
    rng = random.Random(seed)
    return sorted(_settling(learners, spec, rng) for _ in range(runs))


def median_bound(learners: Sequence[Learner], spec: BoundSpec, runs: int = 200,
                 seed: int = 0) -> float:
    return statistics.median(settling_bound(learners, spec, runs, seed))

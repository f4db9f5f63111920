"""How far the simulated GPU departs from an ideal one, and why the defaults are what they are.

`SimGpu` takes one `Imperfections`; `IDEAL` switches every effect off (SM time exactly
proportional to admitted launches, NVML samples exact to the integer percent on a fixed grid),
`REAL` (the default) is a GPU as the controller meets it in production:

- `nvml_sigma` 3 points: per-process SM samples are themselves sampled by the driver and
  windowed; repeated readings of a steady process scatter by a few points around its true use.
  With `nvml_noise` "sampled" (the default) a sample is the fraction of the driver's instants
  at which the process was seen busy: unbiased, never negative, its error largest (sigma) at
  50 % use and shrinking towards 0 % and 100 %, as a proportion's does. With "additive" each
  sample gets Gaussian noise of sigma whatever the use, clipped to [0, 100]: harsher, and
  biased upwards for processes using only a few percent. Either way the value is made the
  integer percent NVML reports (see "time-sliced" below for how).
- `missed_samples` 2 %: a process that ran in a period does not always appear in that period's
  samples (the driver's buffer is per GPU and finite); the law must not read a missing sample
  as zero use.
- `nvml_attribution` "per-process": every process that ran in a period gets a sample of its own
  SM use. "time-sliced" is what an H200 (driver 580) was measured to do when the contexts of
  two processes take turns without MPS: each period's single sample goes to one of the
  processes that ran in it, and its value is the whole GPU's busy time in that period, not
  the process's own (a process doing 5 % of the work beside a busy one read 99). The process
  is drawn with odds in proportion to its SM time in the period, which is a guess: the one
  measurement there was, a process doing 5 % of the work beside an unthrottled one, got 5
  periods of 18, far more than its SM time would give it. A process alone gets its own
  use either way (measured: 50/20/5 % of the work read 50/20/5). Asked less often than every
  period, that driver answers for all the periods since it was last asked with one sample per
  process given any of them, its value the use in the periods it was given over all of them
  (measured: asked every second beside two processes given 2 and 3 periods of 5, each read
  99, it answered 40 and 60; asked every 0.4 s, 50 and 50): `SimGpu` plays that, and every
  period goes to someone there (`missed_samples` does not apply; none was seen missing). Not
  yet the default: the throttle figures in BENCHMARKS.md are for "per-process" unless they
  say otherwise.
- `nvml_truncates` False: a sample is rounded to the whole percent. The H200 (driver 580)
  truncates (turns alone at 3.8, 6.7 and 8.6 % of the work read 3, 6 and 8), and so does
  `H200_TIME_SLICED`; the other plants keep rounding, their noise being a model of no
  measured driver (with the noisy time-sliced plant truncating, a container overclaiming
  its tokens kept its honest strict-60 neighbour at 49 % in five seeds of six, against three
  rounding: `test_controller_token_claims`).
- `launch_hold_s` 0 (off): what a time-sliced GPU counts busy beyond the work done, per
  launch, while two or more processes run in a period (a sample's value is then the GPU's
  busy time, work and holds together, at most the whole period). Measured on the H200: two
  processes each doing 20 % of the work read 99 with 20 us kernels (10,000 launches a second
  each) and 66 with 200 us kernels (1,000 a second each); every other pair measured read
  99-100 at 80 % of the work or more; a process alone read its own work exactly. 130 us a
  launch fits all of them: `H200_TIME_SLICED` below. One unsaturated reading is all it rests
  on, and why the GPU counts those holds was not measured (context switches between sparse
  launches, most likely), so it is off in `REAL`. It takes no GPU time from anyone (both
  unthrottled 20 us processes still did 45.8 % of the work each).
- `sample_lag_s` and `sample_lag_jitter_s` 0 (off): a sample can be read only this long after
  its stamp, plus up to the jitter more (uniform, drawn per period). Off by default: a real
  driver's delay from stamp to readable was not measured (the H200 runs measured the call's
  cost and the periods), and at 0 every sample can be read at its stamp, which flatters a
  reader's timing; the bench node's fake driver, writing its files from a thread of its own,
  lands with some tens of milliseconds of jitter.
- `window_periods` 1: each sample averages SM use over this many sample periods ending at its
  timestamp. Drivers that report every 1/6 s average over their own period; some report a
  value averaged over a longer window than they sample, which is `window_periods` > 1.
  The period itself (1/6 s to 1 s depending on the GPU and driver) is `SimGpu`'s
  `sample_period_s`.
- `kernel_jitter` 0.1: run-to-run variation of a kernel's duration (clock boost, memory
  contention, cache state), a relative standard deviation; the shim charges the same tokens
  for a launch whatever it ends up costing in SM time.
- `timeslice_s` 2 ms and `switch_s` 25 us: without MPS, contexts of different processes
  time-share the GPU in slices of about a few milliseconds, and every switch saves and restores
  a context; while two or more contexts have work, `switch_s` per `timeslice_s` is lost to
  everyone.
- `overlap` 5 %: at slice boundaries the outgoing context's last blocks drain while the
  incoming one starts, so for a small part of the time several contexts' kernels share the SMs,
  in proportion to their grids rather than equally.
- `sm_count` 132 and `packing_efficiency` 0.8: a kernel whose grid has fewer blocks than the GPU
  has SMs leaves SMs idle (fill = blocks / SMs). A process with several streams then runs up to
  `streams` such kernels at once (never more than fill up), and packed kernels slow each other
  down (shared L2 and memory bandwidth): c kernels together progress c**0.8 times as fast, not c
  times. SM time per launch therefore grows with the launch rate: tokens and SM time are not
  proportional, and the law can only learn their ratio at the operating point.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Imperfections:
    nvml_sigma: float = 3.0  # points, standard deviation of each per-process sample
    nvml_noise: str = "sampled"  # or "additive" (see the module note)
    missed_samples: float = 0.02  # probability that a process's sample is absent
    nvml_attribution: str = "per-process"  # or "time-sliced" (see the module note)
    window_periods: int = 1  # sample periods each sample averages over
    kernel_jitter: float = 0.1  # relative standard deviation of a kernel's duration
    timeslice_s: float = 0.002
    switch_s: float = 25e-6  # lost per time slice while contexts take turns
    overlap: float = 0.05  # fraction of the time busy contexts share SMs by grid size
    sm_count: int = 132  # 0: every grid fills the GPU
    packing_efficiency: float = 0.8  # c packed kernels progress c ** this times as fast
    launch_hold_s: float = 0.0  # busy NVML counts per launch while processes take turns
    nvml_truncates: bool = False  # whole percents truncated, not rounded (the H200's)
    sample_lag_s: float = 0.0  # a sample can be read this long after its stamp (not measured)
    sample_lag_jitter_s: float = 0.0  # ... plus up to this much more, drawn per period

    def __post_init__(self) -> None:
        checks = {
            "nvml_sigma": self.nvml_sigma >= 0,
            "nvml_noise": self.nvml_noise in ("sampled", "additive"),
            "missed_samples": 0 <= self.missed_samples < 1,
            "nvml_attribution": self.nvml_attribution in ("per-process", "time-sliced"),
            "window_periods": self.window_periods >= 1,
            "kernel_jitter": 0 <= self.kernel_jitter <= 1,
            "timeslice_s": self.timeslice_s > 0,
            "switch_s": 0 <= self.switch_s < self.timeslice_s,
            "overlap": 0 <= self.overlap <= 1,
            "sm_count": self.sm_count >= 0,
            "packing_efficiency": 0 < self.packing_efficiency <= 1,
            "launch_hold_s": 0 <= self.launch_hold_s < 0.1,
            "sample_lag_s": 0 <= self.sample_lag_s < 1,
            "sample_lag_jitter_s": 0 <= self.sample_lag_jitter_s < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"Imperfections.{name} out of range: {getattr(self, name)!r} "
                                 "(see the module note for what is allowed)")

    @property
    def instants(self) -> int:
        """How many busy-or-idle instants a "sampled" sample counts: a proportion of that many
        spreads by `nvml_sigma` at 50 % use (0 without noise)."""
        return max(1, round((50 / self.nvml_sigma) ** 2)) if self.nvml_sigma else 0

    def spread(self, percent: float) -> float:
        """The standard deviation of a sample of a process truly at `percent` (before the
        rounding to a whole percent)."""
        if not self.nvml_sigma:
            return 0.0
        if self.nvml_noise == "additive":
            return self.nvml_sigma
        p = min(1.0, max(0.0, percent / 100))
        return 100 * math.sqrt(p * (1 - p) / self.instants)

    def observe(self, percent: float, rng: random.Random) -> int:
        """What NVML reports for a process that truly used `percent` of the SMs."""
        sigma = self.nvml_sigma
        if sigma and self.nvml_noise == "additive":
            percent += rng.gauss(0, sigma)
        elif sigma:
            instants = self.instants
            p = min(1.0, max(0.0, percent / 100))
            if instants <= 400:
                busy = sum(1 for _ in range(instants) if rng.random() < p)
            else:
                busy = round(instants * p + rng.gauss(0, math.sqrt(instants * p * (1 - p))))
            percent = 100 * busy / instants
        percent = min(100.0, max(0.0, percent))
        return math.floor(percent + 1e-9) if self.nvml_truncates else round(percent)


IDEAL = Imperfections(nvml_sigma=0.0, missed_samples=0.0, window_periods=1, kernel_jitter=0.0,
                      switch_s=0.0, overlap=0.0, sm_count=0, packing_efficiency=1.0)
REAL = Imperfections()
# The GPU as the H200 (driver 580) was measured without MPS: each period whole to one process,
# with the busy time its launches hold (see the module note); a process's readings exact.
H200_TIME_SLICED = Imperfections(nvml_sigma=0.0, nvml_attribution="time-sliced",
                                 launch_hold_s=130e-6, nvml_truncates=True)

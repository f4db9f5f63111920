"""A time-sliced GPU's use, shared out among its containers.

Without MPS the contexts of a GPU's processes take turns, and NVML (seen on an H200, driver
580) gives each sample period whole to one process that ran in it, with the whole GPU's use as
its value. `TimeSlicedSplit` turns those periods, and the tokens each container spent, into a
use per container for the law (`throttle.controller` feeds it once per batch of samples).

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# periods after the last stamp with two processes or more before a GPU's samples are read as
# time-sliced again (`controller._utilization`); also how long a container given periods
# without spending tokens is charged for them after its last one
SHARED_PERIODS = 10


class TimeSlicedSplit:
    """Shares a time-sliced GPU's use out among its containers.

    NVML gives each sample period to one process, whole: a container's part of the periods
    is evidence of its SM time, but only over many periods (taken alone, one reading is 0 or
    the whole GPU, and a law steering on a slow average of them oscillates). Tokens spent
    answer at once but say nothing of how long a container's kernels run per token. So the
    GPU's use is split by tokens spent this tick, each container's weighted by how much SM
    time its tokens buy relative to the others: its part of the periods over its part of the
    tokens, both as moving averages over about PERIODS_REMEMBERED periods, the weight drawn
    towards 1 as far as the periods it was given could be chance. Periods given to
    processes of no container (strangers, "") are nobody's use here. A container lying about
    its tokens is corrected by its periods, as fast as the averages follow, and is never
    charged less than its part of the periods proves (`_floor_by_periods`); one whose
    processes spend no token at all (they run without the shim) is charged its part of the
    recent periods, the rest being split among the others.
    """

    __slots__ = ("parts", "unseen")

    def __init__(self) -> None:
        # alloc_id ("" for strangers) -> (part of the periods, part of the tokens, periods)
        self.parts: dict[str, tuple[float, float, int]] = {}
        self.unseen: dict[str, int] = {}  # alloc_id -> periods since one was given to it

    def share(self, owners: list[list[str]], busy: float, spent: Mapping[str, int]
              ) -> dict[str, float]:
        parts = self.parts
        for alloc_id in [*spent, *(o for given in owners for o in given)]:
            parts.setdefault(alloc_id, (0.0, 0.0, 0))
        for gone in [a for a in parts if a and a not in spent]:
            del parts[gone]
            self.unseen.pop(gone, None)
        total = sum(spent.values())
        unseen = self.unseen
        for given in owners:
            for alloc_id, (periods, tokens, n) in parts.items():
                n += 1
                alpha = max(1 / n, 1 / PERIODS_REMEMBERED)
                periods += alpha * ((alloc_id in given) - periods)
                if total > 0:
                    tokens += alpha * (spent.get(alloc_id, 0) / total - tokens)
                parts[alloc_id] = (periods, tokens, n)
                unseen[alloc_id] = 0 if alloc_id in given else unseen.get(alloc_id, 0) + 1
        # A container whose processes are given periods without spending a token runs
        # without the shim (or says so in `state`): it is charged its part of the recent
        # periods, while it keeps being given some. Not the periods of this batch alone: in a
        # batch it was not given, its neighbours would be charged the whole GPU, and the law,
        # which takes such all-or-nothing readings for missed samples, would starve them.
        unshimmed = {a: parts[a][0] * busy for a, used in spent.items()
                     if not used and unseen.get(a, SHARED_PERIODS) < SHARED_PERIODS}
        weights = {}
        for alloc_id, used in spent.items():
            if not used:
                continue
            periods, tokens, n = parts[alloc_id]
            cost = 1.0
            if tokens > _COST_EPS and periods > _COST_EPS:
                # Drawn towards 1 as far as the periods could be luck: were the costs equal,
                # its part of N periods drawn at random would be its part of the tokens, p,
                # off by sqrt((1 - p) / (p N)) of itself.
                drift = math.log(min(COST_RANGE, max(1 / COST_RANGE, periods / tokens)))
                luck = (1 - min(tokens, 1.0)) / (tokens * min(n, 2 * PERIODS_REMEMBERED))
                doubt = drift * drift + LUCK_SIGMAS**2 * luck
                cost = math.exp(drift * drift * drift / doubt) if doubt > 0 else 1.0
            weights[alloc_id] = used * cost
        weighted = sum(weights.values())
        ours = max(0.0, busy * (1 - min(1.0, parts.get("", (0.0, 0.0, 0))[0]))
                   - sum(unshimmed.values()))
        shares = {a: ours * w / weighted if weighted > 0 else 0.0 for a, w in weights.items()}
        _floor_by_periods(shares, self._floors(weights, busy))
        return dict.fromkeys(spent, 0.0) | shares | unshimmed

    def _floors(self, charged: Iterable[str], busy: float) -> dict[str, float]:
        """Per container whose weight is at its cap, the least use its part of the periods
        proves beyond chance: the lower end of the Wilson interval, LUCK_SIGMAS wide, of that
        part over the periods it rests on (sound with few periods and at parts of 0 or 1,
        where the binomial deviation is 0)."""
        floors = {}
        z2 = LUCK_SIGMAS * LUCK_SIGMAS
        for alloc_id in charged:
            p, tokens, n = self.parts[alloc_id]
            seen = min(n, 2 * PERIODS_REMEMBERED)
            # only where the weight can follow the periods no further (at its cap); below
            # it, the weight corrects the split as fast as the periods allow
            if seen and p > 0 and p >= COST_RANGE * tokens:
                low = (p + z2 / (2 * seen) - LUCK_SIGMAS * math.sqrt(
                    p * (1 - p) / seen + z2 / (4 * seen * seen))) / (1 + z2 / seen)
                if low > 0:
                    floors[alloc_id] = busy * low
        return floors


def _floor_by_periods(shares: dict[str, float], floors: Mapping[str, float]) -> None:
    """Lifts each share below its floor towards it, taking the difference from the shares
    above theirs, in proportion to how far above; the sum stays. The weights cap what periods
    can correct (COST_RANGE) and follow them slowly; without a floor, a container writing a
    small fraction of its spending into `state` would be charged little of the GPU's use and
    its neighbours the rest, and be throttled less while they are throttled more."""
    short = {a: floors[a] - s for a, s in shares.items() if floors.get(a, 0.0) > s}
    if not short:
        return
    spare = {a: s - floors.get(a, 0.0) for a, s in shares.items()
             if a not in short and s > floors.get(a, 0.0)}
    need, room = sum(short.values()), sum(spare.values())
    moved = min(need, room)
    if moved <= 0:
        return
    for alloc_id, gap in short.items():
        shares[alloc_id] += gap * moved / need
    for alloc_id, above in spare.items():
        shares[alloc_id] -= above * moved / room


PERIODS_REMEMBERED = 100
LUCK_SIGMAS = 2.0  # a cost this many of its own chance deviations away from 1 counts 80 %
COST_RANGE = 8.0  # SM time per token of one container against another's: within 1/8..8
_COST_EPS = 1e-3

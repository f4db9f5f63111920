"""How many tokens a container is believed to have spent in a tick: what its `state` claims,
but never more than its token bucket can have let through.

`state` is written by the container. A claim of more tokens than the rate and burst in force
allowed is provably false, and it is not harmless: the law learns what a percent of SM time
costs from spending against measured use, so a container claiming three times its spending
would be given about three times the rate it should have, run unthrottled and take its share
out of its neighbours'. The controller therefore believes at most what an upper bound of the
shim's bucket allows (`Bucket`): full (`burst`) when its rate begins to limit; in a tick it
lets through at most its balance plus the refill at the rate in force, and what is left,
capped at `burst`, is the next tick's bound.

What an honest shim may spend beyond that is lent, once, not every tick: the bound may fall to
`lent` below zero. `lent` is two bursts (the shim admits a launch once `min(cost, burst)`
tokens are there and takes its whole cost, a debt of up to one launch, which the law keeps
within half a burst; and its lazy refill may credit a raised rate for moments before the raise,
at most a burst where the bucket is capped) plus JITTER_S of refill (the caller measures the
time between a region's two reads with clocks taken around each read, so its own stalls cost
nothing; but a process stalled between admitting a launch and counting it adds its tokens late:
a variation that cancels from one tick to the next). A rate lowered at the end of the last tick
was in force until then: the refill counts the higher of the two. A container claiming the most
it may every tick is thus believed to spend its rate, and the law's feedback from measured use,
which the container cannot write, brings it to its share.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

JITTER_S = 0.1  # of refill lent for counters read early or late (a CFS period of stall)

# (upper bound of the shim's balance after the last tick, the rate in force during it)
Bucket = tuple[float, int]


def believed_spend(claimed: int, bucket: Bucket | None, rate: int, burst: int, dt_s: float
                   ) -> tuple[int, Bucket]:
    """(tokens believed spent in the tick, the bucket's bound after it).

    `bucket` is the bound after the previous tick, None when the bucket did not limit then;
    `rate` and `burst` are those in force during the tick, and limit (the caller passes no
    other); `claimed` is the difference of `state`'s totals, already clamped at 0."""
    # (Written with comparisons rather than min/max: it runs for every device every tick.)
    level, before = (burst, rate) if bucket is None else bucket
    fastest = rate if rate >= before else before
    lent = 2.0 * burst + fastest * JITTER_S
    # The bucket caps the balance, not what flows through it: spending as it refills, a tick
    # may take the balance it began with plus the whole refill.
    through = (level if level < burst else burst) + fastest * dt_s
    allowed = through + lent
    believed = claimed if claimed <= allowed else int(allowed) if allowed > 0 else 0
    left = through - believed
    return believed, (
        (left if left < burst else float(burst)) if left > -lent else -lent, rate)

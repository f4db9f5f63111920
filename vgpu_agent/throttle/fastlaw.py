"""The control law for all containers of one GPU at once, as the controller runs it every tick.

`control.control_step` is the reference: written to be read, one container at a time. This is
the same law, decision for decision, arranged for speed over a GPU's containers:

- What does not depend on the container is worked out once per call: the tuning read into
  locals, and for each measurement span and history of tick lengths (the containers of a GPU
  share theirs, ticked together) the part of the spending history it covers. A span of a
  sixth of a second covers two or three ticks of a history kept for 2.5 s, so the sums run
  over those ticks only, not the whole history.
- The per-container update (`control._observe`) is inlined, and a container's new state is
  built once, with its target. The steps across containers of that update, the first guess
  for work-conserving newcomers and whether the GPU counts as full, are the reference's own
  functions (`control.guess_newcomers`, `control.gpu_full`).
- The guarantees of the share allocation depend only on the containers' priorities and limits
  and on the capacity, which rarely change: they are computed once and remembered.

Agreement with the reference is exact, not approximate: every float is computed by the same
operations in the same order, sums by `sum` where the reference uses it (from Python 3.12 on
`sum` compensates its rounding, so a loop of `+=` would differ in the last bit). The ticks a
span does not cover carry weight 0.0, and adding h * 0.0 = 0.0 to a sum changes nothing, so
leaving them out is exact. The tests compare both laws' decisions with `==` on random inputs
and on recorded runs of the simulated GPU.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from vgpu_agent.throttle.control import (
    _BLANK,
    _EPS,
    _ZERO_SPREAD,
    FULL_SHARE,
    UNLIMITED_RATE,
    Claim,
    ControlParams,
    Decision,
    LoopState,
    Observation,
    _by_priority,
    _clamp_tokens,
    _judged_rate,
    _Learned,
    _noise_shape,
    gpu_full,
    guess_newcomers,
    span_weights,
    tick_lengths,
    used_and_lent,
    window_lengths,
)

_DEFAULT_PARAMS = ControlParams()
# The records are named tuples: built directly, without the Python-level `__new__` that spells
# out each field (the same object, a third of the cost).
_new = tuple.__new__

# Per measurement span: (weights, index of the first tick it covers, their sum, the sum of all
# but the newest: the same window one tick later).
_Window = tuple[tuple[float, ...], int, float, float]


def _window(span_s: float, lengths: tuple[float, ...]) -> _Window:
    weights = span_weights(span_s, lengths)
    first = 0
    while first < len(weights) and weights[first] == 0.0:
        first += 1
    return weights, first, sum(weights), sum(weights[:-1])


def _matched(history: tuple[float, ...], window: _Window, partial: float
             ) -> tuple[float, float]:
    """`control._matched_spend`, summing over the covered ticks only."""
    weights, first, total, later_total = window
    n = len(weights)
    h_len = len(history)
    unknown = 0.0
    if h_len < n:
        cut = n - h_len
        unknown = sum(weights[:cut])
        if unknown > partial or not history:
            return 0.0, 0.0
        if unknown > _EPS:
            # the oldest tick stands in for the ticks before the history, as in the reference
            hist = (history[0],) * cut + history
        else:
            weights = weights[cut:]
            n = h_len
            first = max(0, first - cut)
            total = sum(weights)
            later_total = sum(weights[:-1])
            hist = history
    else:
        hist = history[-n:] if h_len > n else history
    if total <= _EPS:
        return 0.0, 0.0
    covered_w = weights[first:]
    covered_h = hist[first:]
    matched = sum([h * w for h, w in zip(covered_h, covered_w, strict=True)]) / total
    later = sum([h * w for h, w in zip(covered_h[1:], covered_w[:-1], strict=True)])
    shifted = later / later_total if later_total > _EPS else matched
    off = abs(shifted - matched)
    if unknown > _EPS:
        off = max(off, unknown * hist[0])
    return matched, off


# (priorities, limits, capacity) -> the guarantees and their order, as `control._by_priority`
# gives them; small, since a GPU's containers and limits change rarely.
_GUARANTEES: dict[tuple[tuple[int, ...], tuple[float, ...], float],
                  tuple[list[float], list[int] | None]] = {}
_GUARANTEES_KEPT = 64


def _allocate(claims: Sequence[Claim], capacity: float) -> dict[str, float]:
    """`control.allocate(claims, capacity).target`, the guarantees remembered."""
    limited = [c for c in claims if c.policy != "off"]
    priorities = [c.priority for c in limited]
    limits = [c.limit for c in limited]
    key = (tuple(priorities), tuple(limits), capacity)
    known = _GUARANTEES.get(key)
    if known is None:
        if len(_GUARANTEES) >= _GUARANTEES_KEPT:
            _GUARANTEES.clear()
        known = _GUARANTEES[key] = _by_priority(priorities, limits, limits, capacity)
    guarantee, order = known
    used, lent = used_and_lent(limited, priorities, limits, capacity, order)
    return {
        c.key: min(capacity, max(g, u + extra))
        for c, g, u, extra in zip(limited, guarantee, used, lent, strict=True)
    }


def control_step_gpu(
    observations: Sequence[Observation],
    states: Mapping[str, LoopState],
    dt_s: float,
    params: ControlParams | None = None,
) -> dict[str, Decision]:
    """One tick of the law for the containers of one physical GPU; same as `control_step`."""
    if not dt_s > 0:
        raise ValueError(f"tick length must be > 0 s, got {dt_s!r}")
    p = params or _DEFAULT_PARAMS
    keys = [o.key for o in observations]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate container keys in one GPU's observations: {keys}")
    history_len = max(p.demand_ticks, math.ceil(p.history_s / dt_s) + 1)

    # the tuning, read once
    nvml_period_s = p.nvml_period_s
    wait_fraction = p.hungry_wait_fraction * dt_s
    spend_fraction, hysteresis = p.hungry_spend_fraction, p.hungry_hysteresis
    demand_ticks, demand_margin = p.demand_ticks, p.demand_margin
    boot_widening, resolution = p.boot_widening, p.resolution
    initial_var = p.initial_spread**2
    drift = p.drift_per_s**2 * dt_s
    noise_prior, noise_memory, held_tolerance = p.noise_prior, p.noise_memory, p.held_tolerance
    floor = resolution**2 / 12
    surprise2, confirm = p.surprise_sigmas**2, p.confirm_surprises
    noise_tail, missing_above, partial = p.noise_tail, p.missing_above, p.partial_window
    relearn_weight, relearn_span_s = p.relearn_weight, p.relearn_span_s
    floor_trust2 = p.floor_trust**2

    windows: dict[tuple[float, int], _Window] = {}  # (span, id of the window's lengths)
    # The containers of a GPU are ticked together, so their histories of tick lengths are
    # equal: each new one is made once and shared (found by the one before and the history's
    # length; shared tuples compare by identity, element by element).
    shared: dict[tuple[tuple[float, ...], int], tuple[tuple[float, ...], tuple[float, ...]]] = {}
    previous: list[LoopState] = []
    # per container: (k, lower_bound, history, cost, util, spread, noise, pairs, pair, k_floor,
    # learned, adopted, hungry), as `control._Learned`
    learned_all: list[_Learned] = []
    hungers: list[bool] = []
    demands: list[float] = []
    off_uses: list[float] = []  # summed by `sum`, as the reference does (see the note)
    for o in observations:
        prev = states.get(o.key, _BLANK)
        previous.append(prev)
        spent, rate_in_force, util = o.spent, o.rate, o.util
        spend_rate = spent / dt_s
        history = (*prev.spend_history, spend_rate)[-history_len:]
        made = (prev.tick_lengths, len(prev.spend_history)) if prev is not _BLANK else None
        known = shared.get(made) if made is not None else None
        if known is None:
            lengths = tick_lengths(prev, dt_s, history_len)
            known = (lengths, window_lengths(lengths, dt_s, history_len))
            if made is not None:
                shared[made] = known
        lengths = known[0]
        cost = prev.cost_per_launch * 0.99
        if o.launches:
            cost = max(cost, spent / o.launches)
        waited = o.waited_s >= wait_fraction
        recent = history[-demand_ticks:]
        fraction = spend_fraction - (hysteresis if prev.hungry else 0.0)
        hungry = waited or (
            rate_in_force < UNLIMITED_RATE
            and max(spend_rate, sum(recent) / len(recent))
            >= fraction * _judged_rate(rate_in_force, o.limit, prev)
        )

        k, lower_bound, learned = prev.tokens_per_pct, prev.lower_bound, prev.learned
        spread, noise = prev.spread, prev.noise or noise_prior
        noise_pairs, last_pair, k_floor = prev.noise_pairs, prev.last_pair, prev.k_floor
        adopted, surprise = prev.adopted, prev.surprise
        if k <= 0 and spend_rate > 0 and rate_in_force >= UNLIMITED_RATE:
            share_bound = FULL_SHARE
            if util is not None and util >= 1:
                share_bound = min(FULL_SHARE, boot_widening * util + 1)
            k, lower_bound = spend_rate / share_bound, True
            k_floor, spread = spend_rate / FULL_SHARE, initial_var
        elif k > 0:
            spread += drift
        if prev is _BLANK:
            history = ()
        if util is not None:
            span = o.util_span_s or nvml_period_s
            placed = (span, id(known[1]))
            window = windows.get(placed)
            if window is None:
                window = windows[placed] = _window(span, known[1])
            if k <= 0:
                if util >= resolution:
                    x, _ = _matched(history, window, partial)
                    if x > 0:
                        spread = max(noise * _noise_shape(util, noise_tail), floor) \
                            / o.util_samples / util**2
                        k, last_pair, adopted = x / util, (x, util), True
                        learned += 1
            elif k > 0:  # not NaN: a NaN learns nothing, as in the reference
                x, misaligned = _matched(history, window, partial)
                if x <= 0 and not any(history):
                    surprise = 0.0  # idle as long as the history holds (control.py)
                if x > 0 and util < resolution and x / k > missing_above:
                    # NVML missed its processes, once; twice in a row, a bound (control.py)
                    expected = x / k
                    scatter = max(noise * _noise_shape(expected, noise_tail), floor) \
                        / o.util_samples
                    # beyond what noise reaches, or beyond the noise alone while the estimate
                    # is too loose to learn from it; otherwise a reading like any other
                    if (expected * expected > surprise2 * (expected * expected * spread + scatter)
                            or (spread * surprise2 * _ZERO_SPREAD > 1
                                and expected * expected > surprise2 * scatter)):
                        if learned and surprise < 0:
                            k, k_floor, surprise = max(k, x / resolution), 0.0, 0.0
                            spread = max(spread, initial_var)
                            learned += 1
                        else:
                            surprise = -x / k
                        x = 0.0
                if x > 0:
                    b = 1 / k
                    shape = _noise_shape(b * x, noise_tail)
                    held_x, held_y = last_pair
                    if (shape > noise_tail and held_x > 0
                            and abs(x - held_x) <= held_tolerance * max(x, held_x)):
                        seen = (util - held_y * x / held_x) ** 2 / 2 * o.util_samples / shape
                        seen = min(seen, surprise2 * noise)
                        weight = max(noise_memory, 1 / (noise_pairs + 2))
                        noise = max(floor, (1 - weight) * noise + weight * seen)
                        noise_pairs += 1
                    last_pair = (x, util)
                    alignment = (b * misaligned) ** 2
                    r = max(noise * shape, floor) / o.util_samples + alignment
                    pv = spread * b * b
                    innovation = util - b * x
                    bound = surprise2 * (x * x * pv + r)
                    far = innovation * innovation > bound
                    relearn = False
                    if surprise * innovation > 0 or (far and (b == 0 or not confirm)):
                        pv, k_floor, surprise = max(pv, (innovation / x) ** 2), 0.0, 0.0
                        relearn = confirm
                    elif not far:
                        surprise = 0.0
                    else:  # once: an outlier until the next measurement says otherwise
                        surprise = innovation
                        innovation = math.copysign(math.sqrt(bound), innovation)
                    gain = pv * x / (x * x * pv + r)
                    b = max(b + gain * innovation, _EPS * b)
                    pv *= 1 - gain * x
                    if relearn:  # one reading, or a part of one where samples come often
                        weight = relearn_weight if span <= relearn_span_s else 1.0
                        pv = max(pv, r / (weight * x * x))
                    k = max(1 / b, k_floor)
                    spread, lower_bound = pv * k * k, False
                    learned += 1
                    if spread <= floor_trust2:
                        k_floor = 0.0  # the estimate knows k better than the bound
        demand = max(history[-demand_ticks:], default=0.0) / k + demand_margin if k > 0 else 0.0
        last_util = prev.util if util is None else util
        learned_all.append((k, lower_bound, history, cost, last_util, spread, noise, noise_pairs,
                            last_pair, k_floor, learned, adopted, hungry, lengths, surprise))
        hungers.append(hungry)
        demands.append(demand)
        if o.policy == "off":
            off_uses.append(last_util or 0.0)

    guess_newcomers(observations, previous, learned_all, demands, p)
    full = gpu_full(learned_all, p)
    claims = [
        Claim(o.key, o.limit, o.policy, o.priority,
              hungry or (full and bool(lrn[2]) and lrn[2][-1] > 0), demand)
        for o, lrn, hungry, demand in zip(observations, learned_all, hungers, demands,
                                          strict=True)
    ]
    targets = _allocate(claims, max(0.0, FULL_SHARE - sum(off_uses)))

    cold_samples, cold_sigmas = p.cold_samples, p.cold_sigmas
    min_rate, deadband = p.min_rate, p.rate_deadband
    burst_s, burst_launches = p.burst_s, p.burst_launches
    decisions: dict[str, Decision] = {}
    for o, prev, lrn, hungry, demand in zip(observations, previous, learned_all, hungers,
                                            demands, strict=True):
        (k, lower_bound, spends, cost, util, spread, noise, pairs, pair, k_floor, count,
         adopted, _, lengths, surprise) = lrn
        key = o.key
        if o.policy != "off" and not math.isfinite(k):
            k = 0.0  # nothing sane was learned: start over from no model
        if o.policy == "off":
            decisions[key] = _new(Decision, (
                UNLIMITED_RATE, UNLIMITED_RATE, FULL_SHARE, hungry, demand,
                _new(LoopState, (k, lower_bound, spends, cost, util, spread, noise, pairs, pair,
                                 k_floor, prev.target, count, adopted, hungry, lengths,
                                 surprise))))
            continue
        target = targets[key]
        rate_in_force = o.rate
        if k <= 0 or (adopted and count < cold_samples and rate_in_force < UNLIMITED_RATE):
            kept_rate, kept_burst = (
                (rate_in_force, o.burst) if rate_in_force < UNLIMITED_RATE
                else (UNLIMITED_RATE, UNLIMITED_RATE))
            decisions[key] = _new(Decision, (
                kept_rate, kept_burst, target, hungry, demand,
                _new(LoopState, (k, lower_bound, spends, cost, util, spread, noise, pairs, pair,
                                 k_floor, prev.target, count, adopted, hungry, lengths,
                                 surprise))))
            continue
        k_rate = k
        if o.policy == "strict" and 0 < count < cold_samples and cold_sigmas:
            fade = 1 - count / cold_samples
            k_rate /= 1 + cold_sigmas * fade * math.sqrt(spread)
            k_rate = max(k_rate, k_floor)
        # within the documented bounds [min_rate, UNLIMITED_RATE], whatever was learned
        rate = _clamp_tokens(k_rate * target, min_rate)
        state = _new(LoopState, (k, lower_bound, spends, cost, util, spread, noise, pairs, pair,
                                 k_floor, target, count, adopted, hungry, lengths, surprise))
        by_launch = _clamp_tokens(burst_launches * cost, 1, math.ceil)
        if rate_in_force < UNLIMITED_RATE and abs(rate - rate_in_force) <= deadband * rate_in_force:
            deeper = max(o.burst, min(by_launch, rate_in_force))  # see control.py
            decisions[key] = _new(Decision, (rate_in_force, deeper, target, hungry, demand, state))
            continue
        burst = max(_clamp_tokens(rate * burst_s, 1), min(by_launch, rate))
        decisions[key] = _new(Decision, (rate, burst, target, hungry, demand, state))
    return decisions

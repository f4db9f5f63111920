"""The control law in C, where it was built: `fastlaw.control_step_gpu`, decision for decision.

`_lawc.c` (built by `pip install .` through setup.py; optional) computes every float by the
operations the Python law uses, in its order, so its decisions equal the reference's with `==`
(the tests compare them on random inputs and on recorded runs of the simulated GPU). Where the
input is not what the law makes (an int beyond 2**53, a state that is not a `LoopState`) or
where Python would raise (a division by zero, an overflowing square), the C step declines and
the Python law decides: the answer, or the error, is then the reference's own.

Without the extension (no compiler where the package was built), or with one built from a
reference law whose constants have since moved, `control_step_native` is the Python law itself;
`NATIVE` says which one runs and `NOT_NATIVE_REASON` why not.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vgpu_agent import native
from vgpu_agent.throttle import control
from vgpu_agent.throttle.control import ControlParams, Decision, LoopState, Observation
from vgpu_agent.throttle.fastlaw import control_step_gpu

_PACKED: dict[ControlParams, tuple[float | int, ...]] = {}
_PACKED_KEPT = 16


def _packed(p: ControlParams) -> tuple[float | int, ...]:
    """The tuning in the order `_lawc.read_params` reads it, with the squares the Python law
    works out once per call worked out here, by the same operations."""
    known = _PACKED.get(p)
    if known is None:
        if len(_PACKED) >= _PACKED_KEPT:
            _PACKED.clear()
        known = _PACKED[p] = (
            p.nvml_period_s, p.hungry_wait_fraction, p.hungry_spend_fraction,
            p.hungry_hysteresis, p.demand_margin, p.boot_widening, p.resolution,
            p.initial_spread**2, p.drift_per_s**2, p.noise_prior, p.noise_memory,
            p.held_tolerance, p.resolution**2 / 12, p.surprise_sigmas**2, p.noise_tail,
            p.missing_above, p.partial_window, p.saturation_margin, p.cold_sigmas,
            p.rate_deadband, p.burst_s, p.burst_launches, p.demand_ticks, p.cold_samples,
            p.min_rate, int(p.confirm_surprises), p.relearn_weight, p.relearn_span_s,
            p.floor_trust**2, p.saturation_sigmas,
        )
    return known


def bind(module: Any) -> str | None:
    """Bind the C law to this reference law: None where it is bound, else why it cannot be (it
    was built from a law whose constants or `bind` differ; the binding in force, if any, is
    kept)."""
    try:
        module.bind(LoopState, Decision, control._BLANK, control.UNLIMITED_RATE,
                    control.FULL_SHARE, control._ZERO_SPREAD, control._EPS,
                    len(_packed(ControlParams())))
    except (TypeError, ValueError) as error:  # TypeError: a bind of another signature
        return f"vgpu_agent.throttle._lawc was built from another version of the law: {error}"
    return None


# A stale build would disagree with the reference in the branches that use the constants it
# compiled in: the Python law decides instead, and the controller says why.
_lawc, NOT_NATIVE_REASON = native.load("vgpu_agent.throttle._lawc", bind)

NATIVE = _lawc is not None
_DEFAULT_PARAMS = ControlParams()


def native_step(
    observations: Sequence[Observation],
    states: Mapping[str, LoopState],
    dt_s: float,
    params: ControlParams | None = None,
) -> dict[str, Decision] | None:
    """The C step alone: its decisions, or None where it leaves them to the Python law (or
    was not built). Input checks are `control_step_gpu`'s."""
    if not dt_s > 0:
        raise ValueError(f"tick length must be > 0 s, got {dt_s!r}")
    keys = [o.key for o in observations]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate container keys in one GPU's observations: {keys}")
    if _lawc is None:
        return None
    p = params or _DEFAULT_PARAMS
    history_len = max(p.demand_ticks, math.ceil(p.history_s / dt_s) + 1)
    # (the C step also leaves histories beyond 100,000 ticks, ticks under 25 us, to Python)
    if type(dt_s) is not float or type(states) is not dict:
        return None
    listed = observations if type(observations) is list else list(observations)
    decided: dict[str, Decision] | None = _lawc.step(listed, states, dt_s, _packed(p),
                                                     history_len)
    return decided


def control_step_native(
    observations: Sequence[Observation],
    states: Mapping[str, LoopState],
    dt_s: float,
    params: ControlParams | None = None,
) -> dict[str, Decision]:
    """One tick of the law for one GPU's containers; same as `control.control_step`."""
    decided = native_step(observations, states, dt_s, params)
    if decided is None:
        return control_step_gpu(observations, states, dt_s, params)
    return decided

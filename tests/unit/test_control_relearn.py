"""A container whose readings change basis (its figure from a turn alone, on a time-sliced GPU,
charges it from then on instead of its tokens at a learned cost): `relearn` makes the law's `k`
as uncertain as at cold start, so that the next reading re-learns it (the three laws agree);
the controller does so for the container measured and for each neighbour whose `k` is apart
from its own figure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tests.unit.test_control_fastlaw_agreement import assert_same, native
from vgpu_agent.throttle.control import (
    ControlParams,
    LoopState,
    Observation,
    control_step,
    relearn,
)
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.turnkeeper import relearn_after_turn

TICK = 0.2
K = 20_000.0  # tokens/s that buy one percent, as learned from the old charges
LAWS = [control_step, control_step_gpu, native]
SPLIT = ControlParams(confirm_surprises=False)  # the law's tuning for a time-sliced split


def _confident(share: float) -> LoopState:
    """A container at `share` % whose k the law is sure of, after charges that moved while
    the split learned its costs (so a noise of 30 points^2 was learned from them)."""
    return LoopState(tokens_per_pct=K, spend_history=(share * K,) * 12, learned=35,
                     spread=0.0006, noise=30.0, noise_pairs=20, target=share)


def _read(law, state: LoopState, util: float, share: float) -> LoopState:
    obs = [Observation("c", 50.0, "strict", spent=int(share * K * TICK), launches=10,
                       util=util, rate=int(share * K), burst=int(share * K))]
    decisions = law(obs, {"c": state}, TICK, SPLIT)
    assert_same(decisions, control_step(obs, {"c": state}, TICK, SPLIT))
    return decisions["c"].state


@pytest.mark.parametrize("law", LAWS)
def test_a_new_basis_is_learned_from_its_first_reading(law):
    # charged 48 % before the figure, 67 % by it at the same spending (the simulated H200's
    # strict 50 % container after its turn)
    kept = _read(law, _confident(48.0), 67.0, 48.0)
    assert kept.tokens_per_pct > 0.9 * K  # a few percent a reading: told nothing
    fresh = _read(law, relearn(_confident(48.0), SPLIT), 67.0, 48.0)
    assert fresh.tokens_per_pct == pytest.approx(K * 48.0 / 67.0, rel=0.05)
    again = _read(law, fresh, 67.0, 48.0)  # and it holds there
    assert again.tokens_per_pct == pytest.approx(K * 48.0 / 67.0, rel=0.05)


def test_relearn_widens_the_estimate_and_keeps_the_rest():
    state = _confident(48.0)._replace(surprise=5.0, k_floor=1e5)
    got = relearn(state, SPLIT)
    assert got.spread == SPLIT.initial_spread**2
    assert got.surprise == 0.0
    assert got.k_floor == 0.0  # the cold-start bound described the workload before the turn
    assert got._replace(spread=state.spread, surprise=state.surprise,
                        k_floor=state.k_floor) == state
    wider = state._replace(spread=4.0)
    assert relearn(wider, SPLIT).spread == 4.0  # never narrowed


def test_relearn_leaves_a_state_with_nothing_learned_as_it_is():
    blank = LoopState()
    assert relearn(blank, SPLIT) is blank
    history = LoopState(spend_history=(1.0, 2.0))
    assert relearn(history, SPLIT) is history


def _after_turn(measured: str, states: dict[str, LoopState], figures: dict[str, float]
                ) -> dict[str, LoopState]:
    """The law's states after a turn alone gave `measured` its figure (`figures`: each trusted
    one, use per token/s), as the controller leaves them."""
    devices = {key: SimpleNamespace(alloc_id=key.split("/")[0]) for key in states}
    states = dict(states)
    relearn_after_turn(measured, states, devices, figures, SPLIT)  # type: ignore[arg-type]
    return states


def test_after_a_turn_the_measured_one_relearns_and_neighbours_only_where_their_k_is_apart():
    # k = 20 000 tokens/s a percent: a use per token/s of 1 / 20 000
    near, apart = 1 / K * 1.05, 1 / K * 1.3  # figures 5 % and 30 % from what k says
    states = {f"{name}/0": _confident(40.0) for name in ("m", "near", "apart", "none")}
    states["gone/0"] = LoopState()
    got = _after_turn("m", states, {"m": 1 / K, "near": near, "apart": apart})
    assert got["m/0"].spread == SPLIT.initial_spread**2  # even where its k agrees with it
    assert got["apart/0"].spread == SPLIT.initial_spread**2
    assert got["near/0"] == states["near/0"]  # a reading's noise, not a new basis
    assert got["none/0"] == states["none/0"]  # no figure of its own to judge by
    assert got["gone/0"] is states["gone/0"]  # nothing learned yet
    low = _after_turn("m", {"low/0": _confident(40.0)}, {"low": 1 / K / 1.3})
    assert low["low/0"].spread == SPLIT.initial_spread**2  # apart either way
    infinite = {"m/0": _confident(40.0)._replace(tokens_per_pct=math.inf)}
    assert _after_turn("m", infinite, {"m": 1 / K}) == infinite  # nothing to re-learn from

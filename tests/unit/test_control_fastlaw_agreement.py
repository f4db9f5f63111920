"""The fast laws, in Python (`fastlaw`) and in C (`nativelaw`), decide exactly as the reference
law: on random ticks, after an agent restart, and on recorded runs of the simulated GPU under
noise.

Equality is exact (`==` on every rate, burst, target, flag and learned state, floats included):
the fast laws compute each float by the same operations in the same order, so no tolerance is
needed, and any drift would show here first. The C step is called alone here (it must not
hand these ticks back to the Python law); where it does, `test_control_nativelaw_agreement`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.imperfections import Imperfections
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec
from vgpu_agent.throttle.control import (
    UNLIMITED_RATE,
    ControlParams,
    Decision,
    LoopState,
    Observation,
    control_step,
)
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import NATIVE, native_step

container = st.fixed_dictionaries({
    "limit": st.floats(1.0, 100.0),
    "policy": st.sampled_from(["strict", "work-conserving", "off"]),
    "priority": st.integers(0, 3),
    "spend": st.integers(0, 10**9),  # tokens a tick while busy
    "busy": st.floats(0.0, 1.0),  # fraction of ticks it spends
    "written": st.one_of(st.none(), st.integers(1, 10**10)),  # a rate found written at start
    "launches": st.integers(0, 50),
})
tick = st.tuples(
    st.lists(st.one_of(st.none(), st.floats(0.0, 100.0)), min_size=6, max_size=6),  # util
    st.lists(st.floats(0.0, 0.2), min_size=6, max_size=6),  # waited
    st.floats(0.02, 0.5),  # the tick's length
    st.sampled_from([0.0, 1 / 6, 0.2, 0.5, 1.0, 2.0]),  # the samples' span (0: the default)
    st.integers(1, 6),  # samples per process
)


def assert_same(fast: Mapping[str, Decision], reference: Mapping[str, Decision]) -> None:
    """Equal decisions. A NaN the law kept equals the NaN it keeps: the Python laws pass the
    very object on, which `==` on tuples takes as equal; the C law makes a new one."""
    assert list(fast) == list(reference)
    for key, want in reference.items():
        got = fast[key]
        assert got == want or repr(got) == repr(want), f"{key}: fast {got!r} != reference {want!r}"


def native(observations: Sequence[Observation], states: Mapping[str, LoopState], dt_s: float,
           params: ControlParams | None = None) -> dict[str, Decision]:
    """The C step alone, which must not decline input the law makes."""
    decided = native_step(observations, states, dt_s, params)
    assert decided is not None, "the C step declined input the law makes"
    return decided


LAWS = [
    pytest.param(control_step_gpu, id="python"),
    pytest.param(native, id="c", marks=pytest.mark.skipif(not NATIVE, reason="not built")),
]


@pytest.mark.parametrize("law", LAWS)
@settings(max_examples=150, deadline=None)
@given(st.lists(container, min_size=1, max_size=6), st.lists(tick, min_size=3, max_size=40),
       st.sampled_from([None, ControlParams(cold_samples=0), ControlParams(demand_ticks=1),
                        ControlParams(history_s=0.3, rate_deadband=0.0),
                        ControlParams(cold_sigmas=0.0, surprise_sigmas=0.5),
                        ControlParams(surprise_sigmas=0.5, confirm_surprises=False),
                        ControlParams(saturation_sigmas=0.0),
                        ControlParams(saturation_sigmas=10.0, saturation_margin=0.0)]))
def test_random_ticks_give_identical_decisions(law, containers, steps, params):
    states: dict[str, LoopState] = {}
    rates = {
        f"c{i}": (c["written"], max(1, c["written"] // 50)) if c["written"]
        else (UNLIMITED_RATE, UNLIMITED_RATE)
        for i, c in enumerate(containers)
    }
    for n, (utils, waits, dt, span, samples) in enumerate(steps):
        observations = []
        for i, c in enumerate(containers):
            key = f"c{i}"
            busy = (n * 7 + i) % 10 < c["busy"] * 10
            rate, burst = rates[key]
            spent = c["spend"] if busy else 0
            if rate < UNLIMITED_RATE:
                spent = min(spent, round(rate * dt))
            observations.append(Observation(
                key, c["limit"], c["policy"], c["priority"], spent=spent,
                launches=c["launches"] if spent else 0, waited_s=waits[i], util=utils[i],
                rate=rate, burst=burst, util_span_s=span, util_samples=samples,
            ))
        reference = control_step(observations, states, dt, params)
        assert_same(law(observations, states, dt, params), reference)
        states = {key: d.state for key, d in reference.items()}
        rates = {key: (d.rate, d.burst) for key, d in reference.items()}


@pytest.mark.parametrize("law", LAWS)
def test_a_state_with_a_short_history_and_a_long_span_is_read_the_same(law):
    # the measurement's window reaches back before the history: neither law learns from it
    states = {"a": LoopState(tokens_per_pct=1e5, spend_history=(2e6,), learned=4)}
    obs = [Observation("a", 50.0, "strict", spent=200_000, util=20.0, rate=2_000_000,
                       burst=40_000, util_span_s=1.0)]
    reference = control_step(obs, states, 0.1)
    assert_same(law(obs, states, 0.1), reference)
    assert reference["a"].state.learned == 4


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("policy", ["strict", "work-conserving"])
def test_a_window_reaching_a_little_before_the_history_is_read_the_same(law, policy):
    # 1 s ending half a tick ago over 9 ticks of history: 0.15 of it lies before, which the
    # oldest tick stands in for; both laws learn from it, and alike
    states = {"a": LoopState(tokens_per_pct=1e5, lower_bound=True, k_floor=5e4,
                             spend_history=(4e6, *(2e6,) * 7), spread=1.0)}
    obs = [Observation("a", 50.0, policy, spent=200_000, util=23.0, rate=2_000_000,
                       burst=40_000, util_span_s=1.0)]
    reference = control_step(obs, states, 0.1)
    assert_same(law(obs, states, 0.1), reference)
    assert reference["a"].state.learned == 1


@pytest.mark.parametrize("law", [control_step, control_step_gpu, native_step])
def test_bad_input_is_refused_alike(law):
    obs = Observation("a", 50, "strict")
    with pytest.raises(ValueError, match="tick length"):
        law([obs], {}, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        law([obs, obs], {}, 0.1)


class Comparing:
    """A law for the controller that runs a fast law and the reference on the same input and
    checks they agree."""

    def __init__(self, law: Callable[..., dict[str, Decision]]) -> None:
        self.law = law
        self.ticks = 0
        self.limited = 0

    def __call__(self, observations: Sequence[Observation], states: Mapping[str, LoopState],
                 dt_s: float, params: ControlParams | None = None) -> dict[str, Decision]:
        reference = control_step(observations, states, dt_s, params)
        assert_same(self.law(observations, states, dt_s, params), reference)
        self.ticks += 1
        self.limited += sum(d.rate < UNLIMITED_RATE for d in reference.values())
        return reference


BUSY = Workload(kernel_s=0.002)
ON_OFF = Workload(kernel_s=0.001, blocks=256, busy=((0.0, 3.0), (5.0, 8.0)))


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize(("sigma", "period"), [(3.0, 1 / 6), (8.0, 1.0), (0.0, 1 / 6)])
def test_recorded_runs_of_the_noisy_gpu_give_identical_decisions(law, sigma, period):
    containers = (
        ContainerSpec("strict", 30, BUSY, policy="strict"),
        ContainerSpec("lender", 20, ON_OFF, priority=1),
        ContainerSpec("borrower", 25, Workload(kernel_s=0.0005, blocks=64), processes=2),
        ContainerSpec("free", 10, BUSY, policy="off"),
    )
    plant = PlantSpec(Imperfections(nvml_sigma=sigma), sample_period_s=period, seed=7)
    run = ControlledRun(containers, plant=plant)
    comparing = Comparing(law)
    run.controller.law = comparing
    asyncio.run(run.advance(10))
    assert comparing.ticks == 100
    assert comparing.limited > 100  # the runs throttled: rates were decided, not only kept
    assert run.controller.error_counts == {}


@pytest.mark.parametrize("state", [
    LoopState(tokens_per_pct=math.inf, spend_history=(1e6,) * 30, learned=5),
    LoopState(tokens_per_pct=math.nan, spend_history=(1e6,) * 30, learned=5),
    LoopState(tokens_per_pct=1e300, spend_history=(1e6,) * 30, learned=5),
    LoopState(tokens_per_pct=1e4, spend_history=(1e6,) * 30, cost_per_launch=1e300, learned=5),
])
@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("policy", ["strict", "work-conserving", "off"])
def test_insane_learned_states_are_bounded_alike(law, state, policy):
    # what a hostile container could make the law learn: the laws clamp or restart the same way
    obs = [Observation("a", 50.0, policy, spent=100_000, launches=1, util=40.0, rate=1_000_000,
                       burst=20_000)]
    reference = control_step(obs, {"a": state}, 0.1)
    assert_same(law(obs, {"a": state}, 0.1), reference)
    assert 0 < reference["a"].rate <= UNLIMITED_RATE and 0 < reference["a"].burst <= UNLIMITED_RATE

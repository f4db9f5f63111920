"""The law in C as the agent runs it: built where the tests run, the controller's default, and,
where it declines (input the law never makes, or where Python would raise), handing the tick
to the Python law, whose answer or error is then the one. Its agreement with the reference on
random ticks and recorded runs is in `test_control_fastlaw_agreement`.
"""

from __future__ import annotations

import gc
import importlib
import re
import sys
import tracemalloc
import types

import pytest

from tests.unit.test_control_fastlaw_agreement import assert_same, native
from vgpu_agent.throttle import control, nativelaw
from vgpu_agent.throttle.control import LoopState, Observation, control_step
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.nativelaw import control_step_native, native_step


def test_the_extension_is_built_where_the_tests_run():
    # `pip install -e .` (the test command's first step) compiles it; without it the agent runs
    # the Python law at several times the cost, which the benchmarks would quietly measure
    assert nativelaw.NATIVE, "vgpu_agent/throttle/_lawc.c was not built: is a C compiler there?"


def test_the_controller_runs_the_native_law_by_default():
    controller = ThrottleController(backend=None, regions=list)  # type: ignore[arg-type]
    assert controller.law is control_step_native


LEARNED = LoopState(tokens_per_pct=1e5, spend_history=(2e6,) * 30, tick_lengths=(0.1,) * 30,
                    spread=0.01, last_pair=(2e6, 20.0), learned=5, noise_pairs=3)
BUSY_OBS = Observation("a", 50.0, "strict", spent=200_000, launches=10, util=21.0,
                       rate=2_000_000, burst=40_000)


@pytest.mark.parametrize(("observation", "states"), [
    (BUSY_OBS._replace(limit=50), {"a": LEARNED}),  # an int limit: sums treat ints apart
    (BUSY_OBS._replace(spent=2**60), {"a": LEARNED}),  # beyond what a double holds exactly
    (BUSY_OBS._replace(util=21), {"a": LEARNED}),
    (BUSY_OBS, types.MappingProxyType({"a": LEARNED})),  # not a dict
    (BUSY_OBS, {"a": LEARNED._replace(spend_history=(2e6,) * 29 + (2_000_000,))}),
    (BUSY_OBS, {"a": LEARNED._replace(last_pair=(1.0,))}),  # not a pair
    (BUSY_OBS, {"a": tuple(LEARNED)[:-1]}),  # not a LoopState
])
def test_input_the_law_never_makes_is_left_to_the_python_law(observation, states):
    assert native_step([observation], states, 0.1) is None
    # the answer is the reference's (or, for what it cannot read, its error)
    try:
        reference = control_step([observation], dict(states), 0.1)
    except (AttributeError, TypeError, ValueError, IndexError) as error:
        with pytest.raises(type(error)):
            control_step_native([observation], states, 0.1)
    else:
        assert_same(control_step_native([observation], states, 0.1), reference)


@pytest.mark.parametrize("state", [
    LEARNED._replace(noise_pairs=-2),  # 1 / (pairs + 2)
    LEARNED._replace(last_pair=(2e6, 1e200)),  # (util - ...) ** 2 overflows
    pytest.param(  # (b * misaligned) ** 2 overflows
        LEARNED._replace(tokens_per_pct=1e-300),
        marks=pytest.mark.skipif(sys.version_info >= (3, 12),
                                 reason="from 3.12 the reference computes through it (nan)")),
])
def test_where_python_raises_the_native_law_raises_the_same(state):
    obs = [BUSY_OBS]
    with pytest.raises(ArithmeticError) as reference:
        control_step(obs, {"a": state}, 0.1)
    assert native_step(obs, {"a": state}, 0.1) is None
    with pytest.raises(type(reference.value)):
        control_step_native(obs, {"a": state}, 0.1)


def test_bad_input_is_refused_like_the_python_law():
    obs = Observation("a", 50.0, "strict")
    with pytest.raises(ValueError, match="tick length"):
        control_step_native([obs], {}, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        control_step_native([obs, obs], {}, 0.1)
    assert control_step_native([], {}, 0.1) == {}


def test_many_steps_leave_no_memory_behind():
    observations = [BUSY_OBS._replace(key=f"c{i}", priority=i % 2) for i in range(18)]
    states = {o.key: LEARNED for o in observations}

    def run(ticks: int) -> None:
        nonlocal states
        for _ in range(ticks):
            decided = native(observations, states, 0.1)
            states = {key: d.state for key, d in decided.items()}

    run(50)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(2000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # one tuple leaked per container and step would be megabytes
    assert grown < 64_000, f"{grown} bytes more after 2000 steps"


@pytest.mark.parametrize(("zero_spread", "eps"),
                         [(5.0, control._EPS), (control._ZERO_SPREAD, 1e-6)])
def test_a_reference_law_whose_constants_moved_is_refused_by_the_built_one(
        monkeypatch, zero_spread, eps):
    # The C law compiles in the constants of a branch or two; bound to a reference law whose
    # values moved, it would disagree only where those branches run. It refuses, saying why,
    # and the import falls back to the Python law on that reason.
    monkeypatch.setattr(control, "_ZERO_SPREAD", zero_spread)
    monkeypatch.setattr(control, "_EPS", eps)
    reason = nativelaw.bind(nativelaw._lawc)
    assert reason is not None
    assert re.search(r"built from another version of the law: _ZERO_SPREAD .* and _EPS .* "
                     r"differ .*\(4\.0, 1e-9\)", reason), reason
    monkeypatch.undo()
    # the binding in force is untouched: the law still decides as the reference
    obs, states = [BUSY_OBS], {"a": LEARNED}
    assert_same(control_step_native(obs, states, 0.1), control_step(obs, states, 0.1))
    assert nativelaw.bind(nativelaw._lawc) is None  # the reference as built binds


def test_a_c_law_built_for_another_count_of_tuning_values_is_refused(monkeypatch):
    # A build that reads the tuning as fewer values than `_packed` sends would leave every
    # step to the Python law without a word: `bind` refuses it instead, naming both counts.
    sent = len(nativelaw._packed(control.ControlParams()))
    assert sent == 30
    monkeypatch.setattr(nativelaw, "_packed", lambda p: (0.0,) * 26)
    reason = nativelaw.bind(nativelaw._lawc)
    assert reason is not None and "the tuning comes as 26 values" in reason
    assert "built for 30" in reason
    monkeypatch.undo()
    assert nativelaw.bind(nativelaw._lawc) is None


def test_a_c_law_whose_bind_takes_other_arguments_is_refused_not_raised():
    # built before `bind` took the law's constants: five arguments, not eight
    older = types.SimpleNamespace(bind=lambda state, decision, blank, unlimited, full: None)
    reason = nativelaw.bind(older)
    assert reason is not None and "built from another version of the law" in reason
    assert "argument" in reason  # Python's own words for the mismatch


def test_a_stale_c_law_leaves_the_python_law_deciding(monkeypatch):
    monkeypatch.setattr(control, "_ZERO_SPREAD", 5.0)
    stale = importlib.reload(nativelaw)
    try:
        assert not stale.NATIVE and stale._lawc is None
        assert "_ZERO_SPREAD 5.0" in stale.NOT_NATIVE_REASON
        obs, states = [BUSY_OBS], {"a": LEARNED}
        assert stale.native_step(obs, states, 0.1) is None  # left to Python ...
        assert_same(stale.control_step_native(obs, states, 0.1),  # ... which decides
                    control_step(obs, states, 0.1))
    finally:
        monkeypatch.undo()
        importlib.reload(nativelaw)
    assert nativelaw.NATIVE and nativelaw.NOT_NATIVE_REASON is None

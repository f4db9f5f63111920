"""The time-sliced split's loops in C (`throttle/_splitc.c`) against their Python references
(`timesliced._newton_steps`, `ChangeWatch._judge`, `timesliced._age_parts`): float for float on
random inputs, on a recorded run of the whole split and on the simulated GPU; where the C
declines (input the split never makes, or where Python would raise) it writes nothing and the
reference decides, its answer or its error then the one.

`agree_on_random_cases` is also what the sanitizer test runs (`test_splitc_sanitizers`).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import math
import random
import tracemalloc
from dataclasses import replace

import pytest

from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.runner import PlantSpec, run_controlled
from vgpu_agent.throttle import timesliced
from vgpu_agent.throttle.timesliced import (
    _CHANCE_EPS,
    _LOG_CHANGE_ODDS,
    _LOG_COST_RANGE,
    CHANGE_EVIDENCE,
    CHANGE_ODDS,
    FADING,
    PERIODS_REMEMBERED,
    ChangeWatch,
    TimeSlicedSplit,
    _age_parts,
    _newton_steps,
)

WATCH_CONSTANTS = (CHANGE_ODDS, _LOG_CHANGE_ODDS, _CHANCE_EPS, CHANGE_EVIDENCE)


def native():  # type: ignore[no-untyped-def]
    if timesliced._splitc is None:
        pytest.skip("vgpu_agent/throttle/_splitc.c was not built")
    return timesliced._splitc


def exactly(value: object) -> str:
    """A value's every bit that matters, as text: repr round-trips floats (and tells -0.0 from
    0.0), and dicts list their items in their order."""
    if isinstance(value, dict):
        return repr([(k, exactly(v)) for k, v in value.items()])
    return repr(value)


def _ids(rng: random.Random, n: int) -> list[str]:
    return [f"pod-{i}/{rng.randint(0, 3)}" for i in range(n)]


def learn_case(rng: random.Random) -> tuple[dict, dict, list, float, float]:
    n = rng.randint(1, 24)
    ids = _ids(rng, n)
    costs = {a: (rng.choice([0.0, rng.uniform(-3, 3), _LOG_COST_RANGE]),
                 rng.choice([4.0, 5.0, rng.uniform(0.5, 400)])) for a in ids}
    raw = [rng.choice([rng.uniform(0, 1), rng.randint(1, 10**6) / 7, 1e-9]) for _ in ids]
    tokens = {a: r / sum(raw) for a, r in zip(ids, raw, strict=True)}
    drawn = [rng.choice(ids) for _ in range(rng.choice([1, 1, 1, 2, 3, 12]))]
    if rng.random() < 0.1:
        drawn.append("stranger")  # given to none of them: every one missed it
    fading, top = rng.choice([(FADING, _LOG_COST_RANGE), (rng.uniform(0.5, 1.0), 0.5)])
    return costs, tokens, drawn, fading, top


def watch_case(rng: random.Random) -> tuple[dict, dict, list]:
    n = rng.randint(2, 24)
    ids = _ids(rng, n)
    raw = [rng.uniform(0.001, 1) for _ in ids]
    expected = {a: r / sum(raw) for a, r in zip(ids, raw, strict=True)}
    if rng.random() < 0.2:
        expected[ids[0]] = rng.choice([0.0, 1.0, 1e-6])  # held within the eps by the watch
    sums = {a: (rng.uniform(0, CHANGE_EVIDENCE), rng.uniform(0, CHANGE_EVIDENCE))
            for a in ids if rng.random() < 0.7}
    favourite = rng.choice(ids)  # periods given one far beyond its chance: the sums climb
    drawn = [favourite if rng.random() < 0.7 else rng.choice(ids)
             for _ in range(rng.choice([0, 1, 1, 2, 5, 30]))]
    return sums, expected, drawn


def age_case(rng: random.Random) -> tuple[dict, dict, list, dict, int]:
    n = rng.randint(1, 24)
    ids = _ids(rng, n) + ([""] if rng.random() < 0.5 else [])
    parts = {a: (rng.uniform(0, 1), rng.uniform(0, 1), rng.choice([0, 1, 5, 99, 100, 10**6]))
             for a in ids}
    unseen = {a: rng.randint(0, 40) for a in ids if rng.random() < 0.8}
    spent = {a: rng.choice([0, rng.randint(1, 10**9)]) for a in ids if a}
    owners = [[rng.choice(ids)] if rng.random() < 0.8 else [] for _ in range(rng.choice(
        [1, 1, 2, 6]))]
    return parts, unseen, owners, spent, sum(spent.values())


def agree_on_random_cases(seed: int, trials: int) -> dict[str, int]:
    """Each loop, C against its reference on `trials` random inputs each: the same writes, in
    the same order, to the bit. How many the C computed (rather than declined)."""
    module = timesliced._splitc
    rng, computed = random.Random(seed), {"learn": 0, "watch": 0, "age": 0}
    for _ in range(trials):
        costs, tokens, drawn, fading, top = learn_case(rng)
        mine = copy.deepcopy(costs)
        _newton_steps(costs, tokens, drawn, fading, top)
        if module.learn(mine, tokens, drawn, fading, top):
            computed["learn"] += 1
        else:
            _newton_steps(mine, tokens, drawn, fading, top)
        assert exactly(mine) == exactly(costs), (tokens, drawn)

        sums, expected, drawn = watch_case(rng)
        watch, mine_sums = ChangeWatch(), copy.deepcopy(sums)
        watch.sums = sums
        want = watch._judge(expected, drawn)
        got = module.watch(mine_sums, expected, drawn, *WATCH_CONSTANTS)
        assert got is not None
        computed["watch"] += 1
        assert sorted(got) == sorted(want)
        assert exactly(mine_sums) == exactly(sums), (expected, drawn)

        parts, unseen, owners, spent, total = age_case(rng)
        mine_parts, mine_unseen = copy.deepcopy(parts), copy.deepcopy(unseen)
        _age_parts(parts, unseen, owners, spent, total)
        assert module.age(mine_parts, mine_unseen, owners, spent, total, PERIODS_REMEMBERED)
        computed["age"] += 1
        assert exactly(mine_parts) == exactly(parts)
        assert exactly(mine_unseen) == exactly(unseen)
    return computed


def test_the_extension_is_built_where_the_tests_run():
    # `pip install -e .` compiles it; without it a crowded time-sliced GPU's split runs its
    # loops in Python at several times the cost
    assert timesliced.NATIVE_SPLIT, "vgpu_agent/throttle/_splitc.c was not built"


def test_each_loop_agrees_with_its_reference_to_the_bit_on_random_inputs():
    native()
    computed = agree_on_random_cases(seed=5, trials=1500)
    # the cases are the split's own: the C computed nearly all of them
    assert computed["learn"] > 1400 and computed == {**computed, "watch": 1500, "age": 1500}


def test_a_run_of_the_split_is_the_same_with_the_loops_in_python(monkeypatch):
    # the whole split, fed the same batches: a crowded GPU whose containers change phase
    module = native()

    def run() -> list[str]:
        rng, split, out = random.Random(3), TimeSlicedSplit(), []
        cost = {f"c{i}": 1.0 + i % 4 for i in range(12)}
        for n in range(1500):
            if n == 700:
                cost["c3"] *= 4  # a new phase: its periods depart from the costs learned
            spent = {a: rng.randint(5_000, 20_000) for a in cost}
            weights = [spent[a] * cost[a] for a in cost]
            owners = [[rng.choices(list(cost), weights)[0]] for _ in range(rng.choice([1, 1, 2]))]
            if rng.random() < 0.05:
                owners.append([""])  # a stranger's period
            shares = split.share(owners, rng.uniform(90, 100), spent, 0.1)
            out.append(exactly(shares) + exactly(split.costs) + exactly(split.parts))
        assert split.restarts > 0  # the watch found the change
        return out

    in_c = run()
    monkeypatch.setattr(timesliced, "_splitc", None)
    assert run() == in_c
    monkeypatch.setattr(timesliced, "_splitc", module)


def test_a_simulated_time_sliced_gpu_is_steered_the_same_with_the_loops_in_python(monkeypatch):
    module = native()
    from tests.bench.bench_throttle import scenarios

    scenario = replace(next(s for s in scenarios(20.0) if s.name.startswith("6")),
                       duration_s=20.0)
    plant = PlantSpec(replace(REAL, nvml_sigma=3.0, nvml_attribution="time-sliced"), 1 / 6, 2)

    def run() -> dict:
        return asyncio.run(run_controlled(scenario, plant=plant, paced=True)).series

    in_c = run()
    monkeypatch.setattr(timesliced, "_splitc", None)
    assert run() == in_c
    monkeypatch.setattr(timesliced, "_splitc", module)


def test_where_python_raises_the_c_writes_nothing_and_the_reference_raises():
    module = native()
    # no information and a chance of 1: the Newton step divides by zero
    costs = {"a": (0.0, 0.0), "b": (0.0, 0.0)}
    tokens = {"a": 1.0, "b": 0.0}
    assert module.learn(costs, tokens, ["a"], 0.0, _LOG_COST_RANGE) is None
    assert costs == {"a": (0.0, 0.0), "b": (0.0, 0.0)}
    split = TimeSlicedSplit()
    split.costs = costs
    with pytest.raises(ZeroDivisionError):
        timesliced._newton_steps(costs, tokens, ["a"], 0.0, _LOG_COST_RANGE)
    # a cost so far above the others that exp overflows
    costs = {"a": (800.0, 4.0), "b": (0.0, 4.0)}
    assert module.learn(costs, {"a": 0.5, "b": 0.5}, ["a"], FADING, 1e9) is None
    assert costs == {"a": (800.0, 4.0), "b": (0.0, 4.0)}
    with pytest.raises(OverflowError):
        _newton_steps(costs, {"a": 0.5, "b": 0.5}, ["a"], FADING, 1e9)


@pytest.mark.parametrize("case", [
    "int cost", "cost not a pair", "token part an int", "drawn not str", "tokens empty",
])
def test_learn_leaves_input_the_split_never_makes_to_the_reference(case):
    module = native()
    costs: dict = {"a": (0.0, 4.0), "b": (0.5, 4.0)}
    tokens: dict = {"a": 0.4, "b": 0.6}
    drawn: list = ["a"]
    if case == "int cost":
        costs["a"] = (0, 4.0)
    elif case == "cost not a pair":
        costs["a"] = (0.0, 4.0, 1)
    elif case == "token part an int":
        tokens["a"] = 1
    elif case == "drawn not str":
        drawn = [1]
    else:
        tokens = {}
    before = copy.deepcopy(costs)
    assert module.learn(costs, tokens, drawn, FADING, _LOG_COST_RANGE) is None
    assert exactly(costs) == exactly(before)


@pytest.mark.parametrize("case", ["sum not a pair", "chance an int", "odds below 1"])
def test_watch_leaves_input_the_split_never_makes_to_the_reference(case):
    module = native()
    sums: dict = {"a": (1.0, 0.0)}
    expected: dict = {"a": 0.5, "b": 0.5}
    constants = WATCH_CONSTANTS
    if case == "sum not a pair":
        sums["a"] = [1.0, 0.0]
    elif case == "chance an int":
        expected["a"] = 1
    else:
        constants = (-5.0, *WATCH_CONSTANTS[1:])  # log of a number below 0: the reference's
    before = copy.deepcopy(sums)
    assert module.watch(sums, expected, ["a"], *constants) is None
    assert exactly(sums) == exactly(before)


@pytest.mark.parametrize("case", [
    "spent beyond 2**53", "count not an int", "unseen a float", "owner not str", "no periods",
])
def test_age_leaves_input_the_split_never_makes_to_the_reference(case):
    module = native()
    parts: dict = {"a": (0.5, 0.5, 3), "b": (0.5, 0.5, 3)}
    unseen: dict = {"a": 0, "b": 2}
    owners: list = [["a"]]
    spent: dict = {"a": 10, "b": 30}
    if case == "spent beyond 2**53":
        spent["a"] = 2**60
    elif case == "count not an int":
        parts["a"] = (0.5, 0.5, 3.0)
    elif case == "unseen a float":
        unseen["b"] = 2.0
    elif case == "owner not str":
        owners = [[1]]
    else:
        owners = []
    before = copy.deepcopy((parts, unseen))
    assert module.age(parts, unseen, owners, spent, sum(spent.values()),
                      PERIODS_REMEMBERED) is None
    assert exactly((parts, unseen)) == exactly(before)
    # the reference then takes it as Python does
    _age_parts(parts, unseen, owners, spent, sum(spent.values()))
    if owners and case != "owner not str":
        assert parts["a"][2] == 4


def test_bad_arguments_are_refused_with_a_type_error():
    module = native()
    with pytest.raises(TypeError):
        module.learn([], {}, [], FADING, _LOG_COST_RANGE)
    with pytest.raises(TypeError):
        module.watch({}, {}, (), *WATCH_CONSTANTS)
    with pytest.raises(TypeError):
        module.age({}, {}, [], {}, 0, "100")


def test_many_calls_leave_no_memory_behind():
    module = native()
    rng = random.Random(9)
    cases = [(learn_case(rng), watch_case(rng), age_case(rng)) for _ in range(50)]

    def run(rounds: int) -> None:
        for _ in range(rounds):
            for (costs, tokens, drawn, fading, top), (sums, expected, seen), (
                    parts, unseen, owners, spent, total) in cases:
                module.learn(dict(costs), tokens, drawn, fading, top)
                module.watch(dict(sums), expected, seen, *WATCH_CONSTANTS)
                module.age(dict(parts), dict(unseen), owners, spent, total, PERIODS_REMEMBERED)

    run(2)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run(40)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # a float or a tuple leaked per container and call would be megabytes
    assert grown < 64_000, f"{grown} bytes more after 6,000 calls"


def test_nan_and_infinite_parts_come_out_as_the_reference_has_them():
    module = native()
    for part in (math.nan, math.inf):
        costs = {"a": (0.0, 4.0), "b": (0.0, 4.0)}
        mine = copy.deepcopy(costs)
        tokens = {"a": part, "b": 0.5}
        try:
            _newton_steps(costs, tokens, ["a"], FADING, _LOG_COST_RANGE)
        except ArithmeticError as error:
            assert module.learn(mine, tokens, ["a"], FADING, _LOG_COST_RANGE) is None
            with pytest.raises(type(error)):
                _newton_steps(mine, tokens, ["a"], FADING, _LOG_COST_RANGE)
        else:
            assert module.learn(mine, tokens, ["a"], FADING, _LOG_COST_RANGE)
            assert exactly(mine) == exactly(costs)

"""The law in C under AddressSanitizer and UBSan: it runs inside the agent's process, where a
stray write or an undefined shift would corrupt the agent rather than fail a call.

`_lawc.c` is compiled here with both sanitizers (`tests/sanitized.py`) and loaded into a Python
preloaded with the ASan runtime, in place of the built module; the child drives it through
`nativelaw` on seeded random ticks (crowded GPUs, several priorities, written rates, noisy
samples, insane states) and on the inputs it declines, checking every decision against the
reference law.
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests import sanitized

SOURCE = sanitized.REPO / "vgpu_agent" / "throttle" / "_lawc.c"

CHILD = textwrap.dedent("""
    import math, random
    module = load("vgpu_agent.throttle._lawc", sys.argv[1])
    from vgpu_agent.throttle import nativelaw
    from vgpu_agent.throttle.control import (UNLIMITED_RATE, ControlParams, LoopState,
                                             Observation, control_step)
    assert nativelaw._lawc is module
    rng = random.Random(11)
    decided = declined = 0
    for trial in range(60):
        n = rng.randint(1, 24)
        params = rng.choice([None, ControlParams(demand_ticks=1), ControlParams(history_s=0.3)])
        specs = [(rng.uniform(1, 100), rng.choice(["strict", "work-conserving", "off"]),
                  rng.randint(0, 3), rng.choice([0, 10**3, 10**6, 10**9])) for _ in range(n)]
        states, rates = {}, {}
        for step in range(rng.randint(5, 60)):
            dt = rng.choice([0.1, 0.1, 0.4, 1.0, rng.uniform(0.01, 2.0)])
            observations = []
            for i, (limit, policy, priority, spend) in enumerate(specs):
                rate, burst = rates.get(f"c{i}", (UNLIMITED_RATE, UNLIMITED_RATE))
                spent = min(spend, round(rate * dt)) if rng.random() < 0.8 else 0
                util = None if rng.random() < 0.4 else rng.choice([0.0, rng.uniform(0, 100)])
                observations.append(Observation(
                    f"c{i}", limit, policy, priority, spent=spent,
                    launches=rng.randint(0, 20) if spent else 0,
                    waited_s=rng.choice([0.0, rng.uniform(0, dt)]), util=util, rate=rate,
                    burst=burst, util_span_s=rng.choice([0.0, 1 / 6, 1.0]),
                    util_samples=rng.randint(1, 6)))
            try:
                want = control_step(observations, states, dt, params)
            except ArithmeticError:  # the reference refuses (an infinite k, say): so does C
                assert nativelaw.native_step(observations, states, dt, params) is None
                declined += 1
                states = {}
                continue
            got = nativelaw.native_step(observations, states, dt, params)
            assert got is not None, "declined the law's own input"
            for key, decision in want.items():
                assert got[key] == decision or repr(got[key]) == repr(decision), key
            decided += 1
            states = {key: d.state for key, d in want.items()}
            if rng.random() < 0.05:  # what a hostile container could make the law learn
                key = rng.choice(list(states))
                states[key] = states[key]._replace(
                    tokens_per_pct=rng.choice([math.inf, math.nan, 1e300, 0.0]),
                    cost_per_launch=rng.choice([0.0, 1e300]))
            rates = {key: (d.rate, d.burst) for key, d in want.items()}
    for odd in ([Observation("a", 50, "strict", spent=1)], [Observation("a", 50.0, "off",
                 spent=2**60)]):
        assert nativelaw.native_step(odd, {}, 0.1) is None
    state = LoopState(tokens_per_pct=1e5, spend_history=(2e6,) * 30, last_pair=(2e6, 20.0),
                      learned=5, noise_pairs=-2)
    obs = [Observation("a", 50.0, "strict", spent=200_000, util=21.0, rate=2_000_000,
                       burst=40_000)]
    assert nativelaw.native_step(obs, {"a": state}, 0.1) is None
    print("decided", decided, "declined", declined)
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_law_in_c_is_clean_under_asan_and_ubsan(tmp_path):
    built = sanitized.build(SOURCE, tmp_path, "-ffp-contract=off")
    out = sanitized.run(CHILD, str(built), cwd=tmp_path)
    decided = int(out.split()[1])
    assert decided > 500, out

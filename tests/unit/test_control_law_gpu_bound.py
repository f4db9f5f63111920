"""A borrower held back by the GPU, not by its bucket, keeps one rate.

Two work-conserving containers of one GPU: `light` (limit 40) uses 13 %, `heavy` (limit 60)
would use more but the GPU gives it 50 % (its kernels queue behind the neighbour's), so it
spends the tokens of 50 % whatever its rate, and never waits for one. Spending 50 of its 60 is
over `hungry_spend_fraction` of its rate: rate-limited, it is lent light's spare share. Judged
against the lent rate, the same spending then read as not limited, the loan went, and its rate
flipped between the two every tick for as long as it ran (simulated: 591 rate writes in 30 s,
16 now). Once hungry, a borrower's spending is held against its own limit's rate.
"""

from __future__ import annotations

import pytest

from vgpu_agent.throttle.control import ControlParams, LoopState, Observation, control_step
from vgpu_agent.throttle.fastlaw import control_step_gpu
from vgpu_agent.throttle.nativelaw import control_step_native

LAWS = [control_step, control_step_gpu, control_step_native]
K = 1e6  # tokens a second for one percent, both containers
DT = 0.1
LIMITS = {"light": 40.0, "heavy": 60.0}
LIGHT_USE = 13.0  # what the GPU lets light use, whatever its rate


def ticks(law, count: int, waits: dict[str, float], heavy: float = 50.0,
          heavy_later: tuple[int, float] | None = None) -> list[dict[str, tuple[int, float]]]:
    """`count` ticks of the law on a plant where light spends LIGHT_USE and heavy `heavy` (from
    tick `heavy_later[0]` on, `heavy_later[1]`), each at most its rate, each reporting `waits`
    seconds waited a tick: per tick, each one's (rate, target)."""
    use_at_start = {"light": LIGHT_USE, "heavy": heavy}
    states = {key: LoopState(tokens_per_pct=K, spend_history=(K * use,) * 5,
                             spread=0.001**2, noise=9.0, noise_pairs=20, util=use,
                             target=LIMITS[key], learned=40, tick_lengths=(DT,) * 5)
              for key, use in use_at_start.items()}
    rates = {key: int(K * LIMITS[key]) for key in LIMITS}
    out = []
    for n in range(count):
        observations = []
        for key, limit in LIMITS.items():
            use = use_at_start[key]
            if key == "heavy" and heavy_later is not None and n >= heavy_later[0]:
                use = heavy_later[1]
            spent = min(K * use, rates[key]) * DT
            observations.append(Observation(
                key, limit, "work-conserving", spent=int(spent), launches=100,
                waited_s=waits[key], rate=rates[key], burst=rates[key] // 10,
                util=use if n % 2 else None, util_span_s=0.2, util_samples=1))
        decisions = law(observations, states, DT, ControlParams())
        states = {key: d.state for key, d in decisions.items()}
        rates = {key: d.rate for key, d in decisions.items()}
        out.append({key: (d.rate, d.target) for key, d in decisions.items()})
    return out


@pytest.mark.parametrize("law", LAWS)
def test_a_borrower_the_gpu_holds_back_keeps_one_rate(law):
    seen = ticks(law, 16, {"light": 0.0, "heavy": 0.0})
    heavy = [tick["heavy"] for tick in seen[4:]]
    assert len({rate for rate, _ in heavy}) == 1, heavy
    # and keeps its loan: light's unused share, less its margin
    assert all(target > LIMITS["heavy"] + 10 for _, target in heavy)


@pytest.mark.parametrize("law", LAWS)
def test_a_borrower_that_spends_clearly_less_than_its_own_share_gives_the_loan_back(law):
    # lent from the first ticks on, then half its limit from tick 8: under
    # `hungry_hysteresis` of its own limit's rate
    seen = ticks(law, 20, {"light": 0.0, "heavy": 0.0}, heavy_later=(8, 30.0))
    assert all(tick["heavy"][1] > LIMITS["heavy"] + 10 for tick in seen[2:8])
    assert all(tick["heavy"][1] <= LIMITS["heavy"] for tick in seen[10:])


@pytest.mark.parametrize("law", LAWS)
def test_a_container_its_bucket_holds_back_is_lent_the_spare_share(law):
    # the same spending, its whole rate's worth, with launches waiting for tokens: rate-limited
    seen = ticks(law, 16, {"light": 0.0, "heavy": 0.02}, heavy=60.0)
    _, target = seen[-1]["heavy"]
    assert target > LIMITS["heavy"] + 10  # light's unused share, less its margin


def test_the_laws_agree_tick_for_tick():
    waits = {"light": 0.0, "heavy": 0.0}
    reference = ticks(control_step, 12, waits)
    assert ticks(control_step_gpu, 12, waits) == reference
    assert ticks(control_step_native, 12, waits) == reference

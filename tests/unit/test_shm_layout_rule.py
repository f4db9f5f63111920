"""The Python token-spending rule is the C rule: both run on the same inputs and must agree."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from vgpu_agent.shm import layout

SHIM = Path(__file__).resolve().parents[2] / "shim"
S = layout.NS_PER_S
T62 = layout.TOKEN_MAX


def _cases() -> list[tuple[str, tuple[int, ...]]]:
    rng = random.Random(20261129)
    edge_tokens = [0, 1, 2, 999, 10**6, 10**9, 10**12, T62 - 1, T62, T62 + 5, 2**64 - 1]
    edge_balance = [-T62, -(10**9), -1, 0, 1, 10**6, T62]
    edge_time = [0, 1, 10**6, S, 10**15, 2**63, 2**64 - 1]
    cases: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(3000):
        last = rng.choice([*edge_time, rng.randrange(2 ** 64)])
        now = rng.choice([last, last + rng.randrange(10**9), rng.choice(edge_time)])
        now = min(now, 2**64 - 1)
        rate = rng.choice([*edge_tokens, rng.randrange(10 ** 10)])
        burst = rng.choice([*edge_tokens, rng.randrange(10 ** 9)])
        balance = rng.choice([*edge_balance, rng.randrange(-10 ** 9, 10 ** 9)])
        balance = min(balance, T62)
        cost = rng.choice([*edge_tokens, rng.randrange(10 ** 8)])
        cases.append(("refill", (balance, last, now, rate, burst)))
        cases.append(("admits", (balance, cost, burst)))
        cases.append(("spend", (balance, cost)))
        cases.append(("wait", (balance, cost, rate, burst)))
        dims = [rng.choice([0, 1, 2, 32, 1024, 65535, 2**31 - 1, 2**32 - 1]) for _ in range(6)]
        cases.append(("cost", tuple(dims)))
    return cases


def _python(op: str, args: tuple[int, ...]) -> str:
    if op == "refill":
        balance, last = layout.refill(*args)
        return f"{balance} {last}"
    if op == "admits":
        return "1" if layout.admits(*args) else "0"
    if op == "spend":
        return str(layout.spend(*args))
    if op == "wait":
        balance, cost, rate, burst = args
        return str(layout.wait_ns_for(balance, cost, rate, burst))
    return str(layout.launch_cost(args[:3], args[3:]))


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("rule") / "rule_harness"
    subprocess.run(
        ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SHIM / 'include'}",
         f"-I{SHIM / 'src'}", str(SHIM / "tests" / "rule_harness.c"), "-o", str(binary)],
        check=True,
        capture_output=True,
    )
    return binary


def test_c_and_python_rules_agree(harness: Path) -> None:
    cases = _cases()
    stdin = "".join(f"{op} {' '.join(map(str, args))}\n" for op, args in cases)
    out = subprocess.run([str(harness)], input=stdin, capture_output=True, text=True, check=True)
    got = out.stdout.splitlines()
    assert len(got) == len(cases)
    mismatches = [(c, g, _python(*c)) for c, g in zip(cases, got, strict=True) if g != _python(*c)]
    assert mismatches == []


def test_refill_rate_is_exact_over_many_small_steps() -> None:
    # fractions of a token carry over: 1000 refills of 333 us at 1000 tok/s give 333 tokens
    balance, last = 0, 10**9
    for step in range(1, 1001):
        balance, last = layout.refill(balance, last, 10**9 + step * 333_000, 1000, 10**6)
    assert balance == 333


def test_refill_caps_at_burst_and_marks_full_bucket_time() -> None:
    assert layout.refill(0, 0, 5 * S, 1000, 700) == (700, 5 * S)
    # a lowered burst takes effect even without elapsed time
    assert layout.refill(900, 5 * S, 5 * S, 1000, 700) == (700, 5 * S)


def test_paused_rate_credits_nothing_for_the_pause() -> None:
    balance, last = layout.refill(10, S, 9 * S, 0, 1000)
    assert (balance, last) == (10, 9 * S)
    assert layout.refill(balance, last, 9 * S + S // 100, 1000, 1000) == (20, 9 * S + S // 100)


def test_launch_bigger_than_burst_runs_on_a_full_bucket_and_leaves_a_debt() -> None:
    assert not layout.admits(499, 2000, 500)
    assert layout.admits(500, 2000, 500)
    assert layout.spend(500, 2000) == -1500
    # the debt is paid back by refill before the next launch: 2000 tokens at 1000 tok/s
    assert layout.wait_ns_for(-1500, 2000, 1000, 500) == 2 * S


def test_wait_is_ceiling_and_capped() -> None:
    assert layout.wait_ns_for(0, 1, 3) == 333_333_334
    assert layout.wait_ns_for(5, 5, 1) == 0
    assert layout.wait_ns_for(0, 10**9, 1) == layout.MAX_WAIT_NS
    assert layout.wait_ns_for(0, 1, 0) == layout.MAX_WAIT_NS


def test_launch_cost_is_threads_and_clamped() -> None:
    assert layout.launch_cost((2, 3, 4), (32, 2, 1)) == 24 * 64
    assert layout.launch_cost((0, 1, 1), (256, 1, 1)) == 0
    assert layout.launch_cost((2**31 - 1, 65535, 65535), (1024, 1, 1)) == T62


def test_unlimited_rule() -> None:
    assert layout.is_unlimited(layout.POLICY_OFF, 10, 5, 5)
    assert layout.is_unlimited(layout.POLICY_STRICT, layout.CORE_LIMIT_FULL, 5, 5)
    assert layout.is_unlimited(layout.POLICY_STRICT, 10, 0, 0)
    assert not layout.is_unlimited(layout.POLICY_WORK_CONSERVING, 10, 0, 5)

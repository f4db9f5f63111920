"""What a container is believed to have spent (`throttle/audit.py`): every claim an honest
shim can make stands, and a container claiming more is believed to spend its rate at most."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm import layout
from vgpu_agent.throttle.audit import (
    JITTER_S,
    LAUNCH_DEBT_GRACE_S,
    LaunchDebt,
    believed_spend,
    dear_launches,
)

STEP_NS = 500_000  # the honest shim below launches as often as its tokens allow, every 0.5 ms


def honest_ticks(rng: random.Random, ticks: int = 40):
    """An honest shim, hungry, by the shim's own bucket rule (`shm.layout`, the twin of
    `bucket.h`), steered by an agent whose tick reads come 0-40 ms after its clock and whose
    rate writes land 1-5 ms after the reads. Yields (claimed, rate, burst, dt_s) per tick."""
    cost = rng.randint(1, 10**6)
    rate = cost * rng.randint(1, 10_000)  # 1 to 10,000 launches a second
    balance, last_ns, spent = 0, 0, 0
    pending: tuple[int, int, int] | None = None  # (ns it lands, rate, burst)
    burst = max(round(rate * 0.02), 2 * cost)
    now_ns, clock_ns, read_spent = 0, 0, 0
    for _ in range(ticks):
        clock_ns += 100_000_000
        read_ns = clock_ns + rng.randint(0, 40_000_000)
        while now_ns < read_ns:
            now_ns += STEP_NS
            if pending is not None and now_ns >= pending[0]:
                _, rate, burst = pending
                pending = None
            balance, last_ns = layout.refill(balance, last_ns or now_ns, now_ns, rate, burst)
            if layout.admits(balance, cost, burst):
                launches = balance // cost  # every launch the balance covers (cost <= burst)
                balance = layout.spend(balance, cost * launches)
                spent += cost * launches
        in_force = (rate, burst)
        yield spent - read_spent, *in_force, 0.1
        read_spent = spent
        # the law's next rate: anywhere from a third to three times this one; its burst by
        # the law's rule (20 ms of refill, never under two launches)
        new_rate = min(cost * 10_000, max(cost, round(rate * rng.uniform(1 / 3, 3))))
        pending = (read_ns + rng.randint(1_000_000, 5_000_000), new_rate,
                   max(round(new_rate * 0.02), 2 * cost))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_claim_an_honest_shim_makes_is_believed(seed):
    rng = random.Random(seed)
    bucket = None
    first = True
    for claimed, rate, burst, dt_s in honest_ticks(rng):
        if first:  # the shim ran unlimited until the first rate: no bucket to audit
            first = False
            continue
        believed, bucket = believed_spend(claimed, bucket, rate, burst, dt_s)
        assert believed == claimed, (claimed, rate, burst, bucket)


@settings(max_examples=100, deadline=None)
@given(rate=st.integers(1, 10**12), burst_ms=st.integers(1, 100),
       factor=st.integers(2, 10**6), ticks=st.integers(1, 100))
def test_a_container_overclaiming_every_tick_is_believed_to_spend_its_rate_at_most(
        rate, burst_ms, factor, ticks):
    burst = max(1, rate * burst_ms // 1000)
    bucket = None
    believed_total = 0
    for _ in range(ticks):
        true = round(rate * 0.1)  # spends exactly its rate, claims `factor` times that
        believed, bucket = believed_spend(true * factor, bucket, rate, burst, 0.1)
        assert 0 <= believed <= true * factor
        believed_total += believed
    # the rate over the ticks, the full bucket it began with and what is lent once: no more
    lent = 2 * burst + rate * JITTER_S
    assert believed_total <= rate * 0.1 * ticks + burst + lent + 1
    # and, sustained, its rate: the last tick is believed no more than a tick of refill
    if ticks > 3:
        assert believed <= rate * 0.1 + 1


def test_a_lowered_rate_still_counts_the_higher_one_for_the_tick_it_was_in_force():
    # the rate was lowered at the end of the last tick; the tick's reads came before the write
    _, bucket = believed_spend(1000, None, 10_000, 200, 0.1)
    believed, _ = believed_spend(1000, bucket, 1_000, 20, 0.1)
    assert believed == 1000


def test_nothing_claimed_is_nothing_believed_and_the_bucket_fills_to_its_burst():
    believed, (level, rate) = believed_spend(0, None, 5_000, 100, 0.1)
    assert believed == 0 and level == 100 and rate == 5_000
    believed, (level, _) = believed_spend(0, (-300.0, 5_000), 5_000, 100, 1.0)
    assert believed == 0 and level == 100


def test_one_launch_dearer_than_the_bucket_explains_a_claim_past_the_allowance_by_one_launch():
    # one launch of 5,000 tokens, a bucket of 1,000: what was let through, plus up to that launch
    assert dear_launches(5_000, believed=2_000, launches=1, burst=1_000,
                         usual_cost=100) == (5_000, 1)
    assert dear_launches(5_000, believed=-1, launches=1, burst=1_000, usual_cost=100) == (0, 0)
    # ten launches, nine at the usual 100 tokens: the tenth cost 4,100, past the bucket (the
    # first dear launch may share its tick with cheap ones)
    assert dear_launches(5_000, believed=900, launches=10, burst=1_000,
                         usual_cost=100) == (4_100, 1)
    assert dear_launches(5_000, believed=899, launches=10, burst=1_000, usual_cost=100) == (0, 0)
    # ten launches at their usual cost, each within the bucket: no debt explains the claim
    assert dear_launches(5_000, believed=4_000, launches=10, burst=1_000,
                         usual_cost=500) == (0, 0)
    # no launch counted: nothing explains it
    assert dear_launches(5_000, believed=4_000, launches=0, burst=1_000, usual_cost=0.0) == (0, 0)


def test_each_process_may_run_one_dear_launch_in_a_tick():
    # three launches of 5,000 tokens in one tick, a bucket of 1,000: one process explains one
    # of them, three processes (their waits ending together) all three
    assert dear_launches(15_000, believed=2_000, launches=3, burst=1_000,
                         usual_cost=5_000) == (0, 0)
    assert dear_launches(15_000, believed=2_000, launches=3, burst=1_000, usual_cost=5_000,
                         most=3) == (15_000, 3)
    # more processes than launches: the launches counted are all there is to explain it
    assert dear_launches(15_000, believed=2_000, launches=3, burst=1_000, usual_cost=5_000,
                         most=8) == (15_000, 3)
    # three launches whose cost together is no more than three bursts are not dear
    assert dear_launches(3_000, believed=0, launches=3, burst=1_000, usual_cost=1_000,
                         most=3) == (0, 0)


MAX_WAIT_NS = 2_000_000_000
S = 1_000_000_000


def test_one_debt_per_process_is_forgiven_within_the_longest_wait():
    debt = LaunchDebt(MAX_WAIT_NS)
    # a container of three processes: each may run one launch in debt after its longest wait
    assert debt.forgive(5_000, 1_000, 10 * S, 10 * S - S // 10, processes=3)
    assert debt.forgive(5_000, 1_000, 10 * S + S // 10, 10 * S, processes=3)
    assert debt.forgive(5_000, 1_000, 10 * S + S // 5, 10 * S + S // 10, processes=3)
    # a fourth within the same wait is more than three processes can have run
    assert not debt.forgive(5_000, 1_000, 10 * S + S // 2, 10 * S + S * 4 // 10, processes=3)
    # once the first is past the longest wait, its process may have launched again
    assert debt.forgive(5_000, 1_000, 12 * S, 12 * S - S // 10, processes=3)


def test_one_process_is_forgiven_one_debt_a_wait_unless_the_refill_repaid_it():
    debt = LaunchDebt(MAX_WAIT_NS)
    assert debt.forgive(5_000, 1_000, 10 * S, 10 * S, processes=1)
    assert not debt.forgive(5_000, 1_000, 10 * S + S // 2, 10 * S + S // 2)
    # repaid (5,000 - 2 bursts of loan = 3,000 tokens, at 3,000 a second), and a second on
    debt.repay(3_000, 1.0)
    assert not debt.forgive(5_000, 1_000, 10 * S + S * 9 // 10, 10 * S + S * 8 // 10)
    assert debt.forgive(5_000, 1_000, 10 * S + int(LAUNCH_DEBT_GRACE_S * S),
                        10 * S + S * 9 // 10)


def test_dear_launches_of_several_processes_in_one_tick_take_as_many_debts():
    debt = LaunchDebt(MAX_WAIT_NS)
    assert debt.forgive(15_000, 1_000, 10 * S, 10 * S - S // 10, processes=3, launches=3)
    # all three processes ran theirs: the next within the wait is caught
    assert not debt.forgive(5_000, 1_000, 10 * S + S, 10 * S + S * 9 // 10, processes=3)
    # more launches than processes in one tick are not forgiven at all
    assert not LaunchDebt(MAX_WAIT_NS).forgive(20_000, 1_000, 10 * S, 10 * S, processes=3,
                                               launches=4)
    # the debts add up: 15,000 less two bursts of loan
    assert debt.left == 13_000
    assert not LaunchDebt(MAX_WAIT_NS).forgive(0.0, 1_000, 10 * S, 10 * S)

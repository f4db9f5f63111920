"""A container writing more tokens into `state` than its bucket let through: not believed
(`throttle/audit.py`). Before, a container claiming three times its spending was given about
three times its rate, ran unthrottled and took its share out of its neighbour's (49/49 of a
60/40 split). Shares are judged by the SM time each really got on the simulated GPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import structlog

from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.control import UNLIMITED_RATE
from vgpu_agent.throttle.controller import ThrottleController

UUID = "GPU-claims"
STEADY = Workload(kernel_s=0.0002)
# 20 ms a second for 15 s, then without pause
LIGHT_THEN_HEAVY = Workload(kernel_s=0.0002, busy=(
    *((float(t), t + 0.02) for t in range(15)), (15.0, math.inf)))


def pair(liar_work: Workload = STEADY, attribution: str = "per-process",
         period_s: float = 0.2, policy: str = "strict", seed: int = 0
         ) -> tuple[SimGpu, SimRegion, list, ThrottleController]:
    """An honest 60 % beside a 40 % container that may lie (`liar`), both of `policy`, on one
    simulated GPU the controller steers: the GPU, the liar's region, both processes (honest
    first) and the controller."""
    gpu = SimGpu(UUID, sample_period_s=period_s, seed=seed,
                 imperfections=replace(REAL, nvml_attribution=attribution))
    honest = SimRegion("honest", (UUID,), (60.0,), (policy,))  # type: ignore[arg-type]
    liar = SimRegion("liar", (UUID,), (40.0,), (policy,))  # type: ignore[arg-type]
    procs = [gpu.shim_process("honest", STEADY, honest),
             gpu.shim_process("liar", liar_work, liar)]
    controller = ThrottleController(SimBackend([gpu]), lambda: [honest, liar],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    return gpu, liar, procs, controller


async def run(factor: int, attribution: str, from_tick: int = 0
              ) -> tuple[float, float, ThrottleController]:
    gpu, liar, procs, controller = pair(attribution=attribution)
    slot = liar.processes[0]
    for tick in range(400):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        if tick >= from_tick:  # what `state` says; the shim's own count stays
            slot.tokens_spent[0] = spent * factor
        await controller.tick()
        slot.tokens_spent[0] = spent
    return (gpu.shares(procs[0], 15)[-1][1], gpu.shares(procs[1], 15)[-1][1], controller)


@pytest.mark.slow
@pytest.mark.parametrize("attribution", ["per-process", "time-sliced"])
@pytest.mark.parametrize(("factor", "from_tick"), [(3, 0), (100, 0), (10**4, 0), (10**5, 50)])
async def test_a_container_overstating_its_tokens_gets_its_share_and_no_more(
        factor, from_tick, attribution):
    # From its first tick, which no bucket limited (its first rate is then that many times
    # too high, and halved while it does not bind), or once its rate is set
    honest, liar, controller = await run(factor, attribution, from_tick)
    assert honest == pytest.approx(60, abs=3)
    # No more than its share. Its cap is raised only on a move its use follows by more than
    # the noise margin (8 points at 40 %), so it may end anywhere above its target less that
    # margin; on a time-sliced GPU, where its use is split by the tokens it is believed to
    # spend, as low as 34 % over seeds 0-2. Its loss, nobody else's.
    assert 32 <= liar <= 43
    assert controller.error_counts["tokens_overclaimed"] > 100  # counted every tick it lied


async def test_an_honest_container_is_never_taken_for_an_overclaiming_one():
    *_, controller = await run(1, "per-process")
    assert "tokens_overclaimed" not in controller.error_counts


async def test_an_overclaim_is_logged_once_per_device():
    with structlog.testing.capture_logs() as logs:
        *_, controller = await run(3, "per-process")
    assert controller.error_counts["tokens_overclaimed"] > 100  # yet logged once
    warned = [e for e in logs if e["event"] == "throttle_tokens_overclaimed"]
    assert len(warned) == 1
    assert warned[0]["alloc_id"] == "liar" and warned[0]["claimed"] > warned[0]["believed"]
    # what the claim was held to: the rate and burst in force, over the interval between reads
    assert 0 < warned[0]["burst"] < warned[0]["rate"] < warned[0]["believed"] * 20
    assert warned[0]["interval_s"] == pytest.approx(0.1, abs=0.01)


async def test_a_reader_stalled_halfway_takes_no_honest_container_for_a_liar():
    # The agent's reads stall after the first region (a loaded node, a CPU-limited agent):
    # 300 ms pass, in which the shims keep spending. The second region's counters then hold
    # 300 ms more than the tick's clock says; read on its own clock, it is believed.
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=REAL)
    first = SimRegion("first", (UUID,), (60.0,), ("strict",))
    second = SimRegion("second", (UUID,), (40.0,), ("strict",))
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=0.0002), r) for r in (first, second)]
    controller = ThrottleController(SimBackend([gpu]), lambda: [first, second],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    stalls = 0
    read_first = first.counters

    def stalling() -> tuple[int, ...]:
        nonlocal stalls
        counters = read_first()
        if controller.ticks % 7 == 0:
            gpu.advance(0.3)
            stalls += 1
        return counters

    first.counters = stalling  # type: ignore[method-assign]
    for _ in range(300):
        gpu.advance(0.1)
        await controller.tick()
    assert stalls > 30
    assert "tokens_overclaimed" not in controller.error_counts
    assert gpu.shares(procs[0], 10)[-1][1] == pytest.approx(60, abs=3)
    assert gpu.shares(procs[1], 10)[-1][1] == pytest.approx(40, abs=3)


@pytest.mark.parametrize("delay_s", [0.2, 0.05, 0.03])
async def test_spending_before_the_first_limited_rate_is_written_is_no_overclaim(delay_s):
    # The tick reads the counters, then steers, then writes the rates: a container's first
    # limited rate takes effect some time after the read, and until then its shim spends
    # without limit. The time between that read and the next was not all limited: believed.
    # Nor is the next read judged by what that spending left of the bound: the shim's bucket
    # was full when the rate arrived (with writes 30-50 ms late, an honest shim spending its
    # full bucket and its refill in the next 100 ms was taken for a liar).
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=REAL)
    regions = [SimRegion(name, (UUID,), (pct,), ("strict",))
               for name, pct in (("first", 10.0), ("second", 10.0))]
    procs = [gpu.shim_process(r.alloc_id, Workload(kernel_s=0.0002), r) for r in regions]
    controller = ThrottleController(SimBackend([gpu]), lambda: regions,
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    late = {"tick": 0, "writes": 0}
    for region in regions:
        write = region.set_rate

        def written_late(dev: int, rate: int, burst: int, write=write) -> None:
            if late["tick"] != controller.ticks:  # a slow steering: delay_s to the writes
                late["tick"] = controller.ticks
                late["writes"] += 1
                gpu.advance(delay_s)
            write(dev, rate, burst)

        region.set_rate = written_late  # type: ignore[method-assign]
    for _ in range(200):
        gpu.advance(0.1)
        await controller.tick()
    assert late["writes"] > 10
    assert "tokens_overclaimed" not in controller.error_counts
    assert [gpu.shares(p, 10)[-1][1] for p in procs] == pytest.approx([10, 10], abs=2)


@pytest.mark.slow
@pytest.mark.parametrize("attribution", ["per-process", "time-sliced"])
async def test_a_container_claiming_its_whole_rate_while_it_runs_lightly_gains_nothing_after(
        attribution):
    # It runs 20 ms a second for 15 s, then without pause, and from its third tick writes far
    # more tokens than any bucket allows into `state`, so that it is believed to spend its
    # whole rate. Its use reading low, the law took it for a rate-limited container and
    # raised its rate reading after reading; at the switch it ran unthrottled, and its
    # neighbour got 49 % of its 60 for the rest of the run. The cap on a caught container's
    # rate rises only where its use follows.
    async def honest_and_liar(seed: int) -> tuple[float, float]:
        gpu, liar, procs, controller = pair(LIGHT_THEN_HEAVY, attribution, seed=seed)
        slot, claimed = liar.processes[0], 0
        for tick in range(600):
            gpu.advance(0.1)
            spent = slot.tokens_spent[0]
            claimed += 10**12 if tick >= 2 else 0
            slot.tokens_spent[0] = spent + claimed
            await controller.tick()
            slot.tokens_spent[0] = spent
        assert controller.error_counts["tokens_overclaimed"] > 300
        # over the last 15 s of 60
        return gpu.shares(procs[0], 15)[-1][1], gpu.shares(procs[1], 15)[-1][1]

    if attribution == "per-process":
        # (the whole run at 49 % before the cap; within seconds of the switch now)
        honest, lying = await honest_and_liar(0)
        assert honest >= 56 and lying <= 43
        return
    # A time-sliced split brings it to its share within 30 s in half the runs (seeds 2, 3 and
    # 5 of 0-5: 59-60 % of 60); in the others both run at 49 % to the end, the liar's rate
    # cap still far above what it spends, the split charging the honest one 56 % and the liar
    # 42 %, within chance of their periods (49 and 49). Against a driver that lost 2 % of its
    # periods (as this one once did) it held 55-60 in all six: a weakness the faithful driver
    # shows, kept here as it stands, not a guarantee.
    runs = [await honest_and_liar(seed) for seed in range(6)]
    assert all(honest >= 48 for honest, _ in runs), runs  # never less than an equal slice
    assert sum(honest >= 56 for honest, _ in runs) >= 3, runs


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["strict", "work-conserving"])
@pytest.mark.parametrize("period_s", [0.2, 1.0])
@pytest.mark.parametrize("below_the_ceiling", [False, True])
async def test_a_container_claiming_exactly_its_allowance_is_held_by_its_use(
        period_s, below_the_ceiling, policy):
    # It runs 20 ms a second for 15 s, then without pause, and claims in `state` exactly what
    # its bucket lets through, so that no claim is cut: its use reading low, its rate was
    # raised reading after reading (to 2.6e15 tokens a second in 15 s); after the switch the
    # law, learning from claims that follow its rate, brought that down a few percent a
    # reading, and its neighbour got 49 % of its 60 for the rest of the run. Its own use above
    # its target reading after reading while the law's k fell and its use did not follow caps
    # it as a caught container is (`OveruseWatch`). Work-conserving, the two are lent nothing
    # once both run (the GPU is full), and the same game took the neighbour's share.
    gpu, liar, procs, controller = pair(LIGHT_THEN_HEAVY, period_s=period_s, policy=policy)
    slot, claimed = liar.processes[0], 0
    for tick in range(600):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        rate = liar.rates[0][0]
        # (or nothing once its rate reached the law's ceiling: the law then learns nothing)
        if tick >= 2 and rate and not (below_the_ceiling and rate >= UNLIMITED_RATE):
            claimed += rate // 10  # the tick's refill, to the token
        slot.tokens_spent[0] = max(spent, claimed)
        await controller.tick()
        slot.tokens_spent[0] = spent
    assert "tokens_overclaimed" not in controller.error_counts  # no claim was past its bucket
    assert controller.error_counts["use_over_target"] >= 1
    # over the last 15 s of 60: back 7-15 s (0.2 s samples) and about 30 s (1 s) after the switch
    assert gpu.shares(procs[0], 15)[-1][1] >= 56
    assert gpu.shares(procs[1], 15)[-1][1] <= 43


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["strict", "work-conserving"])
async def test_the_exact_allowance_game_played_again_finds_its_cap_still_there(policy):
    # light 15 s, heavy 15 s, four times: a cap dropped 5 s after the watch last fired let
    # the claimer's rate be raised again in each light phase, and its neighbour was below
    # 57 % for 6 s of each heavy one (the whole of each with one sample a second)
    cycles = []
    for c in range(4):
        cycles += [(30.0 * c + t, 30.0 * c + t + 0.02) for t in range(15)]
        cycles.append((30.0 * c + 15, 30.0 * c + 30))
    gpu, liar, procs, controller = pair(Workload(kernel_s=0.0002, busy=tuple(cycles)),
                                        policy=policy)
    slot, claimed = liar.processes[0], 0
    for tick in range(1200):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        rate = liar.rates[0][0]
        if tick >= 2 and rate:
            claimed += rate // 10
        slot.tokens_spent[0] = max(spent, claimed)
        await controller.tick()
        slot.tokens_spent[0] = spent
    honest = gpu.shares(procs[0], 1.0)
    for c in (1, 2, 3):  # the heavy phases after the first
        heavy = [v for t, v in honest if 30 * c + 15 < t <= 30 * c + 30]
        assert sum(heavy) / len(heavy) >= 57, c


@pytest.mark.parametrize("policy", ["strict", "work-conserving"])
@pytest.mark.parametrize("work", [STEADY, LIGHT_THEN_HEAVY], ids=["steady", "light-then-heavy"])
async def test_an_honest_container_beside_another_is_never_taken_for_an_overuser(policy, work):
    # work-conserving and light for 15 s, the other borrows what it leaves, and gives it back
    gpu, _, procs, controller = pair(work, policy=policy)
    for _ in range(600):
        gpu.advance(0.1)
        await controller.tick()
    assert controller.error_counts == {}
    if policy == "work-conserving" and work is LIGHT_THEN_HEAVY:
        lent = [v for t, v in gpu.shares(procs[0], 1.0) if 5 < t <= 15]
        assert sum(lent) / len(lent) > 80  # it did borrow


@pytest.mark.parametrize("attribution", ["per-process", "time-sliced"])
async def test_a_container_caught_overclaiming_cannot_deepen_its_bucket(attribution):
    # It runs lightly (few launches a tick) and claims far more than its bucket allows, so
    # that each launch seems to cost a fortune: the law would deepen its bucket for such
    # launches (and the audit lend it more); in a tick it is caught, it is held to the
    # rate's own share of a bucket.
    lightly = Workload(kernel_s=0.0002, busy=tuple((float(t), t + 0.02) for t in range(30)))
    gpu, liar, _, controller = pair(lightly, attribution)
    slot, claimed, writes = liar.processes[0], 0, []
    for tick in range(300):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        claimed += 10**12 if tick >= 2 else 0
        slot.tokens_spent[0] = spent + claimed
        before = liar.rates[0]
        await controller.tick()
        slot.tokens_spent[0] = spent
        if tick >= 5 and liar.rates[0] != before:
            writes.append((before, liar.rates[0]))
    assert controller.error_counts["tokens_overclaimed"] > 100
    assert writes  # its rate moved (cut, probed), and its burst with it
    for (_, burst_before), (rate, burst) in writes:
        assert burst <= max(burst_before, math.ceil(rate * 0.02), 1)


async def test_a_cap_is_dropped_once_its_container_stops_lying_with_a_reading_every_tick():
    # samples twice a tick: each tick reads its use, and the cap must still expire
    gpu, liar, _, controller = pair(period_s=0.05)
    slot, extra = liar.processes[0], 0
    for tick in range(200):
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        if tick < 50:  # three times its spending for 5 s, then the truth
            extra = 2 * spent
        slot.tokens_spent[0] = spent + extra
        await controller.tick()
        slot.tokens_spent[0] = spent
        if tick == 60:
            assert controller._devices["liar/0"].liar_cap is not None  # caught, held
    assert controller.error_counts["tokens_overclaimed"] > 10
    assert controller._devices["liar/0"].liar_cap is None  # 5 s after the last catch


async def test_a_capped_container_switched_to_off_is_not_throttled():
    # the cap holds a caught container's rate down; a policy of `off` has no rate to hold
    gpu, liar, _, controller = pair()
    slot = liar.processes[0]
    for tick in range(150):
        if tick == 100:
            assert liar.rate(0)[0] < UNLIMITED_RATE  # capped, and below the law's
            liar.set_policy("off", 0)
        gpu.advance(0.1)
        spent = slot.tokens_spent[0]
        slot.tokens_spent[0] = spent * 10**4
        await controller.tick()
        slot.tokens_spent[0] = spent
    assert liar.rate(0)[0] == UNLIMITED_RATE


IDLE = Workload(kernel_s=0.0002, busy=((0.0, 0.0),))
# 5 ms of launches every 100 ms: about 12 % of the GPU, under a rate once it has one
BURSTS = Workload(kernel_s=0.0002, busy=tuple((t / 10, t / 10 + 0.005) for t in range(400)))


async def lender_and_claimer(claimer_work: Workload, claimed_wait_ns: int
                             ) -> tuple[float, float]:
    """A busy work-conserving borrower beside a container that writes `claimed_wait_ns` of
    waiting into `state` every tick; their SM shares over the last 15 s of 40."""
    gpu = SimGpu(UUID, sample_period_s=0.2, imperfections=REAL)
    borrower = SimRegion("borrower", (UUID,), (50.0,), ("work-conserving",))
    claimer = SimRegion("claimer", (UUID,), (50.0,), ("work-conserving",))
    procs = [gpu.shim_process("borrower", Workload(kernel_s=0.0002), borrower),
             gpu.shim_process("claimer", claimer_work, claimer)]
    controller = ThrottleController(SimBackend([gpu]), lambda: [borrower, claimer],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    slot = claimer.processes[0]
    for _ in range(400):
        gpu.advance(0.1)
        slot.wait_ns[0] += claimed_wait_ns
        await controller.tick()
    return gpu.shares(procs[0], 15)[-1][1], gpu.shares(procs[1], 15)[-1][1]


@pytest.mark.slow
@pytest.mark.parametrize(("claimer_work", "borrower_honest"), [(IDLE, 90), (BURSTS, 60)])
async def test_waits_claimed_without_spending_take_no_loan_from_the_neighbour(
        claimer_work, borrower_honest):
    # A shim waits only when its bucket ran dry, which takes a rate and spending near it.
    # Believed, a container claiming to wait half of every tick was hungry and kept its half
    # of the GPU from the borrower (50.4 % for an idle claimer, 49.9 for a bursty one, against
    # 100 and 67.5 without the claims); now the borrower is lent what it leaves.
    honest = await lender_and_claimer(claimer_work, 0)
    lying = await lender_and_claimer(claimer_work, 50_000_000)
    assert lying[1] == pytest.approx(honest[1], abs=1)  # the claimer uses what it did
    assert honest[0] > borrower_honest
    assert lying[0] == pytest.approx(honest[0], abs=2)


async def test_a_first_launch_dearer_than_the_bucket_is_a_debt_not_a_lie():
    # from 10 s on, each launch costs 1,000 times more tokens (a grid 1,000 times larger): the
    # first runs the bucket into a debt beyond the loan (the law deepens the bucket only once
    # it has seen one)
    gpu, liar, _, controller = pair(liar_work=Workload(kernel_s=0.0002, busy=((0.0, 10.0),)))
    dear = Workload(kernel_s=0.0002, blocks=1024 * 1000, busy=((10.0, math.inf),))
    gpu.shim_process("liar-dear", dear, liar)
    for _ in range(150):
        gpu.advance(0.1)
        await controller.tick()
    assert "tokens_overclaimed" not in controller.error_counts
    assert controller.status[("liar", 0)].burst >= 2 * dear.cost  # deepened for its launches


async def test_claims_of_one_dear_launch_every_tick_are_forgiven_only_as_debts_repaid():
    gpu, liar, _, controller = pair()
    slot = liar.processes[0]
    extra = told = 0
    for tick in range(100):
        gpu.advance(0.1)
        spent, launches = slot.tokens_spent[0], slot.launches[0]
        if tick >= 20:  # one launch a tick, "costing" a second of refill
            extra += controller.status[("liar", 0)].rate
            told += 1
            slot.tokens_spent[0], slot.launches[0] = spent + extra, told
        await controller.tick()
        slot.tokens_spent[0], slot.launches[0] = spent, launches
    # An honest shim launches again only once the refill repaid such a launch (a second), or
    # after waiting MAX_WAIT_NS: of the 80 claims (the first, whose launches went backwards,
    # explains nothing), about one a second is forgiven, the rest are caught.
    assert 80 - 1 - 9 <= controller.error_counts["tokens_overclaimed"] < 80 - 1

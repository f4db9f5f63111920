"""The peer limiter model follows its documented rules (shared/reference/peers.md)."""

from __future__ import annotations

import pytest

from vgpu_agent.simulation.gpu import SimGpu, Workload
from vgpu_agent.simulation.imperfections import IDEAL
from vgpu_agent.simulation.peer import SLEEP_NS, PeerGate, PeerGpu, PeerWatchers

GPU = PeerGpu(sms=100, max_threads_per_sm=2048)


def test_capacity_is_threads_per_sm_times_sms_times_32():
    assert GPU.g_total == 2048 * 100 * 32


def test_share_grows_by_the_documented_increment_below_the_limit():
    gate = PeerGate(limit=30, grid=1, gpu=GPU)
    gate.watch(util=25)  # diff 5, not above limit/2
    assert gate.share == int(100 * 100 * 2048 * 5 / 2560)
    assert gate.balance == gate.share


def test_a_large_gap_gets_the_amplified_increment():
    gate = PeerGate(limit=30, grid=1, gpu=GPU)
    gate.watch(util=0)  # diff 30 > 15: inc * diff * 2 / (limit + 1)
    base = 100 * 100 * 2048 * 30 / 2560
    assert gate.share == int(base * 30 * 2 / 31)


def test_share_shrinks_above_the_limit_and_is_clamped():
    gate = PeerGate(limit=30, grid=1, gpu=GPU)
    gate.share = 1000
    gate.watch(util=90)
    assert gate.share == 0
    gate.share = GPU.g_total
    gate.watch(util=0)
    assert gate.share == GPU.g_total
    assert gate.balance == GPU.g_total  # tokens are capped too


def test_launches_run_while_the_balance_is_not_negative_and_may_overdraw_it():
    gate = PeerGate(limit=30, grid=100, gpu=GPU)
    gate.balance = 250
    assert gate.admit(now_ns=0, want=10) == 3  # 250 -> 150 -> 50 -> -50
    assert gate.balance == -50
    assert gate.admit(now_ns=1, want=1) == 0  # sleeping 10 ms
    assert gate.blocked_until_ns == SLEEP_NS
    gate.balance = 0
    assert gate.admit(now_ns=SLEEP_NS, want=1) == 1


def test_each_process_is_charged_its_own_grid_from_the_containers_balance():
    # A container that changed phase runs kernels of another grid size: the peer charges each
    # launch its own, from the one balance its watcher refills.
    gate = PeerGate(limit=30, grid=100, gpu=GPU)
    gate.balance = 250
    small = gate.launching(25)
    assert small.admit(now_ns=0, want=10) == 10  # 250 -> 0
    assert gate.balance == 0
    assert gate.launching(100).admit(now_ns=0, want=2) == 1  # 0 -> -100, then blocked
    assert gate.balance == -100
    assert small.admit(now_ns=1, want=1) == 0  # the container sleeps, whichever process asks


@pytest.mark.parametrize(("limit", "alone", "forced", "bypassed"), [
    (0, False, False, True),
    (100, False, False, True),
    (30, True, False, True),
    (30, True, True, False),
    (30, False, False, False),
])
def test_bypass_rules(limit, alone, forced, bypassed):
    gate = PeerGate(limit=limit, grid=1, gpu=GPU, forced=forced)
    gate.alone = alone
    assert gate.bypassed is bypassed
    assert (gate.admit(0, 5) == 5) is bypassed


def test_a_lone_container_is_not_limited_on_the_simulated_gpu():
    gpu = SimGpu("GPU-peer")
    gate = PeerGate(limit=30, grid=1024, gpu=GPU)
    proc = gpu.add_process("solo", Workload(kernel_s=0.002), gate)
    watchers = PeerWatchers(gpu, {"solo": (gate, [proc])})
    while gpu.elapsed_s < 3:
        gpu.advance(0.01)
        watchers.run_due()
    assert gate.alone
    assert gpu.shares(proc, 1)[-1][1] == pytest.approx(100, abs=1)


def test_two_containers_are_regulated_from_their_one_second_view():
    gpu = SimGpu("GPU-peer", imperfections=IDEAL)  # the formula's own behaviour, noise aside
    gates = {name: PeerGate(limit=lim, grid=1024, gpu=GPU) for name, lim in (("a", 20),
                                                                             ("b", 60))}
    procs = {n: gpu.add_process(n, Workload(kernel_s=0.002), g) for n, g in gates.items()}
    watchers = PeerWatchers(gpu, {n: (gates[n], [procs[n]]) for n in gates})
    while gpu.elapsed_s < 10:
        gpu.advance(0.01)
        watchers.run_due()
    assert not gates["a"].alone
    a, b = gpu.shares(procs["a"], 5)[-1][1], gpu.shares(procs["b"], 5)[-1][1]
    # Limited (not time-shared 50/50), roughly towards the limits, not exactly.
    assert a < 40 and b > 40
    assert a + b <= 100.5


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="peer limit"):
        PeerGate(limit=120, grid=1, gpu=GPU)

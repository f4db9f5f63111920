"""Devices that rest: on a GPU whose containers' decisions do not depend on each other (every
one strict, their limits within the GPU, read per process), a container whose decisions have
been calm for as long as a GPU of its own takes to reach `max_tick_s` is read and steered
every `max_tick_s` only, while the GPU ticks faster for a neighbour that changes phase. Run on
the simulated GPU with the real law."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, _series

LONG = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)
# twice as long with half the blocks: four times LONG's SM time per token
COSTLY = Workload(kernel_s=0.004, blocks=512, threads_per_block=256)
CONTAINERS = 12
# their limits add up to 72 %: one whose tokens come to buy four times more leaves its
# neighbours their SM time until it is re-learned
SHARE = 6.0


def _node(policy: str = "strict", change_at_s: float = 10.0, others: bool = True
          ) -> ControlledRun:
    """Twelve saturating containers at their limits on one GPU; `c0` changes phase (its
    tokens buying four times the SM time) at `change_at_s`, and, with `others`, `c1` at 5 s
    and back at 7.5 s and `c2` at 8.5 s: the GPU keeps ticking fast for them."""
    changes = {0: {"switch_to": COSTLY, "switch_at_s": change_at_s}}
    if others:
        changes[1] = {"switch_to": COSTLY, "switch_at_s": 5.0, "switch_back_at_s": 7.5}
        changes[2] = {"switch_to": COSTLY, "switch_at_s": 8.5}
    containers = tuple(
        ContainerSpec(f"c{i}", SHARE, LONG, policy=policy,  # type: ignore[arg-type]
                      **changes.get(i, {}))  # type: ignore[arg-type]
        for i in range(CONTAINERS))
    return ControlledRun(containers, tick_s=0.1, paced=True)


class Calls:
    """The law as the controller calls it, recording (time, key, dt_s) of each observation."""

    def __init__(self, run: ControlledRun) -> None:
        self.run, self.law = run, run.controller.law
        self.seen: list[tuple[float, str, float]] = []
        run.controller.law = self

    def __call__(self, observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        now = self.run.gpu.elapsed_s
        self.seen += [(now, o.key.split("/")[0], dt_s) for o in observations]
        return self.law(observations, states, dt_s, params)

    def between(self, start: float, end: float) -> dict[str, list[float]]:
        """Per container, the dt of each of its steerings in [start, end)."""
        out: dict[str, list[float]] = defaultdict(list)
        for at, name, dt in self.seen:
            if start <= at < end:
                out[name].append(dt)
        return out


def _resting(run: ControlledRun) -> set[str]:
    return {d.alloc_id for devices in run.controller._resting.values() for d in devices}


def test_calm_containers_rest_while_neighbours_change_and_the_changed_one_is_followed():
    run = _node()
    calls = Calls(run)
    asyncio.run(run.advance(8.0))
    names = {spec: region.alloc_id for spec, region in run.regions.items()}
    assert len(_resting(run)) >= 3, _resting(run)
    asyncio.run(run.advance(2.0))  # to c0's change, at 10 s
    steered = calls.between(8.0, 10.0)
    ticks = len({at for at, _, _ in calls.seen if 8.0 <= at < 10.0})
    assert ticks >= 15  # the GPU ticks fast for c1 and c2
    # fewer steerings than every container at every tick
    assert sum(len(dts) for dts in steered.values()) < 0.85 * ticks * CONTAINERS
    rested = [name for name, dts in steered.items() if max(dts) >= 0.3]
    assert rested, steered
    asyncio.run(run.advance(6.0))
    # each steering over exactly the time since the same container's last
    last: dict[str, float] = {}
    for at, name, dt in calls.seen:
        if name in last:
            assert dt == pytest.approx(at - last[name], abs=1e-6), (name, at, dt)
        last[name] = at
    # c0's tokens came to buy four times more: it is steered at every tick until it is calm
    # again, and held to its limit
    after = calls.between(10.5, 12.0)[names["c0"]]
    assert len(after) >= 12, after
    series = _series(run.gpu, run.procs, 0.5)
    late = [share for t, share in series["c0"] if 14.0 <= t <= 16.0]
    assert late and all(abs(share - SHARE) < 2.0 for share in late), late
    for name in ("c3", "c5", "c11"):
        held = [share for t, share in series[name] if 4.0 <= t <= 16.0]
        assert all(abs(share - SHARE) < 2.0 for share in held), (name, held)


@pytest.mark.parametrize("policy", ["work-conserving", "off"])
def test_containers_whose_decisions_depend_on_each_other_never_rest(policy):
    run = _node(policy, change_at_s=6.0)
    calls = Calls(run)
    for _ in range(10):
        asyncio.run(run.advance(1.0))
        assert not _resting(run)
    by_time: dict[float, int] = defaultdict(int)
    for at, _, _ in calls.seen:
        by_time[at] += 1
    # every law call sees the whole GPU
    assert set(by_time.values()) == {CONTAINERS}


def test_a_gpu_calm_as_a_whole_slows_down_with_every_device_steered_at_its_ticks():
    run = _node(change_at_s=1e9, others=False)
    calls = Calls(run)
    asyncio.run(run.advance(25.0))
    assert not _resting(run)
    assert run.controller.interval_s > run.controller.max_tick_s
    by_time: dict[float, int] = defaultdict(int)
    for at, _, _ in calls.seen:
        if at >= 20.0:
            by_time[at] += 1
    assert by_time and set(by_time.values()) == {CONTAINERS}


def test_resting_regions_are_read_only_when_steered():
    run = _node()
    calls = Calls(run)
    reads: list[tuple[float, str]] = []
    for region in run.regions.values():
        counters = region.counters

        def counted(counters=counters, name=region.alloc_id):  # type: ignore[no-untyped-def]
            reads.append((run.gpu.elapsed_s, name))
            return counters()

        region.counters = counted  # type: ignore[method-assign]
    asyncio.run(run.advance(10.0))
    steered = calls.between(6.0, 10.0)
    rested = [name for name, dts in steered.items() if max(dts) >= 0.3]
    assert rested
    steerings = {(at, name) for at, name, _ in calls.seen if 6.0 <= at < 10.0}
    for name in rested:
        read_at = [at for at, n in reads if n == name and 6.0 <= at < 10.0]
        # (each read the tick's, at the tick's moment)
        assert all((at, name) in steerings for at in read_at), name
    ticks = {at for at, _, _ in calls.seen if 6.0 <= at < 10.0}
    assert len([1 for at, _ in reads if 6.0 <= at < 10.0]) < len(ticks) * CONTAINERS

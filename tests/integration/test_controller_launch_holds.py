"""The controller on a time-sliced GPU that counts itself busy beyond the work done, as the
H200 did without MPS: two processes with sparse launches, each doing 20 % of the work, read
99 % busy (`imperfections.H200_TIME_SLICED`). Shared out whole, that use starved two strict
30 % containers to 4 % each (simulated); once each was seen alone, what their tokens buy
there bounds what is shared out. Shares are judged by the SM time each really got."""

from __future__ import annotations

import math
import statistics

import pytest
from structlog.testing import capture_logs

from tests.bench.bench_launch_holds import (
    check_kernels,
    flipper_run,
    gamer_run,
    held,
    last_shares,
    mixed_run,
    odd_run,
    scenario,
    turns_counted,
    unequal_run,
)
from vgpu_agent.simulation.gpu import START_NS
from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
from vgpu_agent.simulation.runner import ControlledRun, PlantSpec, _series
from vgpu_agent.throttle import timesliced
from vgpu_agent.throttle.figurefile import FigureFile
from vgpu_agent.throttle.soloturn import SOLO_TURN_MOST_S

COARSE = "its figure read at a few percent, its spending since grown threefold"


@pytest.mark.slow
@pytest.mark.parametrize(("limits", "kernel_s"), [((30, 30), 20e-6), ((30, 50), 20e-6),
                                                  ((30, 30), 200e-6)])
async def test_containers_seen_alone_keep_their_shares_on_a_gpu_counted_busy(limits, kernel_s):
    with capture_logs() as logs:
        got = await held(limits, kernel_s, alone=len(limits))
    for share, limit in zip(got, limits, strict=True):
        # at most ALONE_MARGIN of their work is charged: a few points under their limits
        assert limit / timesliced.ALONE_MARGIN - 2 <= share <= limit + 1, (got, limits)
    # the operator is told, once
    said = [e for e in logs if e["event"] == "throttle_gpu_busy_beyond_work"]
    assert len(said) == 1 and said[0]["busy"] > timesliced.BEYOND_SEEN * said[0]["explained"]


@pytest.mark.slow
@pytest.mark.parametrize("limits", [(30, 30), (30, 50)])
async def test_containers_joining_one_seen_alone_keep_their_shares(limits):
    # the first one's figure sets the scale (the others' tokens count at their periods' costs)
    # until a turn alone gives each of the others its own
    got = await held(limits, 20e-6, alone=1)
    for share, limit in zip(got, limits, strict=True):
        assert limit / timesliced.ALONE_MARGIN - 3 <= share <= limit + 2, (got, limits)


@pytest.mark.slow
@pytest.mark.parametrize(("before_s", "after_s"), [(10e-6, 10e-6), (5e-6, 20e-6)])
async def test_each_container_gets_a_figure_of_its_own(before_s, after_s, monkeypatch):
    # Strict 30/30, together from the start, the first's kernels other than the second's 20 us
    # (or changing to them a second after its turn). Charged at the first's figure times the
    # ratio of costs the periods show, the second ran at 35-50 % (or both at 49 %, for good);
    # a turn of its own 10 s after the first's holds both.
    with capture_logs() as logs:
        means, highest, given = await mixed_run(before_s, after_s, 90.0, seed=2,
                                                one_figure=False)
    started = [(e["alloc_id"], e["why"]) for e in logs
               if e["event"] == "throttle_solo_turn_started"]
    # a turn each; and one more for each whose figure was read at a few percent (its rate
    # cut while the GPU's whole use was shared out) and which now spends threefold, or whose
    # periods then showed the change (that turn spent no try: one is in hand for it)
    assert [name for name, _ in started[:2]] == ["c0", "c1"] and given == len(started)
    again = started[2:]
    doubt = "its figure in doubt: its periods showed a change"
    assert {why for _, why in again} <= {COARSE, doubt} and len(again) == len(set(again)), started
    assert all(26 <= share <= 34 for share in means), means
    assert highest < 36, highest
    if before_s == after_s:
        # (the rule before held this pair under 36 too once the simulated driver answered
        # late reads as the H200 does, one sample per process for all the periods since the
        # last read: seeds 0-3, where it ran the second at 35-50 % before)
        return
    # the rule before, for the record: both far above their limits (no figure measured
    # afresh for being read at a few percent either, as then)
    monkeypatch.setattr(timesliced, "COARSE_GROWTH", math.inf)
    means, _, given = await mixed_run(before_s, after_s, 90.0, seed=2, one_figure=True)
    assert given == 1 and max(means) > 40, means


@pytest.mark.slow
async def test_a_tenant_playing_light_in_its_turn_gains_only_until_its_neighbours_turn():
    # The first of a strict 30/30 pair runs 5 us kernels whenever it finds itself alone, 20 us
    # otherwise: its figure four times light set the scale for both, which ran unthrottled
    # (48-50 %) for the minute turns were apart. Its neighbour's own turn, 10 s later, bounds it.
    with capture_logs() as logs:
        means, highest, given = await gamer_run(90.0, seed=1, gaming=True)
    # after a first turn each, at most one more per container and reason: its figure read at
    # a few percent, its neighbour's the heaviest over its cost while the figures disagree,
    # its periods showing a change
    started = [(e["alloc_id"], e["why"]) for e in logs
               if e["event"] == "throttle_solo_turn_started"]
    first = "a container sharing a time-sliced GPU, never seen alone there"
    assert started[:2] == [("c0", first), ("c1", first)] and given == len(started), started
    assert len(set(started[2:])) == len(started[2:]) and first not in {w for _, w in started[2:]}
    assert all(26 <= share <= 34 for share in (means[0][0], means[1][0])), means  # 10-70 s
    assert highest < 40, highest
    # with turns a minute apart, for the record
    means, highest, _ = await gamer_run(90.0, seed=1, gaming=True, gap_s=60.0)
    assert min(means[0][0], means[1][0]) > 45 and highest > 45, (means, highest)


@pytest.mark.slow
async def test_a_tenant_playing_heavy_in_its_turn_sets_no_neighbours_charge(monkeypatch):
    # The first of three strict 30 % containers runs 80 us kernels whenever it finds itself
    # alone, 20 us otherwise: its figure four times heavy. With the largest figure over its
    # cost setting the scale, all three were charged at it and held at 7 %; with the median,
    # its honest neighbours keep their shares and it is charged at its own heavy figure.
    with capture_logs() as logs:
        means, lowest, _ = await odd_run(60.0, 0, 80e-6, 3)
    assert means[0] < 10, means
    # the operator is told, once, whose figure is left out
    told = [e["alloc_id"] for e in logs if e["event"] == "throttle_figure_left_out"]
    assert told == ["c0"], told
    assert all(27 <= share <= 30.5 for share in means[1:]) and min(lowest[1:]) > 24, means
    # of two, nothing tells which figure is odd: the larger scale is kept, and the tenant
    # lowers its neighbour's share only by lowering its own as much
    means, _, _ = await odd_run(60.0, 0, 80e-6, 2)
    assert means[0] <= means[1] + 1 and max(means) < 10, means
    # the largest setting the scale among three, for the record
    monkeypatch.setattr(timesliced, "_counted_in_scale", set)
    means, _, _ = await odd_run(60.0, 0, 80e-6, 3)
    assert max(means) < 10, means


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
async def test_a_figure_in_doubt_after_a_change_of_phase_is_measured_afresh(seed):
    # Both seen alone first (no turn used); at 20 s the first one's kernels grow from 20 to
    # 200 us: charged by what its periods show, it ran at up to 70 % of its 30 % and wandered
    # 24-39 % for minutes. Its periods show the change, its figure is in doubt, and a turn
    # alone measures it afresh (and the second's, where its periods moved against the first's
    # too, a turn later).
    from vgpu_agent.simulation.runner import ContainerSpec, Scenario, run_controlled

    specs = (ContainerSpec("c0", 30, check_kernels(20e-6, ((0, 5), (10, math.inf))),
                           policy="strict", switch_to=check_kernels(200e-6, ((0, math.inf),)),
                           switch_at_s=20),
             ContainerSpec("c1", 30, check_kernels(20e-6, ((5, math.inf),)), policy="strict"))
    with capture_logs() as logs:
        run = await run_controlled(Scenario("phase", specs, lambda name, t: 30.0, 60),
                                   plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed), paced=True)
    started = [(e["alloc_id"], e["why"]) for e in logs
               if e["event"] == "throttle_solo_turn_started"]
    doubt = "its figure in doubt: its periods showed a change"
    assert started[0] == ("c0", doubt) and set(started[1:]) <= {("c1", doubt)}, started
    ended = [(e["why"], e["measured"], e["figure"]) for e in logs
             if e["event"] == "throttle_solo_turn_ended"]
    assert ended == [("measured", True, "fresh")] * len(started)
    for share in last_shares(run.series, 60):
        assert 30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 1.5, share


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 6])
async def test_a_tenant_changing_phase_over_and_over_blinds_no_neighbour(seed):
    # c0's kernels go 80 and 5 us in turn, 15 s each, from 30 s on: its cost is re-learned
    # much of the time. c2's kernels become 80 us at 82.5 s: the watch judges c1's and c2's
    # periods between themselves meanwhile and finds it (8.3 and 4.1 s after); the honest c1
    # keeps most of its 30. Not asked at all while a cost re-learned: never found, c1 at
    # 21.4 / 18.5 % from 30 s on, 6.4 / 8.3 % over its worst 10 s.
    means, lowest, _, found = await flipper_run(150.0, seed)
    assert found is not None and found < 15.0, found
    assert means[1] > 24.0, means  # 27.2, 24.8
    assert lowest[1] > 10.0, lowest  # 22.0, 12.1


@pytest.mark.slow
async def test_a_figure_long_at_odds_with_the_periods_is_measured_afresh(monkeypatch):
    # Both seen alone first (no turn used); at 20 s the first one's kernels shrink from 20 to
    # 5 us, its tokens buying a quarter of what they did. The watch missed it (this seed):
    # charged at its old figure, and its figure over its cost setting the pair's scale, both
    # were held at 7 % of their 30 for as long as they ran. Long at odds with the periods,
    # the heavier figure is measured afresh, and both are back at their shares.
    from vgpu_agent.simulation.runner import ContainerSpec, Scenario, run_controlled

    async def run() -> tuple[list[tuple[str, str]], list[float]]:
        specs = (ContainerSpec("c0", 30, check_kernels(20e-6, ((0, 5), (10, math.inf))),
                               policy="strict", switch_to=check_kernels(5e-6, ((0, math.inf),)),
                               switch_at_s=20),
                 ContainerSpec("c1", 30, check_kernels(20e-6, ((5, math.inf),)),
                               policy="strict"))
        with capture_logs() as logs:
            done = await run_controlled(Scenario("lighter", specs, lambda name, t: 30.0, 70),
                                        plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=0),
                                        paced=True)
        started = [(e["alloc_id"], e["why"]) for e in logs
                   if e["event"] == "throttle_solo_turn_started"]
        return started, last_shares(done.series, 70)

    started, shares = await run()
    assert started[0] == ("c0", "its figure long at odds with the costs its periods show")
    assert all(30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 1.5 for share in shares), shares
    # never measured afresh, for the record
    monkeypatch.setattr(timesliced.TimeSlicedSplit, "stale", lambda self: set())
    started, shares = await run()
    assert started == [] and max(shares) < 10, (started, shares)


@pytest.mark.slow
async def test_a_figure_measured_again_by_age_finds_kernels_the_periods_cannot_show():
    # At 40 s the first of a strict 30/30 pair switches to kernels of half the SM time (the
    # same grid): on the H200 plant its periods barely move (each launch holds the GPU 130 us
    # beyond its 10-20 us of work), its figure stands, and it runs at half its share for as
    # long as it runs. Asked for (`throttle_figure_max_age_seconds`), its figure is measured
    # afresh a minute after the last measurement, and it is back at its share.
    from vgpu_agent.simulation.runner import ContainerSpec, Scenario

    specs = (ContainerSpec("c0", 30, check_kernels(20e-6), policy="strict",
                           switch_to=check_kernels(10e-6), switch_at_s=40),
             ContainerSpec("c1", 30, check_kernels(20e-6), policy="strict"))

    async def run(max_age_s: float) -> tuple[list[tuple[str, str]], list[float]]:
        from vgpu_agent.simulation.runner import run_controlled

        with capture_logs() as logs:
            done = await run_controlled(Scenario("half", specs, lambda name, t: 30.0, 100),
                                        plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=2),
                                        paced=True, figure_max_age_s=max_age_s)
        started = [(e["alloc_id"], e["why"]) for e in logs
                   if e["event"] == "throttle_solo_turn_started"]
        return started, last_shares(done.series, 100)

    started, shares = await run(60.0)
    aged = "its figure older than throttle_figure_max_age_seconds"
    assert ("c0", aged) in started and {why for _, why in started[3:]} == {aged}, started
    assert all(30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 1.5 for share in shares), shares
    # not asked (the default), for the record: nothing shows the change
    started, shares = await run(0.0)
    assert len(started) == 3 and shares[0] < 16, (started, shares)


@pytest.mark.slow
async def test_containers_never_alone_are_starved_by_the_use_counted(monkeypatch):
    # without a turn alone, what the bound cannot help: nothing says what their tokens buy
    # (recorded here, so that a change of it is seen)
    with capture_logs() as logs:
        got = await held((30, 30), 20e-6, alone=0, solo_turns=False)
    assert max(got) < 10
    assert not [e for e in logs if e["event"] == "throttle_gpu_busy_beyond_work"]
    # and with the bound off, those seen alone starve as well
    monkeypatch.setattr(timesliced, "ALONE_MARGIN", math.inf)
    got = await held((30, 30), 20e-6, alone=2)
    assert max(got) < 10


@pytest.mark.slow
async def test_the_use_charged_to_nobody_is_what_the_gpu_counts_beyond_the_bound():
    sc, together = scenario((30, 30), 20e-6, alone=2, together_s=10)
    run = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 0.2), paced=True)
    await run.advance(together - 1)  # the second container alone: all of it charged
    assert set(run.controller.use_charged_to_nobody.values()) == {0.0}
    await run.advance(11)
    # together they do about 57 % of the work and the GPU reads 99-100 % busy
    uncharged = run.controller.use_charged_to_nobody
    assert list(uncharged) == [run.gpu.uuid]
    assert 30 < uncharged[run.gpu.uuid] < 50


async def _restarted(figure_file: FigureFile | None, seed: int, solo_turns: bool = True
                     ) -> list[float]:
    """The first of two strict 30 % containers alone for 5 s, then both for 20 s; the agent
    restarts (a new controller, `figure_file` the one its predecessor saved to, or none), and
    they run 25 s more. Each one's mean share over the last 10 s, but for the seconds of a
    turn alone (a pause, whose cost is judged elsewhere: a figure that came out right left a
    container paused for 1.1 s of those 10 at 24.4 % of its 30, one read 8 % light at 27.3)."""
    sc, _ = scenario((30, 30), 20e-6, alone=1, together_s=45)
    with turns_counted() as given:
        run = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                            paced=True, figure_file=figure_file, solo_turns=solo_turns)
        await run.advance(25)
        run.restart_controller(figure_file)
        await run.advance(25)
    return _between_turns(run, given, 40)


def _between_turns(run: ControlledRun, given: list[tuple[int, str]], since_s: float
                   ) -> list[float]:
    """Each container's mean share from `since_s` on, but for the seconds of the turns alone
    `given` (`turns_counted`): the pauses, whose cost is judged elsewhere."""
    turns = [(at_ns - START_NS) / 1e9 for at_ns, _ in given]
    series = _series(run.gpu, run.procs, 0.5)
    return [statistics.fmean(share for t, share in series[name] if t > since_s and not any(
        start < t <= start + SOLO_TURN_MOST_S + 0.5 for start in turns))
        for name in sorted(series)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_what_a_container_alone_showed_outlives_an_agent_restart(tmp_path, seed):
    store = FigureFile(tmp_path / "figures.json")
    with capture_logs() as logs:
        got = await _restarted(store, seed)
    # the first's figure from alone, the second's from its turn alone once they shared
    assert [e["figures"] for e in logs if e["event"] == "throttle_figures_restored"] == [2]
    for share in got:
        assert 30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 2, got
    # forgotten (no file), the same two are given a turn alone ...
    for share in await _restarted(None, seed):
        assert 30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 2, got
    # ... without which they starve
    assert max(await _restarted(None, seed, solo_turns=False)) < 10


@pytest.mark.slow
@pytest.mark.parametrize("limits", [(30, 30), (30, 50), (20, 30, 40)])
async def test_containers_never_alone_are_given_a_turn_alone_and_keep_their_shares(limits):
    # a turn each, SOLO_TURN_GAP_S apart, judged over the last 10 s once all were given
    with capture_logs() as logs:
        got = await held(limits, 20e-6, alone=0, together_s=15 + 12 * len(limits))
    for share, limit in zip(got, limits, strict=True):
        assert limit / timesliced.ALONE_MARGIN - 3 <= share <= limit + 2, (got, limits)
    # one turn each, the others paused, over once it was measured, in under 2 s; then again
    # only for a figure read at a few percent whose container now spends threefold
    started = [e for e in logs if e["event"] == "throttle_solo_turn_started"]
    ended = [e for e in logs if e["event"] == "throttle_solo_turn_ended"]
    names = [f"c{n}" for n in range(len(limits))]
    assert [(e["alloc_id"], e["paused"]) for e in started[:len(limits)]] \
        == [(name, len(limits) - 1) for name in names]
    assert all(e["why"] == COARSE for e in started[len(limits):]), started
    if limits == (30, 30):
        # the first's turn came with its rate cut to 4 % of the GPU (read 4), and it then
        # spent seven times as much: measured afresh
        assert [e["alloc_id"] for e in started[len(limits):]] == ["c0"], started
    assert len({e["alloc_id"] for e in started[len(limits):]}) == len(started) - len(limits)
    assert [(e["alloc_id"], e["why"]) for e in ended] \
        == [(e["alloc_id"], "measured") for e in started]
    assert all(0 < e["seconds"] < 2 for e in ended)


class _Writes:
    """Every rate the controller writes into the simulated regions, in order."""

    def __init__(self, run: ControlledRun) -> None:
        self.log: list[tuple[float, str, int, int]] = []
        for name, region in run.regions.items():
            original = region.set_rate

            def record(dev: int, rate: int, burst: int, name=name, original=original) -> None:
                self.log.append((run.gpu.elapsed_s, name, rate, burst))
                original(dev, rate, burst)

            region.set_rate = record  # type: ignore[method-assign]

    def of(self, name: str) -> list[tuple[float, int, int]]:
        return [(t, rate, burst) for t, n, rate, burst in self.log if n == name]


def _pair_together(together_s: float = 10) -> tuple[ControlledRun, _Writes]:
    """Two strict 30 % containers of 20 us kernels together from the start, and their writes."""
    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=together_s)
    run = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 0.2), paced=True)
    return run, _Writes(run)


async def _until_turn(run: ControlledRun, logs: list, most_s: float = 10.0) -> float:
    """Advance `run` in 0.1 s steps until a turn alone has started; when it did."""
    while run.gpu.elapsed_s < most_s:
        await run.advance(0.1)
        if any(e["event"] == "throttle_solo_turn_started" for e in logs):
            return run.gpu.elapsed_s
    raise AssertionError("no turn alone started")


@pytest.mark.slow
async def test_a_turn_pauses_the_others_and_writes_their_rates_back():
    run, writes = _pair_together()
    with capture_logs() as logs:
        await _until_turn(run, logs)
        assert run.regions["c1"].rate(0) == (0, 1)  # paused: no refill, nothing admitted
        before = writes.of("c1")[-2]  # what it had, written by the same tick before the pause
        assert before[1] > 0
        # what metrics and /status say meanwhile: the paused one, and what it gets back
        status = run.controller.status
        assert status[("c1", 0)].paused and not status[("c0", 0)].paused
        assert (status[("c1", 0)].rate, status[("c1", 0)].burst) == before[1:]
        while not any(e["event"] == "throttle_solo_turn_ended" for e in logs):
            await run.advance(0.1)
        paused_at, ended_at = writes.of("c1")[-2][0], writes.of("c1")[-1][0]
        assert writes.of("c1")[-1][1:] == before[1:]  # its rate, written back as it was
        await run.advance(0.3)
        assert not any(s.paused for s in run.controller.status.values())
    # the one measured kept its rate all along: no write between the pause and its end
    assert not [w for w in writes.of("c0") if paused_at < w[0] < ended_at]
    # nobody was taken for a liar for claims made under the pause
    assert "tokens_overclaimed" not in run.controller.error_counts
    assert run.controller.solo_turns_given == {run.gpu.uuid: 1}  # (the metric's count)


@pytest.mark.slow
async def test_a_turn_under_way_is_ended_when_the_controller_stops():
    run, writes = _pair_together()
    with capture_logs() as logs:
        await _until_turn(run, logs)
        before = writes.of("c1")[-2]
        run.controller.end_turns()  # what `run` does as it is cancelled
    assert run.regions["c1"].rate(0) == before[1:]
    assert [e["why"] for e in logs if e["event"] == "throttle_solo_turn_ended"] == ["stopping"]


@pytest.mark.slow
async def test_an_agent_killed_during_a_turn_leaves_no_container_paused():
    # killed, not stopped: the paused rate stays in the region for the next agent to find
    run, _ = _pair_together(together_s=40)
    with capture_logs() as logs, turns_counted() as given:
        await _until_turn(run, logs)
        await run.advance(0.3)
        assert run.regions["c1"].rate(0) == (0, 1)
        run.restart_controller()
        await run.advance(1.0)
        # the new controller takes the pause for a rate never written, and writes its own
        assert run.regions["c1"].rate(0)[0] > 0
        # then gives turns of its own; the measured one climbs back slowly (about 10 s: the
        # law, restarted into the swings of its neighbour's cold start, took its readings
        # for noise)
        await run.advance(25.0)
    # (the last 10 s but for turns alone: the second's first turn, 3 s after the first's, and
    # re-measures of figures read at a few percent may fall there)
    got = _between_turns(run, given, run.gpu.elapsed_s - 10)
    for share in got:
        assert 30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 2, got


@pytest.mark.slow
async def test_a_paused_container_claiming_tokens_neither_ends_the_turn_nor_is_judged_for_it():
    # hostile: it writes spending into `state` while paused, to deny its neighbour a figure
    run, writes = _pair_together()
    with capture_logs() as logs:
        await _until_turn(run, logs)
        before = writes.of("c1")[-2]
        await run.advance(0.25)
        slot = run.regions["c1"].processes[0]
        for _ in range(10):
            slot.tokens_spent[0] += 10**9
            if any(e["event"] == "throttle_solo_turn_ended" for e in logs):
                break
            await run.advance(0.1)
        while not any(e["event"] == "throttle_solo_turn_ended" for e in logs):
            await run.advance(0.1)
    assert [(e["why"], e["measured"]) for e in logs
            if e["event"] == "throttle_solo_turn_ended"] == [("measured", True)]
    assert run.regions["c1"].rate(0) == before[1:]
    assert run.controller.error_counts.get("tokens_overclaimed", 0) == 0


async def _turn_with_claims(tokens: int) -> tuple[float, str, bool]:
    """The pair's turn, the paused container claiming `tokens` a step from 0.25 s into it
    (a step is 0.1 s, a tick): (when it ended, why, whether measured)."""
    run, _ = _pair_together()
    with capture_logs() as logs:
        await _until_turn(run, logs)
        await run.advance(0.25)
        slot = run.regions["c1"].processes[0]
        while not any(e["event"] == "throttle_solo_turn_ended" for e in logs):
            slot.tokens_spent[0] += tokens
            await run.advance(0.1)
    (ended,) = [e for e in logs if e["event"] == "throttle_solo_turn_ended"]
    return run.gpu.elapsed_s, ended["why"], ended["measured"]


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [2, 10**9])
async def test_a_paused_container_claiming_spending_does_not_delay_the_figure(tokens):
    # What a paused bucket (1 token, no refill) and the audit's allowance for jitter let a
    # claim be believed (3 tokens at the turn's second tick, then none) would take the batch
    # it falls in from the one measured, as if shared; it falls in the turn's first periods,
    # which are not counted anyway, and the controller believes a paused device's claims as
    # 0 past the turn's first tick besides. The turn ends as if nothing had been claimed.
    honest = await _turn_with_claims(0)
    assert honest[1:] == ("measured", True)
    assert await _turn_with_claims(tokens) == honest


@pytest.mark.slow
async def test_a_paused_container_that_runs_all_the_same_ends_the_turn():
    # its shim ignores the pause (simulated: its bucket refilled behind the agent's back):
    # NVML gives it periods, the figure cannot be made, the turn ends at once
    run, writes = _pair_together()
    with capture_logs() as logs:
        started = await _until_turn(run, logs)
        before = writes.of("c1")[-2]
        run.regions["c1"].set_rate(0, *before[1:])
        while not any(e["event"] == "throttle_solo_turn_ended" for e in logs):
            await run.advance(0.1)
    (ended,) = [e for e in logs if e["event"] == "throttle_solo_turn_ended"]
    assert (ended["why"], ended["measured"]) == ("others_ran", False)
    # a warning names the container that ran, for the operator to look at its shim
    (spoiled,) = [e for e in logs if e["event"] == "throttle_solo_turn_spoiled"]
    assert (spoiled["alloc_id"], spoiled["ran"], spoiled["log_level"]) == ("c0", ["c1"],
                                                                          "warning")
    assert run.gpu.elapsed_s - started < 1.5  # not left to run out its 1.9 s
    assert run.regions["c1"].rate(0) == before[1:]


@pytest.mark.slow
async def test_no_turn_where_a_container_cannot_be_paused_or_samples_are_per_process():
    from vgpu_agent.simulation.imperfections import REAL
    from vgpu_agent.simulation.runner import ContainerSpec

    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=10)
    unlimited = (sc.containers[0], ContainerSpec("c1", 30, sc.containers[1].workload,
                                                 policy="off"))
    for containers, plant in ((unlimited, PlantSpec(H200_TIME_SLICED, 0.2)),
                              (sc.containers, PlantSpec(REAL, 0.2))):
        run = ControlledRun(containers, plant=plant, paced=True)
        with capture_logs() as logs:
            await run.advance(10)
        assert not [e for e in logs if e["event"] == "throttle_solo_turn_started"]


@pytest.mark.slow
async def test_the_turn_goes_to_the_container_of_highest_priority():
    # a service marked more important is the one left running: its neighbour waits
    from dataclasses import replace

    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=10)
    service = replace(sc.containers[1], priority=50)
    run = ControlledRun((sc.containers[0], service), plant=PlantSpec(H200_TIME_SLICED, 0.2),
                        paced=True)
    writes = _Writes(run)
    with capture_logs() as logs:
        await _until_turn(run, logs)
        assert run.regions["c0"].rate(0) == (0, 1) and run.regions["c1"].rate(0)[0] > 0
        while not any(e["event"] == "throttle_solo_turn_ended" for e in logs):
            await run.advance(0.1)
    assert [(e["alloc_id"], e["why"]) for e in logs if e["event"] == "throttle_solo_turn_ended"
            ] == [("c1", "measured")]
    assert writes.of("c0")[-1][1] > 0  # written back


@pytest.mark.slow
async def test_two_containers_spared_by_the_operator_are_never_paused():
    # both of priority 60, containers of 50 or more spared: no turn (they starve as without
    # turns, which the operator chose); spared from 70 up, the usual turns (each its first, the
    # second right after the first; then the first's figure, read at a few percent while the
    # rates were cut, measured again)
    from dataclasses import replace

    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=10)
    both = tuple(replace(c, priority=60) for c in sc.containers)
    for at_least, turns in ((50, 0), (70, 2)):
        run = ControlledRun(both, plant=PlantSpec(H200_TIME_SLICED, 0.2), paced=True)
        run.controller.solo_turn_spare_priority = at_least
        with capture_logs() as logs:
            await run.advance(8)
        first = [e["alloc_id"] for e in logs if e["event"] == "throttle_solo_turn_started"
                 and "never seen alone" in e["why"]]
        assert first == ["c0", "c1"][:turns]
        if not turns:
            assert not any(s.paused for s in run.controller.status.values())


@pytest.mark.slow
@pytest.mark.parametrize("poll_periods", [1, 2])
async def test_periods_read_together_are_read_as_the_h200s_driver_answers(poll_periods):
    # Read after two periods, the H200's driver gave each process one sample worth its part
    # of the use over both: 50 and 50 where each period read 99. Taken for periods of their
    # own they read a GPU half idle, and both strict rates went up 60 % whenever the calm tick
    # outgrew the period (a 50 % container at up to 73 % on the H200). NVML asked every other
    # period, each read is such a pair: the shares hold all the same, over the last 20 s of 40.
    from vgpu_agent.simulation.runner import run_controlled

    sc, _ = scenario((30.0, 50.0), 20e-6, 0, 40.0)
    run = await run_controlled(sc, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=2), paced=True,
                               nvml_poll_periods=poll_periods)
    for name, limit in (("c0", 30.0), ("c1", 50.0)):
        late = [share for t, share in run.series[name] if t > 20]
        assert limit / timesliced.ALONE_MARGIN - 3 <= sum(late) / len(late) <= limit + 1, name
        assert max(late) <= limit + 3, (name, max(late))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_a_container_never_measured_gets_its_turn_soon_after_the_first(seed):
    # The H200's pair: a strict 50 % container of 200 us kernels beside a strict 30 % one of
    # 20 us. After the 30 % one's turn, the other is charged at its figure times a cost the
    # periods understate; with first turns 10 s apart it ran at 66-71 % of its work from 10 to
    # 15 s (at 64 % on the H200). Its own turn right after the first (whose container it pauses
    # has just run alone: 3 s after it, the highest 5 s were 50-74 % over 11 seeds; now 49-65)
    # holds it from there.
    shares, turns = await unequal_run(20.0, seed)
    assert turns[1] - turns[0] < 2.5, turns
    assert statistics.fmean(shares["c1"][100:150]) <= 50 + 1.5
    before, turns = await unequal_run(20.0, seed, first_gap_s=10.0)
    assert turns[1] - turns[0] > 10, turns
    assert statistics.fmean(before["c1"][100:150]) > 60


@pytest.mark.slow
@pytest.mark.parametrize("seed", [10, 33])
async def test_a_container_measured_in_its_turn_is_held_to_its_limit_from_there(seed):
    # The same pair. Before its turn the 50 % one is charged by its tokens at the 30 % one's
    # figure times a cost the periods understate, and the law learns `k` from those charges,
    # confidently; once its own figure charges it, the law (told nothing) followed the new
    # charges a few percent a reading: up to 59 % over 2-s spells from 10 to 20 s (seed 33),
    # and the 30 % one at 36 % for 2 s after a re-measure (seed 10).
    shares, _ = await unequal_run(30.0, seed)
    for name, limit in (("c0", 30.0), ("c1", 50.0)):
        got = shares[name]
        spells = [statistics.fmean(got[a:a + 20]) for a in range(100, len(got) - 19, 20)]
        assert max(spells) <= limit + 1.5, (name, [round(s, 1) for s in spells])
        assert statistics.fmean(got[150:]) >= limit - 3, name


@pytest.mark.slow
async def test_where_no_turn_fits_the_operator_is_told_once_and_none_is_given():
    # NVML sampling the GPU once a second: six periods take 6 s, past the 1.9 s a turn may last
    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=20)
    slow = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 1.0), paced=True)
    with capture_logs() as logs:
        await slow.advance(20)
    said = [e for e in logs if e["event"] == "throttle_solo_turns_impossible"]
    assert len(said) == 1, said
    assert said[0]["sample_period_s"] == pytest.approx(1.0)
    assert said[0]["periods_needed"] * said[0]["sample_period_s"] > said[0]["turn_most_s"]
    assert not [e for e in logs if e["event"] == "throttle_solo_turn_started"]
    assert slow.controller.nvml_sample_periods == {slow.gpu.uuid: pytest.approx(1.0)}
    # at the H200's 0.2 s a turn fits: nothing said, turns given
    fast, _ = _pair_together(together_s=20)
    with capture_logs() as logs:
        await fast.advance(20)
    assert not [e for e in logs if e["event"] == "throttle_solo_turns_impossible"]
    assert [e for e in logs if e["event"] == "throttle_solo_turn_started"]
    assert fast.controller.nvml_sample_periods == {fast.gpu.uuid: pytest.approx(0.2)}


@pytest.mark.slow
async def test_the_containers_awaiting_a_figure_are_counted_down_as_turns_measure_them():
    run, _ = _pair_together(together_s=30)
    seen: list[int] = []
    with capture_logs() as logs:
        while run.gpu.elapsed_s < 30:
            await run.advance(0.1)
            count = run.controller.unmeasured_containers.get(run.gpu.uuid)
            if count is not None and (not seen or seen[-1] != count):
                seen.append(count)
    measured = [e for e in logs if e["event"] == "throttle_solo_turn_ended" and e["measured"]]
    assert len(measured) >= 2, logs
    # both awaited a figure, then one had its own, then both (what the gauge shows); between,
    # a first figure read while the rates were cut is wanted again (`TimeSlicedSplit.coarse`)
    assert seen[0] == 2 and seen[1] == 1 and seen[-1] == 0 and max(seen) == 2, seen
    assert run.controller.unmeasured_containers == {run.gpu.uuid: 0}


async def test_no_container_is_counted_awaiting_on_a_gpu_not_time_sliced():
    sc, _ = scenario((30, 30), 20e-6, alone=0, together_s=5)
    run = ControlledRun(sc.containers, plant=PlantSpec(), paced=True)
    await run.advance(5.0)
    assert run.controller.time_sliced_gpus == frozenset()
    assert run.controller.unmeasured_containers == {}

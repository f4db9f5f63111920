"""The controller on a time-sliced GPU that counts itself busy beyond the work done, as the
H200 did without MPS: two processes with sparse launches, each doing 20 % of the work, read
99 % busy (`imperfections.H200_TIME_SLICED`). Shared out whole, that use starved two strict
30 % containers to 4 % each (simulated); once each was seen alone, what their tokens buy
there bounds what is shared out. Shares are judged by the SM time each really got."""

from __future__ import annotations

import math

import pytest
from structlog.testing import capture_logs

from tests.bench.bench_launch_holds import held, last_shares, scenario
from vgpu_agent.simulation.imperfections import H200_TIME_SLICED
from vgpu_agent.simulation.runner import ControlledRun, PlantSpec, _series
from vgpu_agent.throttle import timesliced
from vgpu_agent.throttle.figurefile import FigureFile


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
    assert len(said) == 1 and said[0]["busy"] > timesliced.ALONE_MARGIN * said[0]["explained"]


@pytest.mark.slow
@pytest.mark.parametrize("limits", [(30, 30), (30, 50)])
async def test_one_container_seen_alone_is_enough_for_those_that_join_it(limits):
    # the first one's figure sets the scale; the others' tokens count at their periods' costs
    got = await held(limits, 20e-6, alone=1)
    for share, limit in zip(got, limits, strict=True):
        assert limit / timesliced.ALONE_MARGIN - 3 <= share <= limit + 2, (got, limits)


@pytest.mark.slow
async def test_containers_never_alone_are_starved_by_the_use_counted(monkeypatch):
    # what the bound cannot help: nothing says what their tokens buy (recorded here, so that a
    # change of it is seen)
    with capture_logs() as logs:
        got = await held((30, 30), 20e-6, alone=0)
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


async def _restarted(figure_file: FigureFile | None, seed: int) -> list[float]:
    """The first of two strict 30 % containers alone for 5 s, then both for 20 s; the agent
    restarts (a new controller, `figure_file` the one its predecessor saved to, or none), and
    they run 25 s more. Each one's mean share over the last 10 s."""
    sc, _ = scenario((30, 30), 20e-6, alone=1, together_s=45)
    run = ControlledRun(sc.containers, plant=PlantSpec(H200_TIME_SLICED, 0.2, seed=seed),
                        paced=True, figure_file=figure_file)
    await run.advance(25)
    run.restart_controller(figure_file)
    await run.advance(25)
    return last_shares(_series(run.gpu, run.procs, 0.5), 50)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_what_a_container_alone_showed_outlives_an_agent_restart(tmp_path, seed):
    store = FigureFile(tmp_path / "figures.json")
    with capture_logs() as logs:
        got = await _restarted(store, seed)
    assert [e["figures"] for e in logs if e["event"] == "throttle_figures_restored"] == [1]
    for share in got:
        assert 30 / timesliced.ALONE_MARGIN - 3 <= share <= 30 + 2, got
    # forgotten (no file), the same two starve
    assert max(await _restarted(None, seed)) < 10

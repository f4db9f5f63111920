"""Turns alone carried out for the controller (`throttle/turnkeeper.py`): who is paused, what
is written back at the end and to whom, the operator told once where no turn fits."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import structlog.testing

from vgpu_agent.throttle.control import ControlParams, Decision, LoopState
from vgpu_agent.throttle.soloturn import PAUSED_BURST, PAUSED_RATE, SOLO_TURN_AFTER_S
from vgpu_agent.throttle.timesliced import TimeSlicedSplit
from vgpu_agent.throttle.turnkeeper import TurnKeeper

GPU = "GPU-0"
SIXTH_S = 1 / 6  # an H200's sample period: a turn alone fits
AFTER_NS = int(SOLO_TURN_AFTER_S * 1e9)


@dataclass
class _Region:
    closed: bool = False


@dataclass
class _Device:
    alloc_id: str
    rate: int
    limit: float = 40.0
    priority: int = 0
    limited: bool = True
    paused: bool = False
    region: _Region = field(default_factory=_Region)

    @property
    def key(self) -> str:
        return f"{self.alloc_id}/0"

    @property
    def limits(self) -> tuple[float, str, str, int]:
        return (self.limit, "strict", "strict", self.priority)

    @property
    def last(self) -> tuple[object, Decision, bool]:
        return (None, Decision(self.rate, self.rate // 10, self.limit, True, 0.0, LoopState()),
                False)


class _Keeper:
    """A keeper over two strict containers both spending, with every rate it writes kept."""

    def __init__(self, spare_priority: int | None = None, **devices: int) -> None:
        self.written: list[tuple[str, int, int]] = []
        self.keeper: TurnKeeper[_Device] = TurnKeeper(
            ControlParams(), lambda d, rate, burst: self.written.append((d.key, rate, burst)),
            spare_priority)
        self.devices = {f"{name}/0": _Device(name, rate) for name, rate in
                        (devices or {"a": 40_000, "b": 60_000}).items()}
        self.split = TimeSlicedSplit()

    def offer(self, at_ns: int, period_s: float = SIXTH_S) -> bool:
        steered = [(d, 0, 0) for d in self.devices.values()]
        spent = {d.alloc_id: 1_000 for d in self.devices.values()}
        return self.keeper.offer(GPU, self.split, steered, spent, at_ns, period_s, True)

    def end(self, at_ns: int, why: str = "too_long") -> None:
        self.keeper.end(GPU, why, at_ns, self.split, self.devices, {})


def test_a_turn_waits_for_containers_spending_together_then_pauses_every_other_one():
    k = _Keeper()
    assert not k.offer(0)
    assert not k.offer(AFTER_NS - 1)
    assert k.written == [] and k.keeper.solo(GPU) == ""
    assert k.offer(AFTER_NS)
    assert k.keeper.solo(GPU) == "a"  # neither tried yet: the first spending
    assert k.written == [("b/0", PAUSED_RATE, PAUSED_BURST)]
    assert k.devices["b/0"].paused and not k.devices["a/0"].paused
    assert dict(k.keeper.given) == {GPU: 1}
    assert not k.keeper.past_first_tick(GPU)
    assert not k.offer(AFTER_NS + 1)  # one turn at a time
    assert dict(k.keeper.given) == {GPU: 1}


def test_the_end_writes_back_the_kept_rates_to_devices_still_followed_and_open():
    k = _Keeper(a=10_000, b=20_000, c=30_000, d=40_000)
    assert not k.offer(0) and k.offer(AFTER_NS)
    assert k.keeper.solo(GPU) == "a"
    k.written.clear()
    k.devices["c/0"].region.closed = True  # its container left during the turn
    gone = k.devices.pop("d/0")  # no longer followed at all
    k.end(AFTER_NS + 10**9)
    # burst as the last decision had it (a tenth of the rate here)
    assert k.written == [("b/0", 20_000, 2_000)]
    assert not k.devices["b/0"].paused and not k.devices["b/0"].limited  # bucket full again
    assert not k.devices["c/0"].paused  # unpaused though nothing could be written
    assert gone.paused  # not followed: nothing of it touched
    assert k.keeper.solo(GPU) == ""
    k.end(AFTER_NS + 2 * 10**9)  # no turn under way: nothing written twice
    assert k.written == [("b/0", 20_000, 2_000)]


def test_a_turn_that_read_nothing_ends_without_a_figure_and_says_so():
    k = _Keeper()
    assert not k.offer(0) and k.offer(AFTER_NS)
    with structlog.testing.capture_logs() as logs:
        k.end(AFTER_NS + 2 * 10**9)
    ended = [e for e in logs if e["event"] == "throttle_solo_turn_ended"]
    assert [(e["alloc_id"], e["why"], e["measured"], e["figure"]) for e in ended] == [
        ("a", "too_long", False, "none")]


def test_a_turn_is_over_where_nothing_follows_it():
    k = _Keeper()
    assert k.keeper.over(GPU, k.split, {}, 0) == "no_turn"
    assert not k.offer(0) and k.offer(AFTER_NS)
    assert k.keeper.over(GPU, None, {"a": 1}, AFTER_NS) == "not_time_sliced"
    # the one alone stopped spending: over, and its first tick counted
    assert k.keeper.over(GPU, k.split, {"a": 0}, AFTER_NS + 1) == "stopped"
    assert k.keeper.past_first_tick(GPU)


def test_a_spared_container_is_never_the_one_paused():
    k = _Keeper(spare_priority=5)
    k.devices["b/0"].priority = 5
    assert not k.offer(0) and k.offer(AFTER_NS)
    assert k.keeper.solo(GPU) == "b"  # the spared one may only be given the turn itself
    assert [key for key, _, _ in k.written] == ["a/0"]


def test_the_operator_is_told_once_where_no_turn_fits_and_none_is_given():
    k = _Keeper()
    with structlog.testing.capture_logs() as logs:
        for at_s in range(0, 12):
            assert not k.offer(at_s * 10**9, period_s=1.0)  # six periods take 6 s
    told = [e for e in logs if e["event"] == "throttle_solo_turns_impossible"]
    assert len(told) == 1
    assert told[0]["uuid"] == GPU and told[0]["sample_period_s"] == 1.0
    assert k.written == [] and dict(k.keeper.given) == {}


def test_forgetting_a_gpu_drops_its_turns():
    k = _Keeper()
    assert not k.offer(0) and k.offer(AFTER_NS)
    k.end(AFTER_NS + 10**9)
    assert list(k.keeper.gpus()) == [GPU]
    k.keeper.forget(GPU)
    assert list(k.keeper.gpus()) == []
    assert dict(k.keeper.given) == {GPU: 1}  # given since start: kept for the metric


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_figures_longest_age_must_be_finite_and_not_negative(bad: float):
    with pytest.raises(ValueError, match=r"longest age must be >= 0 s .*got"):
        TurnKeeper(ControlParams(), lambda d, r, b: None, None, bad)

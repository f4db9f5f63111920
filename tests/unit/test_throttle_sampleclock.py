"""When a GPU's NVML samples are asked for, and what a batch of them describes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.throttle.sampleclock import (
    ASK_EARLY_NS,
    LAG_READINGS,
    SAME_INSTANT_US,
    SampleClock,
    one_stamp_per_instant,
)

GPU = "GPU-a"
MS = 1_000  # microseconds
S_NS = 1_000_000_000


def _at(*stamps_us: int, pid: int = 7, value: int = 40) -> list[ProcessSample]:
    return [ProcessSample(pid, stamp, value) for stamp in stamps_us]


def test_a_gpu_never_read_is_due_and_asked_for_everything():
    clock = SampleClock(tick_s=0.1)
    assert clock.due(GPU, now_ns=5 * S_NS)
    assert clock.since_us(GPU) == 0
    assert clock.newest_us(GPU) is None
    assert clock.period_us(GPU) == 0
    assert clock.periods_s() == {}


def test_the_first_answer_counts_its_newest_period_only_and_tells_the_period():
    clock = SampleClock(tick_s=0.1)
    history = _at(1_000 * MS, 1_200 * MS, 1_400 * MS) + _at(1_400 * MS, pid=8)
    kept = clock.accepted(GPU, history)
    assert {(s.pid, s.timestamp_us) for s in kept} == {(7, 1_400 * MS), (8, 1_400 * MS)}
    assert clock.since_us(GPU) == 1_400 * MS
    assert clock.period_us(GPU) == 200 * MS
    # later answers are all new
    later = _at(1_600 * MS, 1_800 * MS)
    assert clock.accepted(GPU, later) == later
    assert clock.since_us(GPU) == 1_800 * MS


def test_a_stamp_older_than_the_newest_does_not_move_what_is_asked_for_back():
    clock = SampleClock(tick_s=0.1)
    clock.accepted(GPU, _at(2_000 * MS))
    clock.accepted(GPU, _at(1_000 * MS))
    assert clock.since_us(GPU) == 2_000 * MS


def test_a_first_sample_without_history_describes_at_most_the_time_watched():
    clock = SampleClock(tick_s=0.1)
    assert clock.due(GPU, now_ns=10 * S_NS)
    # read 0.3 s after the GPU was first asked: 0.3 s and the tick, no more
    span_s, count = clock.span(GPU, _at(9_900 * MS), now_ns=10 * S_NS + 300_000_000)
    assert span_s == pytest.approx(0.4)
    assert count == 1
    # and never more than a second, however long it was watched
    other = SampleClock(tick_s=0.1)
    other.due(GPU, now_ns=0)
    assert other.span(GPU, _at(9_000 * MS), now_ns=10 * S_NS)[0] == 1.0


def test_the_period_is_the_shortest_gap_and_a_batch_spans_its_stamps_periods():
    clock = SampleClock(tick_s=0.1)
    clock.due(GPU, now_ns=0)
    clock.span(GPU, _at(1_000 * MS), now_ns=1_010 * MS * 1_000)
    # a missed period: the gap of 400 ms spans two
    span_s, count = clock.span(GPU, _at(1_400 * MS, 1_600 * MS), now_ns=1_610 * MS * 1_000)
    assert clock.period_us(GPU) == 200 * MS
    assert (span_s, count) == (pytest.approx(0.4), 2)
    assert clock.newest_us(GPU) == 1_600 * MS
    assert clock.periods_s() == {GPU: pytest.approx(0.2)}


def test_nvml_is_not_asked_again_before_its_next_period_is_over():
    clock = SampleClock(tick_s=0.1)
    clock.due(GPU, now_ns=0)
    # stamps 200 ms apart, each first read 30 ms after its stamp
    clock.span(GPU, _at(1_000 * MS), now_ns=1_030 * MS * 1_000)
    clock.span(GPU, _at(1_200 * MS), now_ns=1_230 * MS * 1_000)
    # next: 1,400 ms plus the least delay (30 ms), less the margin (a millisecond)
    due_ns = (1_400 + 30) * MS * 1_000 - ASK_EARLY_NS
    assert not clock.due(GPU, now_ns=due_ns - 1)
    assert clock.due(GPU, now_ns=due_ns)


def test_the_least_delay_of_recent_readings_sets_the_schedule():
    clock = SampleClock(tick_s=0.1)
    clock.due(GPU, now_ns=0)
    stamp = 1_000 * MS
    clock.span(GPU, _at(stamp), now_ns=(stamp + 10 * MS) * 1_000)  # one tick read it early
    for reading in range(LAG_READINGS):
        stamp += 200 * MS
        clock.span(GPU, _at(stamp), now_ns=(stamp + 90 * MS) * 1_000)
        least_ms = 10 if reading < LAG_READINGS - 1 else 90
        due_ns = (stamp + 200 * MS + least_ms * MS) * 1_000 - ASK_EARLY_NS
        assert (clock.due(GPU, now_ns=due_ns - 1), clock.due(GPU, now_ns=due_ns)) == (
            False, True), reading


def _read_200ms_apart(poll_periods: int, *stamps_ms: int) -> SampleClock:
    """A clock that read one GPU's periods stamped at `stamps_ms`, each as it was stamped."""
    clock = SampleClock(tick_s=0.1, poll_periods=poll_periods)
    clock.due(GPU, now_ns=0)
    for stamp_ms in stamps_ms:
        clock.span(GPU, _at(stamp_ms * MS), now_ns=stamp_ms * MS * 1_000)
    return clock


def _first_due_at(clock: SampleClock, due_ns: int) -> bool:
    """Whether the GPU is due at `due_ns` and not a nanosecond before."""
    return (clock.due(GPU, now_ns=due_ns - 1), clock.due(GPU, now_ns=due_ns)) == (False, True)


def test_asked_every_few_periods_where_the_operator_says_so():
    clock = _read_200ms_apart(3, 1_000, 1_200)
    assert _first_due_at(clock, (1_200 + 3 * 200) * MS * 1_000 - ASK_EARLY_NS)


def test_a_learning_gpu_is_asked_every_period_then_every_few_again():
    clock = _read_200ms_apart(3, 1_000)
    clock.every_period(GPU, True)
    clock.span(GPU, _at(1_200 * MS), now_ns=1_200 * MS * 1_000)
    # the next period, not the third
    assert _first_due_at(clock, (1_200 + 200) * MS * 1_000 - ASK_EARLY_NS)
    clock.every_period(GPU, False)
    clock.span(GPU, _at(1_400 * MS), now_ns=1_400 * MS * 1_000)
    assert _first_due_at(clock, (1_400 + 3 * 200) * MS * 1_000 - ASK_EARLY_NS)


def test_turning_loose_brings_the_next_ask_forward_to_the_next_period():
    # a far reading awaits the next to confirm it: asked in a period, not in three
    clock = _read_200ms_apart(3, 1_000, 1_200)
    assert not clock.due(GPU, now_ns=1_500 * MS * 1_000)
    clock.every_period(GPU, True)
    due_ns = (1_200 + 200) * MS * 1_000 - ASK_EARLY_NS
    assert _first_due_at(clock, due_ns)
    # still loose at the next tick: nothing moves again
    clock.every_period(GPU, True)
    assert clock.due(GPU, now_ns=due_ns)
    # and another GPU, never read, is not touched (nothing to schedule from)
    clock.every_period("GPU-b", True)
    assert clock.due("GPU-b", now_ns=0)


def test_the_periods_between_asks_are_told_per_gpu_whose_period_is_known():
    assert SampleClock(tick_s=0.1, poll_periods=3).poll_periods_now() == {}
    clock = _read_200ms_apart(3, 1_000)
    assert clock.poll_periods_now() == {}  # one stamp: no period yet
    clock.span(GPU, _at(1_200 * MS), now_ns=1_200 * MS * 1_000)
    assert clock.poll_periods_now() == {GPU: 3}
    clock.every_period(GPU, True)
    assert clock.poll_periods_now() == {GPU: 1}
    clock.every_period(GPU, False)
    assert clock.poll_periods_now() == {GPU: 3}


def test_learning_changes_nothing_where_every_period_is_asked():
    clock = _read_200ms_apart(1, 1_000, 1_200)
    for loose in (True, False):
        clock.every_period(GPU, loose)
        assert _first_due_at(clock, (1_200 + 200) * MS * 1_000 - ASK_EARLY_NS)


def test_gpus_are_kept_apart():
    clock = SampleClock(tick_s=0.1)
    clock.accepted(GPU, _at(1_000 * MS, 1_200 * MS))
    assert clock.since_us("GPU-b") == 0
    assert clock.period_us("GPU-b") == 0


@pytest.mark.parametrize("tick_s", [0.0, -0.1, float("nan")])
def test_a_tick_that_is_not_positive_is_refused_by_name(tick_s: float):
    with pytest.raises(ValueError, match="tick must be > 0 s"):
        SampleClock(tick_s=tick_s)


@pytest.mark.parametrize("periods", [0, 11, 2.0, True])
def test_poll_periods_outside_one_to_ten_are_refused_by_name(periods: object):
    with pytest.raises(ValueError, match=r"NVML poll periods must be an int in \[1, 10\]"):
        SampleClock(tick_s=0.1, poll_periods=periods)  # type: ignore[arg-type]


@given(period_ms=st.integers(min_value=50, max_value=1_000),
       gaps=st.lists(st.integers(min_value=1, max_value=4), min_size=2, max_size=30),
       per_batch=st.integers(min_value=1, max_value=3),
       # a delay for every batch: up to 31 stamps (the first and 30 gaps), one a batch
       delays_ms=st.lists(st.integers(min_value=0, max_value=40), min_size=31, max_size=31))
def test_read_on_any_schedule_the_period_and_spans_follow_the_stamps(period_ms, gaps, per_batch,
                                                                     delays_ms):
    # NVML stamps a period every `period_ms`; some are missed (gaps of several periods), and a
    # read may take up to `per_batch` stamps at once, some milliseconds after the last of them
    clock = SampleClock(tick_s=0.1)
    clock.due(GPU, now_ns=0)
    stamps = list(itertools.accumulate([1_000 * MS] + [g * period_ms * MS for g in gaps]))
    batches = [stamps[i:i + per_batch] for i in range(0, len(stamps), per_batch)]
    seen = 0
    for n, batch in enumerate(batches):
        read_ns = (batch[-1] + delays_ms[n] * MS) * 1_000
        span_s, count = clock.span(GPU, _at(*batch), now_ns=read_ns)
        seen += len(batch)
        assert count == len(batch)
        assert clock.newest_us(GPU) == batch[-1]
        if seen >= 2:
            # never shorter than the true period; the true one once two stamps a period
            # apart were seen
            assert clock.period_us(GPU) >= period_ms * MS
            if 1 in gaps[:seen - 1]:
                assert clock.period_us(GPU) == period_ms * MS
            assert span_s == pytest.approx(count * clock.period_us(GPU) / 1e6)
            # not asked again before the next period can be over
            assert not clock.due(GPU, now_ns=(batch[-1] + period_ms * MS) * 1_000 - 25 * MS
                                 * 1_000 - 1)
        else:
            assert 0 < span_s <= 1.0


def test_samples_stamped_apart_within_an_instant_get_its_last_stamp():
    t = 1_000 * MS
    found = one_stamp_per_instant([ProcessSample(7, t, 30), ProcessSample(8, t + 5, 20),
                                   ProcessSample(9, t + 3 * MS, 10),
                                   ProcessSample(7, t + 200 * MS, 31),
                                   ProcessSample(8, t + 202 * MS, 19)])
    assert [(s.pid, s.timestamp_us, s.sm_util) for s in found] == [
        (7, t + 3 * MS, 30), (8, t + 3 * MS, 20), (9, t + 3 * MS, 10),
        (7, t + 202 * MS, 31), (8, t + 202 * MS, 19)]


def test_an_instant_spans_at_most_same_instant_us_from_its_first_stamp():
    t = 5_000 * MS
    # each stamp within the limit of the one before, but the third beyond it from the first
    stamps = [t, t + SAME_INSTANT_US, t + 2 * SAME_INSTANT_US]
    found = one_stamp_per_instant([ProcessSample(n, stamp, 5) for n, stamp in enumerate(stamps)])
    assert [s.timestamp_us for s in found] == [t + SAME_INSTANT_US] * 2 + [stamps[2]]
    # a real period (1/6 s at the shortest) is never one instant
    assert SAME_INSTANT_US < 1_000_000 // 6 // 3


def test_samples_a_period_apart_are_left_as_they_are():
    samples = _at(1_000 * MS, 1_167 * MS) + _at(1_334 * MS, pid=8)
    assert one_stamp_per_instant(samples) is samples
    assert one_stamp_per_instant([]) == []


def test_the_period_is_not_taken_from_stamps_within_an_instant():
    clock = SampleClock(tick_s=0.1)
    history = [ProcessSample(pid, stamp + pid * 40, 20) for stamp in (0, 200 * MS, 400 * MS)
               for pid in (1, 2, 3)]
    kept = clock.accepted(GPU, history)
    assert clock.period_us(GPU) == 200 * MS
    assert {(s.pid, s.timestamp_us) for s in kept} == {(1, 400 * MS + 120), (2, 400 * MS + 120),
                                                       (3, 400 * MS + 120)}
    later = [ProcessSample(1, 600 * MS + 40, 20), ProcessSample(2, 600 * MS + 80, 20)]
    clock.due(GPU, now_ns=0)
    span_s, count = clock.span(GPU, clock.accepted(GPU, later), now_ns=700 * MS * 1_000)
    assert (span_s, count) == (pytest.approx(0.2), 1)


def test_an_instant_read_in_two_calls_does_not_set_the_period():
    """A read that comes while the driver writes one instant's samples gets some of them; the
    rest, stamped a little later, come at the next read: no period of a few milliseconds."""
    clock = SampleClock(tick_s=0.1)
    clock.due(GPU, now_ns=0)
    clock.span(GPU, clock.accepted(GPU, _at(1_000 * MS, 1_200 * MS)), now_ns=1_210 * MS * 1_000)
    assert clock.period_us(GPU) == 200 * MS
    rest = clock.accepted(GPU, _at(1_200 * MS + 3 * MS, pid=8))
    clock.span(GPU, rest, now_ns=1_310 * MS * 1_000)
    assert clock.period_us(GPU) == 200 * MS

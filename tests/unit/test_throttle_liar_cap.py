"""The cap on the rate of a container caught overclaiming (`throttle/audit.py`, `LiarCap`):
its claims are held to its rate, so only whether its use follows a move of the cap shows
whether that rate binds. The plant here is a container whose use is its rate over its true
`k`, at most what it would use unthrottled, with the reading of a move arriving two readings
after it. And the watch that caps a strict container whose own use stays above its target
(`OveruseWatch`), against the simulated GPU's noisy readings."""

from __future__ import annotations

import itertools
import random

import pytest

from vgpu_agent.simulation.imperfections import Imperfections
from vgpu_agent.throttle.audit import (
    CAP_CUT_MOST,
    IDLE_WAITS,
    LIAR_MARGIN,
    LIAR_MARGIN_POINTS,
    LIAR_PROBE,
    LIAR_PROBE_STEPS,
    OVERUSE_K_FALL,
    OVERUSE_READINGS,
    SPLIT_RAISE,
    SPLIT_RAISE_READINGS,
    LiarCap,
    OveruseWatch,
)

LARGEST_PROBE = LIAR_PROBE ** (1 + LIAR_PROBE_STEPS)

TARGET = 40.0


def use(rate: int, k: float, most: float) -> float:
    """Percent of SM time a container spending `rate` tokens/s uses, `k` tokens/s a percent."""
    return min(most, rate / k)


def steer(cap: LiarCap, k: float, most: float, readings: int, own: bool = True) -> list[int]:
    """Readings taken one period late (the rate of the reading before is what it shows)."""
    caps, shown = [], cap.cap
    for _ in range(readings):
        cap.read(cap.cap, use(shown, k, most), TARGET, own)
        shown = cap.cap
        caps.append(cap.cap)
    return caps


def test_a_rate_that_does_not_bind_is_cut_every_second_reading_deeper_each_time():
    # halved, then by 2, 4, 8 and 16 at most as each cut is not followed: a rate six orders
    # of magnitude too high, halved each time, took forty readings (a minute at a sample a
    # second) while its neighbour was held below its share
    cap = LiarCap(10**18, caught_ns=0)
    caps = steer(cap, k=1e6, most=49.0, readings=14)  # it uses 49 % whatever its rate
    assert caps[::2] == caps[1::2]  # one move every second reading
    cuts = [before / after for before, after in itertools.pairwise([10**18, *caps[::2]])]
    assert cuts == pytest.approx([2, 2, 4, 8, 16, 16, 16])
    assert CAP_CUT_MOST == 16


def test_a_cut_the_use_follows_ends_the_deepening():
    k = 1e6
    cap = LiarCap(10**13, caught_ns=0)  # 250,000 times what 40 % takes
    caps = steer(cap, k=k, most=49.0, readings=60)
    assert caps[-1] == pytest.approx(TARGET * k, rel=0.05)  # back up to its target's rate
    assert cap.cuts == 0


def test_halving_stops_where_the_rate_binds_and_the_cap_is_set_to_the_target():
    k = 1e6  # tokens/s a percent: the rate for 40 % is 40 million
    cap = LiarCap(10**10, caught_ns=0)  # 250 times too high
    caps = steer(cap, k=k, most=49.0, readings=40)
    assert caps[-1] == pytest.approx(TARGET * k, rel=0.05)
    assert len(set(caps[-10:])) == 1  # settled: no move once the use reads its target


def test_a_cut_past_the_binding_rate_is_undone_from_the_use_it_caused():
    k = 1e6
    cap = LiarCap(int(60 * k), caught_ns=0)  # it would use 60 %; the cut takes it to 30 %
    steer(cap, k=k, most=100.0, readings=1)
    assert cap.cap == int(30 * k)
    steer(cap, k=k, most=100.0, readings=2)  # the second reading after the cut judges it
    assert cap.cap == pytest.approx(TARGET * k, rel=0.01)


def test_a_container_not_using_its_rate_cannot_raise_its_cap():
    # runs at 2 % while claiming its whole rate: each raise is taken back, and each next
    # one waits longer
    cap = LiarCap(int(TARGET * 1e6), caught_ns=0)
    caps = steer(cap, k=1e6, most=2.0, readings=200)
    assert max(caps) <= LARGEST_PROBE * TARGET * 1e6
    assert caps[-1] == int(TARGET * 1e6)
    assert cap.idle >= len(IDLE_WAITS)
    raises = sum(1 for before, after in itertools.pairwise(caps) if after > before)
    assert raises <= 12  # the waits double: not one raise every other reading


def test_a_raise_the_use_follows_is_kept():
    k = 1e6
    cap = LiarCap(int(10 * k), caught_ns=0)  # capped at a quarter of its target
    caps = steer(cap, k=k, most=100.0, readings=12)
    assert caps[-1] == pytest.approx(TARGET * k, rel=0.05)
    assert cap.idle == 0


def test_readings_wandering_at_a_few_percent_raise_nothing():
    # whole percents at 2 % of use read 1 to 4: a doubling is no sign the use followed a
    # raise (the cap rose x2 every other reading on such noise, from a quarter of what its
    # target needs to 16 times over in 8 s, and the container ran unthrottled)
    first = int(TARGET * 1e6)
    cap, caps = LiarCap(first, caught_ns=0), []
    for util in itertools.islice(itertools.cycle([1.0, 2.0, 4.0, 1.0, 3.0, 2.0]), 300):
        cap.read(cap.cap, util, TARGET)
        caps.append(cap.cap)
    assert max(caps) <= LARGEST_PROBE * first  # one probe at a time, each taken back
    assert sum(1 for c in caps if c > first) <= 2 * 12  # two readings each, the waits doubling
    assert min(caps[-40:]) == first
    assert cap.idle >= len(IDLE_WAITS)


def test_a_container_whose_use_follows_from_a_few_percent_is_raised_to_its_target():
    k = 1e6
    cap = LiarCap(int(2 * k), caught_ns=0)  # a twentieth of what its target needs
    caps = steer(cap, k=k, most=100.0, readings=12)
    # within the band where a reading cannot be told from noise, once two readings in a row
    # showed each raise followed
    margin = TARGET * LIAR_MARGIN + LIAR_MARGIN_POINTS
    assert (TARGET - margin) * k <= caps[-1] <= TARGET * k
    assert caps.index(caps[-1]) <= 6
    assert cap.idle == 0


def test_noise_around_a_binding_rate_moves_nothing():
    cap = LiarCap(int(TARGET * 1e6), caught_ns=0)
    margin = TARGET * LIAR_MARGIN + LIAR_MARGIN_POINTS
    for util in [TARGET + margin * 0.9, TARGET - margin * 0.9] * 20:
        cap.read(cap.cap, util, TARGET)
    assert cap.cap == int(TARGET * 1e6)


def test_split_shares_only_cut_and_raise_slowly_up_to_the_first_rate():
    # a time-sliced GPU's split follows the believed tokens, that is the cap: no move is
    # judged, the cap is cut while the share reads high and raised while it reads low
    first = int(100 * 1e6)
    cap = LiarCap(first, caught_ns=0)
    cap.read(first, 70.0, TARGET, own=False)
    assert cap.cap == first // 2
    cap.read(first, 70.0, TARGET, own=False)  # the reading right after a cut: not judged
    assert cap.cap == first // 2
    for _ in range(SPLIT_RAISE_READINGS - 1):
        cap.read(cap.cap, 10.0, TARGET, own=False)
    cap.read(cap.cap, TARGET, TARGET, own=False)  # one reading on target: counted afresh
    for _ in range(SPLIT_RAISE_READINGS - 1):
        cap.read(cap.cap, 10.0, TARGET, own=False)
    assert cap.cap == first // 2  # not yet: SPLIT_RAISE_READINGS low readings in a row
    cap.read(cap.cap, 10.0, TARGET, own=False)
    assert cap.cap == int(first // 2 * SPLIT_RAISE)
    for _ in range(100):
        cap.read(cap.cap, 10.0, TARGET, own=False)
    assert cap.cap == first  # never above the rate it was first caught at


def test_a_cap_never_falls_below_one_token():
    cap = LiarCap(3, caught_ns=0)
    for _ in range(20):
        cap.read(cap.cap, 90.0, TARGET)
    assert cap.cap == 1


def test_a_container_whose_tokens_bought_far_less_climbs_out_with_larger_probes():
    # its use is a thousandth of what the cap's rate bought before: a probe of LIAR_PROBE
    # shows no more than noise, so each next probe goes further, and the one it follows
    # sets the cap near its target
    k = 1e6
    cap = LiarCap(int(TARGET * k / 1000), caught_ns=0)
    caps = steer(cap, k=k, most=100.0, readings=40)
    margin = TARGET * LIAR_MARGIN + LIAR_MARGIN_POINTS
    assert (TARGET - margin) * k <= caps[-1] <= TARGET * k
    assert cap.idle == 0


def run_watch(readings: list[float], ks: list[float]) -> list[bool]:
    watch = OveruseWatch()
    return [watch.read(util, TARGET, k) for util, k in zip(readings, ks, strict=True)]


def test_the_overuse_watch_fires_where_k_fell_and_the_use_did_not_follow():
    above = TARGET + 9.0
    falling = [1e9 * 0.95**n for n in range(30)]  # the law's k, a few percent a reading
    fired = run_watch([above] * 30, falling)
    first = fired.index(True)
    # twelve readings at least, and k down to half of what it was when the run began
    assert first >= OVERUSE_READINGS - 1
    assert falling[first] <= OVERUSE_K_FALL * falling[0] < falling[first - 1]
    assert all(fired[first:])
    # a reading at the margin ends the run: it starts again from there
    again = run_watch([above] * 20 + [TARGET + LIAR_MARGIN_POINTS] + [above] * 12,
                      falling + falling[:3])
    assert again[20:].count(True) == 0


def test_a_use_that_follows_k_down_never_fires_it():
    # an honest container whose tokens came to buy twice as much: the law brings k down as
    # slowly as it may, and its use comes down with it
    ks = [1e9 * 0.97**n for n in range(60)]
    uses = [2 * TARGET * k / ks[0] for k in ks]
    assert not any(run_watch(uses, ks))


def test_a_use_over_target_with_no_spending_claimed_fires_it():
    # k stands still only where no reading was paired with spending: the use is not the claims'
    assert run_watch([TARGET + 9.0] * 12, [1e9] * 12)[-1]
    # a k the law moves, however little, is learning from claimed spending: not this
    assert not any(run_watch([TARGET + 9.0] * 60, [1e9 * 0.999**n for n in range(60)]))


@pytest.mark.parametrize("sigma", [3.0, 8.0])
def test_noise_around_the_target_never_fires_the_overuse_watch(sigma):
    # readings as the simulated GPU gives them (a sampled proportion, whole percents) of a
    # container using exactly its target, an hour of them at six a second, k falling all along
    imperfections = Imperfections(nvml_sigma=sigma)
    rng = random.Random(5)
    watch = OveruseWatch()
    assert not any(watch.read(imperfections.observe(TARGET, rng), TARGET, 1e9 * 0.9**n)
                   for n in range(21_600))

"""`StrangerWatch`: a GPU whose busy samples go only to processes no container claims, while
containers spend, is reported once per episode, after the hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_agent.throttle.strangers import STRANGERS_ONLY_HOLD_S, StrangerWatch

S = 1_000_000_000


def test_an_episode_is_told_once_after_the_hold_with_its_pids_sorted():
    watch = StrangerWatch()
    told = [watch.observe("g", t * S // 2, ["c"], False, [9, 4]) for t in range(41)]  # 20 s
    first = told.index((4, 9))
    assert first == int(STRANGERS_ONLY_HOLD_S * 2)  # 10 s after the first batch
    assert [t for t in told if t] == [(4, 9)]


@pytest.mark.parametrize("clears", ["ours busy", "nobody spends"])
def test_an_episode_ends_when_a_container_is_seen_busy_or_none_spends(clears):
    watch = StrangerWatch(hold_s=2.0)
    assert watch.observe("g", 0, ["c"], False, [7]) == ()
    assert watch.observe("g", 2 * S, ["c"], False, [7]) == (7,)
    ended = (["c"], True, [7]) if clears == "ours busy" else ([], False, [7])
    assert watch.observe("g", 3 * S, *ended) == ()
    # a new episode: told again, only once it has lasted the hold in turn
    assert watch.observe("g", 4 * S, ["c"], False, [8]) == ()
    assert watch.observe("g", 5 * S, ["c"], False, [8]) == ()
    assert watch.observe("g", 6 * S, ["c"], False, [8]) == (8,)


def test_a_batch_where_nobody_is_busy_neither_ends_nor_grows_an_episode():
    watch = StrangerWatch(hold_s=2.0)
    watch.observe("g", 0, ["c"], False, [7])
    assert watch.observe("g", 1 * S, ["c"], False, []) == ()  # listed idle: says nothing
    assert watch.observe("g", 2 * S, ["c"], False, [7]) == (7,)  # the episode went on


def test_gpus_are_watched_apart_and_one_gone_is_forgotten():
    watch = StrangerWatch(hold_s=1.0)
    watch.observe("a", 0, ["c"], False, [1])
    watch.observe("b", 0, ["c"], True, [2])  # b's containers are seen: no episode
    assert watch.observe("a", S, ["c"], False, [1]) == (1,)
    assert watch.observe("b", S, ["c"], True, [2]) == ()
    watch.forget("a")
    assert watch.observe("a", 2 * S, ["c"], False, [1]) == ()  # begins afresh
    assert watch.observe("a", 3 * S, ["c"], False, [1]) == (1,)


@pytest.mark.parametrize("hold", [0.0, -1.0, 3600.0, float("nan")])
def test_a_hold_out_of_range_is_refused_by_name(hold):
    with pytest.raises(ValueError, match="strangers-only hold must be in"):
        StrangerWatch(hold_s=hold)


def test_only_the_containers_that_spent_in_a_told_episode_are_unmeasured():
    watch = StrangerWatch(hold_s=2.0)
    watch.observe("g", 0, ["claims"], False, [7])
    assert watch.unmeasured("g") == frozenset()  # not yet told
    watch.observe("g", 1 * S, ["claims"], False, [])  # nobody busy: spending still counts
    watch.observe("g", 2 * S, ["claims", "late"], False, [7])
    assert watch.unmeasured("g") == {"claims", "late"}  # never the idle neighbour
    assert watch.unmeasured("other") == frozenset()
    watch.observe("g", 3 * S, ["claims"], True, [7])  # a container seen busy: it ends
    assert watch.unmeasured("g") == frozenset()
    watch.observe("g", 4 * S, ["late"], False, [7])
    watch.observe("g", 6 * S, ["late"], False, [7])
    assert watch.unmeasured("g") == {"late"}  # a new episode remembers none of the last


_batch = st.tuples(
    st.integers(min_value=1, max_value=3 * S),  # time since the batch before
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),  # containers that spent
    st.booleans(),  # one of their processes sampled busy
    st.lists(st.integers(min_value=1, max_value=5), max_size=2),  # strangers sampled busy
)


@given(st.lists(_batch, max_size=60))
def test_on_any_batches_each_episode_is_told_once_and_only_its_spenders_are_unmeasured(batches):
    # A model of the rule, kept apart from the code: an episode starts at the first batch with
    # spending, none of ours busy and strangers busy; any batch with nobody spending or one of
    # ours busy ends it; it is told once, at the first batch it has lasted the hold.
    watch = StrangerWatch(hold_s=2.0)
    now, since, told, spenders = 0, None, False, set()
    for gap, spent, ours_busy, strangers in batches:
        now += gap
        said = watch.observe("g", now, spent, ours_busy, strangers)
        if not spent or ours_busy:
            since, told, spenders = None, False, set()
            expected = ()
        elif not strangers:
            if since is not None:
                spenders |= set(spent)
            expected = ()
        else:
            if since is None:
                since = now
            spenders |= set(spent)
            expected = ()
            if not told and now - since >= 2 * S:
                told, expected = True, tuple(sorted(strangers))
        assert said == expected
        assert watch.reported == (frozenset({"g"}) if told else frozenset())
        assert watch.unmeasured("g") == (frozenset(spenders) if told else frozenset())
        # another GPU is never touched
        assert watch.unmeasured("other") == frozenset()

"""Binding regions to containers and choosing what to collect (`plan_regions`, pure)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.shm.regions import RegionFacts, plan_regions

S = 1_000_000_000
GRACE = 30 * S
A = ("default", "train-a", "main")
B = ("default", "train-b", "main")
C = ("team", "infer", "server")


def facts(seq: int, ids: tuple[str, ...], created_s: float = 0.0) -> RegionFacts:
    return RegionFacts(f"{seq:012d}-00000000", seq, frozenset(ids), round(created_s * S))


def rid(seq: int) -> str:
    return f"{seq:012d}-00000000"


def plan(regions, assignments, *, bound=None, unheld=None, now_s=100.0, grace=GRACE):
    return plan_regions(regions, assignments, bound or {}, unheld or {}, round(now_s * S), grace)


def test_region_binds_to_the_container_holding_exactly_its_ids() -> None:
    regions = [facts(1, ("g0::0", "g0::1")), facts(2, ("g1::0",))]
    result = plan(regions, {"g0::0": A, "g0::1": A, "g1::0": B})
    assert result.bound == {rid(1): A, rid(2): B}
    assert result.remove == {}
    assert result.unheld_since == {}


def test_container_holding_more_ids_than_the_region_does_not_own_it() -> None:
    # An old one-slice region must not be taken for a newer container's two-slice allocation.
    old = facts(1, ("g0::0",))
    result = plan([old], {"g0::0": A, "g0::1": A}, now_s=100)
    assert rid(1) not in result.bound
    assert result.unheld_since == {rid(1): 100 * S}


def test_ids_split_between_two_containers_bind_to_neither() -> None:
    result = plan([facts(1, ("g0::0", "g0::1"))], {"g0::0": A, "g0::1": B})
    assert result.bound == {}
    assert rid(1) in result.unheld_since


def test_unheld_region_is_removed_only_after_the_grace_period() -> None:
    regions = [facts(1, ("g0::0",), created_s=0)]
    first = plan(regions, {}, bound={rid(1): A}, now_s=100)
    assert first.remove == {} and first.unheld_since == {rid(1): 100 * S}
    assert first.bound == {rid(1): A}  # last known labels stay while it waits
    almost = plan(regions, {}, bound=first.bound, unheld=first.unheld_since, now_s=129.9)
    assert almost.remove == {}
    gone = plan(regions, {}, bound=almost.bound, unheld=almost.unheld_since, now_s=130)
    assert gone.remove == {rid(1): "no container holds its device IDs"}
    assert gone.bound == {} and gone.unheld_since == {}


def test_held_again_resets_the_grace_timer() -> None:
    regions = [facts(1, ("g0::0",))]
    first = plan(regions, {}, now_s=100)
    again = plan(regions, {"g0::0": A}, unheld=first.unheld_since, now_s=110)
    assert again.unheld_since == {} and again.bound == {rid(1): A}
    lost = plan(regions, {}, bound=again.bound, unheld=again.unheld_since, now_s=135)
    assert lost.remove == {} and lost.unheld_since == {rid(1): 135 * S}


def test_young_region_is_never_removed_even_when_unheld_long_enough() -> None:
    # PodResources lags Allocate: a region created 10 s ago is kept whatever the timer says.
    regions = [facts(1, ("g0::0",), created_s=90)]
    result = plan(regions, {}, unheld={rid(1): 0}, now_s=100)
    assert result.remove == {}
    later = plan(regions, {}, unheld=result.unheld_since, now_s=120)
    assert later.remove == {rid(1): "no container holds its device IDs"}


def test_creation_time_after_now_counts_as_old() -> None:
    # CLOCK_MONOTONIC restarts at boot: a region from before a reboot looks created in the future.
    regions = [facts(1, ("g0::0",), created_s=10_000)]
    result = plan(regions, {}, unheld={rid(1): 0}, now_s=100)
    assert result.remove == {rid(1): "no container holds its device IDs"}


def test_reused_ids_belong_to_the_newest_region_and_older_ones_are_garbage() -> None:
    old = facts(1, ("g0::0",), created_s=0)
    new = facts(5, ("g0::0",), created_s=95)
    result = plan([old, new], {"g0::0": B}, bound={rid(1): A}, now_s=100)
    assert result.bound[rid(5)] == B
    assert result.remove == {rid(1): "superseded by a newer region of the same device IDs"}
    assert rid(1) not in result.bound


def test_young_superseded_region_waits_until_it_is_old_enough() -> None:
    old = facts(1, ("g0::0",), created_s=90)
    new = facts(2, ("g0::0",), created_s=95)
    result = plan([old, new], {"g0::0": B}, now_s=100)
    assert result.remove == {} and rid(1) in result.unheld_since
    later = plan([old, new], {"g0::0": B}, bound=result.bound, unheld=result.unheld_since,
                 now_s=120)
    assert rid(1) in later.remove and later.bound[rid(2)] == B


def test_pod_recreated_under_the_same_name_gets_the_new_region() -> None:
    # A StatefulSet pod comes back as the same namespace/pod/container with the same IDs.
    old = facts(1, ("g0::0",), created_s=0)
    new = facts(2, ("g0::0",), created_s=80)
    result = plan([old, new], {"g0::0": A}, bound={rid(1): A}, now_s=100)
    assert result.bound[rid(2)] == A
    assert rid(1) in result.remove


def test_region_created_before_its_container_is_listed_is_not_taken_by_the_old_holder() -> None:
    # The List answer predates B's Allocate: A still shows as holder. The new region is the
    # newest for those IDs, so it is bound (briefly with A's labels) and A's old one is garbage;
    # the next answer, with B, relabels it. Nothing B uses is ever removed.
    old = facts(1, ("g0::0",), created_s=0)
    new = facts(2, ("g0::0",), created_s=99)
    stale = plan([old, new], {"g0::0": A}, bound={rid(1): A}, now_s=100)
    assert rid(2) not in stale.remove and stale.bound[rid(2)] == A
    fresh = plan([new], {"g0::0": B}, bound=stale.bound, unheld=stale.unheld_since, now_s=105)
    assert fresh.bound == {rid(2): B} and fresh.remove == {}


def test_zero_grace_removes_unheld_regions_at_once() -> None:
    result = plan([facts(1, ("g0::0",), created_s=100)], {}, now_s=100, grace=0)
    assert rid(1) in result.remove


def test_region_without_device_ids_is_never_bound() -> None:
    result = plan([facts(1, ())], {"g0::0": A}, unheld={rid(1): 0}, now_s=100)
    assert result.bound == {} and rid(1) in result.remove


_ids = st.sampled_from([f"g{g}::{n}" for g in range(2) for n in range(3)])
_containers = st.sampled_from([A, B, C])


@settings(max_examples=120, deadline=None)
@given(
    regions=st.lists(
        st.tuples(st.frozensets(_ids, min_size=1, max_size=3), st.integers(0, 200)),
        max_size=8,
    ),
    assignments=st.dictionaries(_ids, _containers),
    now_s=st.integers(0, 300),
    grace_s=st.integers(0, 60),
)
def test_invariants(regions, assignments, now_s, grace_s) -> None:
    all_facts = [
        RegionFacts(rid(i + 1), i + 1, ids, created * S) for i, (ids, created) in enumerate(regions)
    ]
    result = plan_regions(all_facts, assignments, {}, {}, now_s * S, grace_s * S)
    held: dict[tuple[str, str, str], set[str]] = {}
    for device_id, ref in assignments.items():
        held.setdefault(ref, set()).add(device_id)
    for f in all_facts:
        if f.alloc_id in result.remove:
            # never removed while younger than the grace period
            assert f.created_ns > now_s * S or now_s * S - f.created_ns >= grace_s * S
        owners = [ref for ref, ids in held.items() if ids == set(f.device_ids)]
        newest = max(
            (g.seq for g in all_facts if g.device_ids == f.device_ids), default=f.seq
        )
        if owners and f.seq == newest:
            # the newest region of a container's exact IDs is its own and is never removed
            assert result.bound.get(f.alloc_id) == owners[0]
            assert f.alloc_id not in result.remove
    # each container owns at most one region
    owned = [ref for alloc_id, ref in result.bound.items() if alloc_id not in result.unheld_since]
    assert len(owned) == len(set(owned))

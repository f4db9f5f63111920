"""A region is collected only on positive evidence from PodResources, never on an empty answer.

A kubelet that restarts (or answers empty for a while) lists no pods at all; collecting on that
would delete the regions of containers that are still running, and they would lose steering and
metrics for good. Real Allocates through the kubelet stand-in, a hand-driven clock.
"""

from __future__ import annotations

from tests.integration.test_regions_lifecycle import GPUS, node


async def test_empty_answers_after_a_full_one_never_collect_running_containers() -> None:
    async with node(grace_s=30) as n:
        await n.admit("train")
        await n.admit("serve")
        assert await n.sync() == {}
        regions = n.store.regions()
        assert len(regions) == 2

        n.kubelet.pod_resources_empty = True  # the kubelet restarts and answers empty
        for _ in range(10):
            n.clock.advance(60)
            assert await n.sync() == {}
        assert n.store.regions() == regions
        assert all(r.path.exists() and not r.closed for r in regions)
        assert n.store.counters.gc_postponed == 10
        assert n.store.counters.removed == 0
        # labels are kept for the metrics while the answers say nothing
        assert n.store.identity(regions[0].alloc_id) == ("default", "train", "main")

        n.kubelet.pod_resources_empty = False  # back, and both containers are still there
        n.clock.advance(60)
        assert await n.sync() == {}
        assert n.store.regions() == regions


async def test_the_grace_restarts_after_an_empty_answer() -> None:
    async with node(grace_s=30) as n:
        await n.admit("keeper")
        await n.admit("done")
        await n.sync()
        keeper, done = n.store.regions()
        n.kubelet.remove_pod("default", "done")

        n.clock.advance(1)
        assert await n.sync() == {}  # unheld from now, the keeper still listed
        n.clock.advance(20)
        n.kubelet.pod_resources_empty = True
        assert await n.sync() == {}  # no evidence: the 20 s so far do not count
        n.kubelet.pod_resources_empty = False
        n.clock.advance(20)
        assert await n.sync() == {}  # 41 s since first unheld, but the grace began again
        n.clock.advance(29)
        assert await n.sync() == {}
        n.clock.advance(1)
        assert await n.sync() == {done.alloc_id: "no container holds its device IDs"}
        assert [r.alloc_id for r in n.store.regions()] == [keeper.alloc_id]
        assert n.store.counters.gc_postponed == 1


async def test_an_empty_answer_on_a_fresh_start_collects_nothing() -> None:
    async with node(grace_s=1) as n:
        await n.kubelet.allocate("nvidia.com/gpu", [f"{GPUS[0].uuid}::1"])
        n.kubelet.pod_resources_empty = True
        n.clock.advance(3600)
        assert await n.sync() == {}
        assert len(n.store.regions()) == 1
        assert n.store.counters.gc_postponed == 1


async def test_ids_listed_for_another_container_are_evidence_even_alone() -> None:
    async with node(grace_s=30) as n:
        first = await n.admit("old")
        await n.sync()
        (old_region,) = n.store.regions()
        n.kubelet.remove_pod("default", "old")
        await n.admit_ids("new", list(first.device_ids))
        n.clock.advance(31)
        # the only container listed holds the old region's IDs through a newer region
        removed = await n.sync()
        assert removed == {
            old_region.alloc_id: "superseded by a newer region of the same device IDs"
        }
        assert n.store.counters.gc_postponed == 0

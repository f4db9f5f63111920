"""A container over its limits becomes a Warning Event on its pod, and with `evict` an eviction
through the policy/v1 Eviction API, bound to the pod's UID; API failures are retried."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from tests.fakes.kubeapi import wired
from vgpu_agent.kube.events import PodRef, eviction, pod_event


def test_pod_event_and_eviction_bodies() -> None:
    pod = PodRef("team-a", "train-0", "uid-9")
    now = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
    body = pod_event(pod, "main", "VgpuLimitExceeded", "x" * 3000, "node-1", now, 3)
    assert body["metadata"]["namespace"] == "team-a"  # events live with the object
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a",
                                      "name": "train-0", "uid": "uid-9",
                                      "fieldPath": "spec.containers{main}"}
    assert body["type"] == "Warning" and len(body["message"]) == 1024
    assert eviction(pod)["deleteOptions"] == {"preconditions": {"uid": "uid-9"}}
    with pytest.raises(ValueError, match="time zone"):
        pod_event(pod, "main", "r", "m", "n", dt.datetime(2026, 1, 1), 0)


async def test_a_breach_is_reported_on_the_pod_and_the_pod_is_left_running(tmp_path: Path):
    async with wired(tmp_path) as w:
        pod = w.api.add_pod("team-a", "train-0")
        w.node.on_container_breach("team-a", "train-0", "main", "GPU memory in use 6144 MiB")
        await w.api.wait_for(lambda: len(w.api.events.get("team-a", {})) == 1)
        (event,) = w.api.events["team-a"].values()
        assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]
        assert event["reason"] == "VgpuLimitExceeded" and "6144 MiB" in event["message"]
        assert w.api.evicted == [] and ("team-a", "train-0") in w.api.pods


async def test_with_evict_the_pod_is_evicted_once_and_says_why(tmp_path: Path):
    async with wired(tmp_path) as w:
        pod = w.api.add_pod("team-a", "train-0")
        w.api.fail(503, times=2, method="POST", path=".*/eviction$")  # retried with backoff
        w.node.on_container_breach("team-a", "train-0", "main", "SM share 90%", evict=True)
        await w.api.wait_for(lambda: len(w.api.events.get("team-a", {})) == 2)
        assert w.api.evicted == [("team-a", "train-0", pod["metadata"]["uid"])]
        reasons = sorted(e["reason"] for e in w.api.events["team-a"].values())
        assert reasons == ["VgpuEvicted", "VgpuLimitExceeded"]
        assert w.node.evictions == 1


async def test_a_pod_gone_or_replaced_is_not_evicted(tmp_path: Path):
    async with wired(tmp_path) as w:
        w.node.on_container_breach("team-a", "gone", "main", "over", evict=True)
        replaced = w.api.add_pod("team-a", "train-0")

        def recreate() -> None:  # the pod is recreated under its name after it was read
            w.api.pods.pop(("team-a", "train-0"))
            w.api.add_pod("team-a", "train-0")

        w.api.after("POST", recreate, path=".*/events$")
        w.node.on_container_breach("team-a", "train-0", "main", "over", evict=True)
        await w.api.wait_for(lambda: any(r.status == 409 for r in w.api.requests
                                         if r.path.endswith("/eviction")))
        assert w.api.evicted == []
        assert ("team-a", "train-0") in w.api.pods
        assert w.api.pods[("team-a", "train-0")]["metadata"]["uid"] != replaced["metadata"]["uid"]
        assert w.node.evictions == 0

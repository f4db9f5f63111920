"""A container over its limits becomes a Warning Event on its pod, and with `evict` an eviction
through the policy/v1 Eviction API, bound to the pod's UID; API failures are retried."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from tests.fakes.kubeapi import wired
from vgpu_agent.kube.events import REASON_BACKSTOP, PodRef, eviction, pod_event


def test_pod_event_and_eviction_bodies() -> None:
    pod = PodRef("team-a", "train-0", "uid-9")
    now = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.UTC)
    body = pod_event(pod, REASON_BACKSTOP, "x" * 3000, "node-1", now, 3, container="main")
    assert body["metadata"]["namespace"] == "team-a"  # events live with the object
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a",
                                      "name": "train-0", "uid": "uid-9",
                                      "fieldPath": "spec.containers{main}"}
    assert body["type"] == "Warning" and len(body["message"]) == 1024
    assert "fieldPath" not in pod_event(pod, "r", "m", "n", now, 0)["involvedObject"]
    assert eviction(pod)["deleteOptions"] == {"preconditions": {"uid": "uid-9"}}


async def test_a_breach_is_reported_on_the_pod_and_the_pod_is_left_running(tmp_path: Path):
    async with wired(tmp_path) as w:
        uid = w.api.add_pod("train-0", "team-a")["metadata"]["uid"]
        w.node.on_container_breach("team-a", "train-0", uid, "main", "GPU memory in use 6144 MiB")
        await w.api.wait_for(lambda: len(w.api.events.get("team-a", {})) == 1)
        (event,) = w.api.events["team-a"].values()
        assert event["involvedObject"]["uid"] == uid
        assert event["reason"] == "VgpuLimitExceeded" and "6144 MiB" in event["message"]
        assert w.api.evicted == [] and w.api.find_pod("train-0", "team-a")


async def test_with_evict_the_pod_is_evicted_once_and_says_why(tmp_path: Path):
    async with wired(tmp_path) as w:
        uid = w.api.add_pod("train-0", "team-a")["metadata"]["uid"]
        w.api.fail(503, times=2, method="POST", path=".*/eviction$")  # retried with backoff
        w.node.on_container_breach("team-a", "train-0", uid, "main", "SM share 90%", evict=True)
        await w.api.wait_for(lambda: len(w.api.events.get("team-a", {})) == 2)
        assert w.api.evicted == [("team-a", "train-0", uid)]
        reasons = sorted(e["reason"] for e in w.api.events["team-a"].values())
        assert reasons == ["VgpuEvicted", "VgpuLimitExceeded"]
        assert w.node.evictions == 1


async def test_a_pod_gone_or_recreated_under_its_name_is_not_evicted(tmp_path: Path):
    async with wired(tmp_path) as w:
        w.node.on_container_breach("team-a", "gone", "uid-gone", "main", "over", evict=True)
        old = w.api.add_pod("train-0", "team-a")["metadata"]["uid"]
        w.api.delete_pod("train-0", "team-a")  # replaced before the notice is sent
        new = w.api.add_pod("train-0", "team-a")["metadata"]["uid"]
        w.node.on_container_breach("team-a", "train-0", old, "main", "over", evict=True)
        await w.api.wait_for(lambda: any(r.status == 409 for r in w.api.requests
                                         if r.path.endswith("/eviction")))
        assert w.api.evicted == []
        assert w.api.find_pod("train-0", "team-a")["metadata"]["uid"] == new
        assert w.node.evictions == 0

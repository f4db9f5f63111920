"""The pod cache behind the watch: keyed by UID, fed by watch events, refusals once per pod."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from vgpu_agent.kube.pods import NodePods, _Expired, _Malformed
from vgpu_agent.throttle.podpolicy import Refusal

NODE = "node-1"


async def no_api() -> None:
    return None


def pod(name: str, uid: str, node: str = NODE, annotations: dict | None = None) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "7",
                     "annotations": dict(annotations or {})},
        "spec": {"nodeName": node},
    }


def test_added_modified_deleted_and_a_name_reused_by_another_pod():
    changes = []
    pods = NodePods(NODE, no_api, on_change=lambda: changes.append(1))
    pods._on_watch_event({"type": "ADDED", "object": pod("a", "u1", annotations={"vgpu.io/priority": "5"})}, "1")
    assert pods.pod("ns", "a").annotations == {"vgpu.io/priority": "5"}
    pods._on_watch_event({"type": "MODIFIED", "object": pod("a", "u1", annotations={"vgpu.io/priority": "5"})}, "2")
    assert len(changes) == 1  # nothing that matters changed: no wake-up
    # deleted and re-created under the same name; the DELETED event was missed
    pods._on_watch_event({"type": "ADDED", "object": pod("a", "u2")}, "3")
    assert pods.pod("ns", "a").uid == "u2" and pods.pod("ns", "a").annotations == {}
    assert len(pods) == 1
    pods._on_watch_event({"type": "DELETED", "object": pod("a", "u2")}, "4")
    assert pods.pod("ns", "a") is None and len(changes) == 3


def test_only_the_annotations_read_are_kept():
    pods = NodePods(NODE, no_api)
    obj = pod("a", "u1", annotations={"vgpu.io/core-policy": "strict"})
    obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "x" * 9999
    pods._on_watch_event({"type": "ADDED", "object": obj}, "1")
    assert pods.pod("ns", "a").annotations == {"vgpu.io/core-policy": "strict"}


def test_a_pod_reported_for_another_node_is_dropped():
    pods = NodePods(NODE, no_api)
    pods._on_watch_event({"type": "ADDED", "object": pod("a", "u1")}, "1")
    pods._on_watch_event({"type": "MODIFIED", "object": pod("a", "u1", node="node-2")}, "2")
    assert pods.pod("ns", "a") is None


@pytest.mark.parametrize(
    "obj",
    [
        {"metadata": {"name": "a", "namespace": "ns"}},  # no uid
        {"metadata": "x"},
        {"metadata": {"name": "a", "namespace": "ns", "uid": "u", "annotations": ["x"]}},
        {"metadata": {"name": "a", "namespace": "ns", "uid": "u"}, "spec": "x"},
    ],
)
def test_objects_without_identity_are_ignored_and_odd_annotations_are_none(obj):
    pods = NodePods(NODE, no_api)
    obj.setdefault("spec", {"nodeName": NODE})
    assert pods._on_watch_event({"type": "ADDED", "object": obj}, "5") in ("5",)
    found = pods.pod("ns", "a")
    assert found is None or found.annotations == {}


def test_watch_errors_and_garbage():
    pods = NodePods(NODE, no_api)
    with pytest.raises(_Expired):
        pods._on_watch_event({"type": "ERROR", "object": {"code": 410}}, "1")
    with pytest.raises(_Malformed):
        pods._on_watch_event({"type": "ADDED", "object": None}, "1")
    with pytest.raises(_Malformed):
        pods._on_watch_event(["not", "an", "event"], "1")
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "99"}}}
    assert pods._on_watch_event(bookmark, "1") == "99"


def test_a_refusal_is_queued_once_per_pod_and_forgotten_with_the_pod():
    pods = NodePods(NODE, no_api)
    pods._on_watch_event({"type": "ADDED", "object": pod("a", "u1")}, "1")
    info = pods.pod("ns", "a")
    refusal = Refusal("vgpu.io/priority", "99", "up to 50", "priority 0")
    with capture_logs() as logs:
        for _ in range(3):
            pods.report_refusal(info, refusal)
        pods.report_refusal(info, Refusal("vgpu.io/priority", "98", "up to 50", "priority 0"))
    assert pods.queued_events == 2
    assert [e["event"] for e in logs] == ["pod_annotation_refused"] * 2
    pods._on_watch_event({"type": "DELETED", "object": pod("a", "u1")}, "2")
    assert "u1" not in pods._reported


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="node_name"):
        NodePods("", no_api)
    with pytest.raises(ValueError, match="watch timeout"):
        NodePods(NODE, no_api, watch_timeout_s=0)
    with pytest.raises(ValueError, match="token bucket"):
        NodePods(NODE, no_api, events_per_second=0)

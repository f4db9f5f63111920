"""Pods choose their region's core policy and priority by annotation, read through the fake API.

The real pieces run together: `NodePods` lists and watches the fake API server's pods (field
selector on this node), `RegionPolicies` writes what `podpolicy.resolve` decides into the real
region files of a `RegionStore`, bound to containers as PodResources would bind them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config

from tests.fakes.kubeapi import NODE, FakeKubeAPI
from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.kube.node import NodeIntegration
from vgpu_agent.kube.pods import NodePods
from vgpu_agent.kubelet.podresources import ContainerRef
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, RegionStore
from vgpu_agent.throttle.podpolicy import PodPolicyRules
from vgpu_agent.throttle.regionpolicy import RegionPolicies

UUID = "GPU-11111111-2222-3333-4444-555555555555"
RULES = PodPolicyRules(
    default_policy="strict",
    allowed_policies=frozenset({"strict", "work-conserving"}),
    priority_max=50,
    priority_namespaces=frozenset({"inference"}),
)
POLICY = "vgpu.io/core-policy"
PRIORITY = "vgpu.io/priority"


def one_slice(n: int) -> Grant:
    return Grant((f"{UUID}::{n}",), (GrantedDevice(UUID, 0, 1, 1 << 30, 25.0),))


@dataclass
class Setup:
    api: FakeKubeAPI
    pods: NodePods
    store: RegionStore
    policies: RegionPolicies
    changes: asyncio.Event

    def control(self, region: Region) -> layout.Control:
        return layout.decode_control((region.path / "control").read_bytes())

    async def bind(self, bindings: dict[Region, tuple[str, str, str]]) -> None:
        await self.store.reconcile(
            {r.device_ids[0]: ContainerRef(*key) for r, key in bindings.items()}
        )
        self.policies.apply()

    async def settle(self, predicate: Any, within: float = 5.0) -> None:
        """Wait until the pod cache satisfies `predicate`, then apply the policies."""
        async with asyncio.timeout(within):
            while not predicate():
                self.changes.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changes.wait(), 0.05)
        self.policies.apply()


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **options: Any) -> AsyncIterator[Setup]:
    api = FakeKubeAPI()
    await api.start()
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=configuration,
    )
    changes = asyncio.Event()

    async def source() -> client.Configuration:
        return configuration

    pods = NodePods(
        NODE,
        source,
        on_change=changes.set,
        request_timeout=0.5,
        backoff_initial=0.02,
        backoff_cap=0.1,
        **options,
    )
    store = RegionStore(tmp_path / "state", default_policy="strict", gc_grace_s=3600)
    policies = RegionPolicies(
        store.regions, store.identity, RULES, pods=pods, on_refusal=pods.report_refusal
    )
    task = asyncio.create_task(pods.run())
    try:
        yield Setup(api, pods, store, policies, changes)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        store.close()
        await api.stop()


def pod_events(api: FakeKubeAPI) -> list[dict[str, Any]]:
    return [e for e in api.all_events() if e["involvedObject"]["kind"] == "Pod"]


async def test_annotations_apply_once_the_region_is_bound_to_its_pod(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.add_pod("llm", "inference", annotations={POLICY: "strict", PRIORITY: "40"})
        s.api.add_pod("train", "batch", annotations={POLICY: "work-conserving"})
        s.api.add_pod("other-node-pod", "batch", node="gpu-node-2",
                      annotations={POLICY: "work-conserving"})
        llm, train = s.store.create(one_slice(0)), s.store.create(one_slice(1))
        await s.settle(lambda: len(s.pods) == 2)  # the other node's pod is not listed
        assert s.pods.pod("batch", "other-node-pod") is None

        # Not bound yet: the node default, and the region says so.
        for region in (llm, train):
            assert s.control(region).devices[0].policy == layout.POLICY_STRICT
            assert s.policies.source(region.alloc_id) == "default"

        await s.bind({llm: ("inference", "llm", "main"), train: ("batch", "train", "main")})
        assert s.control(llm).priority == 40
        assert s.control(llm).devices[0].policy == layout.POLICY_STRICT
        assert s.control(train).devices[0].policy == layout.POLICY_WORK_CONSERVING
        assert s.control(train).priority == 0
        # what the controller reads
        assert (llm.priority, train.policy(0)) == (40, "work-conserving")
        assert s.policies.source(llm.alloc_id) == s.policies.source(train.alloc_id) == "pod"
        assert s.control(llm).generation % 2 == 0  # the update was framed and closed
        assert not pod_events(s.api)

        # Only the node's pods were asked for, and with a watch after the list.
        await s.settle(lambda: s.pods.watches >= 1)
        pod_calls = [r for r in s.api.requests if r.path == "/api/v1/pods"]
        assert all("fieldSelector=spec.nodeName%3Dgpu-node-1" in r.query for r in pod_calls)
        assert "watch=true" in pod_calls[-1].query.lower() and "watch" not in pod_calls[0].query


async def test_changed_annotations_apply_on_the_next_refresh(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.add_pod("job", "batch", annotations={POLICY: "strict"})
        region = s.store.create(one_slice(0))
        await s.settle(lambda: s.pods.pod("batch", "job") is not None)
        await s.bind({region: ("batch", "job", "main")})
        assert s.control(region).devices[0].policy == layout.POLICY_STRICT
        lists_before = s.pods.lists

        s.api.set_pod_annotations("job", "batch", {POLICY: "work-conserving", PRIORITY: "-10"})
        await s.settle(lambda: s.pods.pod("batch", "job").annotations.get(PRIORITY) == "-10")
        assert s.control(region).devices[0].policy == layout.POLICY_WORK_CONSERVING
        assert s.control(region).priority == -10
        assert s.pods.lists == lists_before  # the change came through the watch, not a new list

        s.api.set_pod_annotations("job", "batch", {POLICY: None, PRIORITY: None})
        await s.settle(lambda: not s.pods.pod("batch", "job").annotations)
        assert s.control(region).devices[0].policy == layout.POLICY_STRICT
        assert s.control(region).priority == 0
        assert s.policies.source(region.alloc_id) == "default"


async def test_refused_annotations_give_one_event_each_and_the_default(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        pod = s.api.add_pod(
            "greedy", "team-a", annotations={POLICY: "off", PRIORITY: "99"}, containers=("a", "b")
        )
        a, b = s.store.create(one_slice(0)), s.store.create(one_slice(1))
        await s.settle(lambda: len(s.pods) == 1)
        await s.bind({a: ("team-a", "greedy", "a"), b: ("team-a", "greedy", "b")})
        for _ in range(3):  # every PodResources refresh resolves again
            s.policies.apply()
        await s.api.wait_for(lambda: len(pod_events(s.api)) == 2)
        await asyncio.sleep(0.2)  # nothing more follows
        events = pod_events(s.api)
        assert len(events) == 2
        by_annotation = {e["message"].split("=")[0].split()[-1]: e for e in events}
        assert set(by_annotation) == {POLICY, PRIORITY}
        assert "this node lets pods choose strict, work-conserving" in by_annotation[POLICY][
            "message"]
        assert "up to 50" in by_annotation[PRIORITY]["message"]
        for event in events:
            assert event["metadata"]["namespace"] == "team-a"
            assert event["involvedObject"] == {
                "apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": "greedy",
                "uid": pod["metadata"]["uid"],
            }
            assert event["type"] == "Warning" and event["reason"] == "VgpuAnnotationRefused"
        for region in (a, b):
            assert s.control(region).devices[0].policy == layout.POLICY_STRICT
            assert s.control(region).priority == 0
            assert s.policies.source(region.alloc_id) == "default"

        # A different refused value is a distinct refusal: one more event.
        s.api.set_pod_annotations("greedy", "team-a", {PRIORITY: "7"})
        await s.settle(lambda: s.pods.pod("team-a", "greedy").annotations[PRIORITY] == "7")
        await s.api.wait_for(lambda: len(pod_events(s.api)) == 3)
        assert any(
            "allowed only in inference (not 'team-a')" in e["message"] for e in pod_events(s.api)
        )


async def test_the_api_down_keeps_the_last_known_policy(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.add_pod("llm", "inference", annotations={PRIORITY: "30"})
        region = s.store.create(one_slice(0))
        await s.settle(lambda: len(s.pods) == 1)
        await s.bind({region: ("inference", "llm", "main")})
        assert s.control(region).priority == 30

        await s.api.stop()
        await asyncio.sleep(0.3)  # the watch fails and retries
        assert not s.pods.connected
        s.policies.apply()
        assert s.control(region).priority == 30
        assert s.policies.source(region.alloc_id) == "pod"

        # Changed while the agent could not see: picked up when the API is back.
        s.api.set_pod_annotations("llm", "inference", {PRIORITY: "20"})
        await s.api.start()
        await s.settle(lambda: s.pods.pod("inference", "llm").annotations[PRIORITY] == "20")
        assert s.control(region).priority == 20


async def test_until_the_api_answers_the_node_default_applies(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.fail(503, times=1000, path="^/api/v1/pods$")
        s.api.add_pod("llm", "inference", annotations={PRIORITY: "30", POLICY: "work-conserving"})
        region = s.store.create(one_slice(0))
        await s.bind({region: ("inference", "llm", "main")})
        await asyncio.sleep(0.2)
        s.policies.apply()
        assert not s.pods.synced
        assert s.control(region).priority == 0
        assert s.control(region).devices[0].policy == layout.POLICY_STRICT
        assert s.policies.source(region.alloc_id) == "default"

        s.api.clear_faults()  # the API answers: the pod's choice applies
        await s.settle(lambda: s.pods.synced)
        assert s.control(region).priority == 30
        assert s.control(region).devices[0].policy == layout.POLICY_WORK_CONSERVING
        assert s.policies.source(region.alloc_id) == "pod"


async def test_a_pod_recreated_under_the_same_name_does_not_inherit(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        first = s.api.add_pod("svc", "inference", annotations={PRIORITY: "30", POLICY: "off"})
        old = s.store.create(one_slice(0))
        await s.settle(lambda: len(s.pods) == 1)
        await s.bind({old: ("inference", "svc", "main")})
        await s.api.wait_for(lambda: len(pod_events(s.api)) == 1)  # `off` refused for the first

        s.api.delete_pod("svc", "inference")
        second = s.api.add_pod("svc", "inference", annotations={POLICY: "off"})
        await s.settle(
            lambda: (p := s.pods.pod("inference", "svc")) is not None
            and p.uid == second["metadata"]["uid"]
        )
        new = s.store.create(one_slice(1))  # the new pod's container gets a new allocation
        await s.bind({new: ("inference", "svc", "main")})
        assert s.control(new).priority == 0  # the first pod's priority is not carried over
        assert s.policies.source(new.alloc_id) == "default"
        # The same refusal on the new pod is the new pod's: it gets its own event.
        await s.api.wait_for(lambda: len(pod_events(s.api)) == 2)
        uids = [e["involvedObject"]["uid"] for e in pod_events(s.api)]
        assert sorted(uids) == sorted([first["metadata"]["uid"], second["metadata"]["uid"]])


async def test_an_expired_watch_lists_again_and_forgets_deleted_pods(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.add_pod("gone", "batch", annotations={PRIORITY: "-3"})
        s.api.add_pod("stays", "batch", annotations={PRIORITY: "-4"})
        await s.settle(lambda: len(s.pods) == 2)
        await s.api.stop()
        s.api.delete_pod("gone", "batch")
        s.api.compact_pod_history()  # the watch cannot resume from where it was
        s.api.set_pod_annotations("stays", "batch", {PRIORITY: "-5"})
        lists = s.pods.lists
        await s.api.start()
        await s.settle(lambda: s.pods.lists > lists and len(s.pods) == 1)
        assert s.pods.pod("batch", "gone") is None
        assert s.pods.pod("batch", "stays").annotations[PRIORITY] == "-5"


async def test_a_watch_ended_by_the_server_is_resumed_without_a_list(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        await s.settle(lambda: s.pods.watches >= 1)
        await s.api.end_pod_watches()
        await s.settle(lambda: s.pods.watches >= 2)
        s.api.add_pod("late", "batch", annotations={PRIORITY: "-1"})
        await s.settle(lambda: s.pods.pod("batch", "late") is not None)
        assert s.pods.lists == 1


async def test_events_forbidden_in_a_namespace_are_logged_once_and_not_retried(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as s:
        s.api.fail(403, times=1, method="POST", path="/namespaces/team-a/events")
        s.api.add_pod("p1", "team-a", annotations={POLICY: "bogus"})
        region = s.store.create(one_slice(0))
        await s.settle(lambda: len(s.pods) == 1)
        await s.bind({region: ("team-a", "p1", "main")})
        await s.api.wait_for(
            lambda: any(r.method == "POST" and r.status == 403 for r in s.api.requests)
        )
        await asyncio.sleep(0.2)
        posts = [r for r in s.api.requests if r.method == "POST"]
        assert len(posts) == 1 and not pod_events(s.api)
        assert s.pods.queued_events == 0


async def test_without_an_api_the_pod_watch_says_so_once_and_idles() -> None:
    from structlog.testing import capture_logs

    async def no_api() -> None:
        return None

    pods = NodePods(NODE, no_api)
    with capture_logs() as logs:
        task = asyncio.create_task(pods.run())
        await asyncio.sleep(0.1)
        assert not task.done()  # a supervisor sees no exit
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [e["event"] for e in logs] == ["pod_annotations_disabled"]
    assert pods.pod("default", "x") is None and not pods.synced


async def test_the_pod_watch_outlives_a_restart_of_the_node_integration(tmp_path: Path) -> None:
    """The pod watch takes the node integration's configuration, not its client: the node
    integration closes its client when its task ends, and the watch goes on."""
    api = FakeKubeAPI()
    await api.start()
    api.add_node(NODE)
    node = NodeIntegration(NODE, str(api.write_kubeconfig(tmp_path / "kubeconfig")),
                           namespace="vgpu-system", request_timeout=0.5)
    node_task = asyncio.create_task(node.run())
    pods = NodePods(NODE, node.api_configuration, request_timeout=0.5, backoff_initial=0.02,
                    backoff_cap=0.1)
    pod_task = asyncio.create_task(pods.run())
    try:
        async with asyncio.timeout(5):
            while pods.watches < 1:
                await asyncio.sleep(0.02)
        node_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await node_task
        node_task = asyncio.create_task(node.run())  # as its supervisor restarts it
        api.add_pod("later", "batch", annotations={PRIORITY: "-2"})
        async with asyncio.timeout(5):
            while pods.pod("batch", "later") is None:
                await asyncio.sleep(0.02)
        assert pods.lists == 1 and pods.connected  # the same watch saw it
    finally:
        for task in (pod_task, node_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await api.stop()


async def test_a_garbled_watch_line_lists_again_and_keeps_the_cache(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.api.add_pod("kept", "batch", annotations={PRIORITY: "-1"})
        await s.settle(lambda: s.pods.watches >= 1 and len(s.pods) == 1)
        s.api.garble_pod_watches(b'{"type": "MODIFIED", "object": \n')
        # resuming from the same version would replay the garbage: a new list goes past it
        await s.settle(lambda: s.pods.lists == 2 and s.pods.watches >= 2)
        assert s.pods.pod("batch", "kept") is not None
        s.api.add_pod("after", "batch")
        await s.settle(lambda: s.pods.pod("batch", "after") is not None)


async def test_bookmarks_let_a_watch_resume_past_a_compaction(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        await s.settle(lambda: s.pods.watches >= 1)
        s.api.add_pod("other", "batch", node="gpu-node-2")  # changes elsewhere move the version
        s.api.bookmark_pod_watches()
        await asyncio.sleep(0.1)  # the bookmark arrives
        s.api.compact_pod_history()
        await s.api.end_pod_watches()
        await s.settle(lambda: s.pods.watches >= 2)
        await asyncio.sleep(0.1)
        assert s.pods.lists == 1  # resumed from the bookmark's version: no 410, no new list

"""The fake API server's `resource.k8s.io/v1` kinds, driven through kubernetes_asyncio's
ResourceV1Api: the paths, content types and semantics a DRA driver relies on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.fakes.kubeapi import FakeKubeAPI
from tests.fakes.resourceapi import ApiError, parse_label_selector

DRIVER = "gpu.vgpu.io"


def slice_body(name: str = "", node: str = "node-a", generation: int = 1, **extra: Any) -> dict:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"labels": {"app": "vgpu"}},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {"index": {"int": 0}, "productName": {"string": "A100"}},
                    "capacity": {
                        "memory": {
                            "value": "81920Mi",
                            "requestPolicy": {
                                "default": "20480Mi",
                                "validRange": {"min": "1Mi", "step": "1Mi"},
                            },
                        }
                    },
                    "allowMultipleAllocations": True,
                }
            ],
        },
    }
    if name:
        body["metadata"]["name"] = name
    else:
        body["metadata"]["generateName"] = f"{node}-gpu.vgpu.io-"
    body["spec"].update(extra)
    return body


class Api:
    def __init__(self, fake: FakeKubeAPI, api_client: client.ApiClient):
        self.fake = fake
        self.client = api_client
        self.v1 = client.ResourceV1Api(api_client)

    async def raw(self, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = await method(*args, _preload_content=False, **kwargs)
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status >= 300:
            error = ApiException(status=response.status, reason=response.reason)
            error.body = body.decode()
            raise error
        result: dict[str, Any] = json.loads(body)
        return result


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    fake = FakeKubeAPI()
    await fake.start()
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(fake.write_kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=configuration,
    )
    api_client = client.ApiClient(configuration=configuration)
    try:
        yield Api(fake, api_client)
    finally:
        await api_client.close()
        await fake.stop()


async def test_create_with_generate_name_then_get_and_list_by_node_and_driver(api: Api) -> None:
    created = await api.raw(api.v1.create_resource_slice, slice_body())
    name = created["metadata"]["name"]
    assert name.startswith("node-a-gpu.vgpu.io-") and len(name) == len("node-a-gpu.vgpu.io-") + 5
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]
    await api.raw(api.v1.create_resource_slice, slice_body(node="node-b"))
    other = slice_body(node="node-a")
    other["spec"]["driver"] = "other.example.com"
    await api.raw(api.v1.create_resource_slice, other)

    mine = await api.raw(
        api.v1.list_resource_slice,
        field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}",
    )
    assert [i["metadata"]["name"] for i in mine["items"]] == [name]
    assert "kind" not in mine["items"][0]  # list items carry no type, as on the real server
    assert mine["metadata"]["resourceVersion"]
    not_mine = await api.raw(api.v1.list_resource_slice, field_selector="spec.nodeName!=node-a")
    assert [i["spec"]["nodeName"] for i in not_mine["items"]] == ["node-b"]
    by_label = await api.raw(api.v1.list_resource_slice, label_selector="app in (vgpu,x),!gone")
    assert len(by_label["items"]) == 3
    assert (await api.raw(api.v1.list_resource_slice, label_selector="app=other"))["items"] == []
    got = await api.raw(api.v1.read_resource_slice, name)
    assert got["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"  # canonical
    assert got["kind"] == "ResourceSlice" and got["apiVersion"] == "resource.k8s.io/v1"


async def test_unsupported_field_selector_is_a_bad_request(api: Api) -> None:
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.list_resource_slice, field_selector="spec.pool.generation=1")
    assert caught.value.status == 400
    assert "spec.nodeName" in caught.value.body


async def test_generation_bumps_on_spec_changes_only_and_no_op_writes_bump_nothing(
    api: Api,
) -> None:
    created = await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    rv0 = created["metadata"]["resourceVersion"]
    same = await api.raw(api.v1.replace_resource_slice, "s1", created)
    assert same["metadata"]["resourceVersion"] == rv0  # nothing changed: no new version

    labelled = await api.raw(
        api.v1.patch_resource_slice, "s1", {"metadata": {"labels": {"extra": "yes"}}}
    )
    assert labelled["metadata"]["generation"] == 1
    assert int(labelled["metadata"]["resourceVersion"]) > int(rv0)
    assert api.fake.requests[-1].content_type == "application/strategic-merge-patch+json"

    labelled["spec"]["pool"]["generation"] = 2
    replaced = await api.raw(api.v1.replace_resource_slice, "s1", labelled)
    assert replaced["metadata"]["generation"] == 2
    assert replaced["spec"]["pool"]["generation"] == 2


async def test_stale_resource_version_is_a_conflict(api: Api) -> None:
    created = await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    api.fake.resources.edit(
        "resourceslices", "s1", lambda s: s["metadata"].setdefault("labels", {}).update(x="1")
    )
    created["spec"]["pool"]["generation"] = 5
    for call, args in (
        (api.v1.replace_resource_slice, ("s1", created)),
        (
            api.v1.patch_resource_slice,
            ("s1", {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}}),
        ),
        (
            api.v1.delete_resource_slice,
            ("s1",),
        ),
    ):
        kwargs = {}
        if call == api.v1.delete_resource_slice:
            kwargs["body"] = client.V1DeleteOptions(
                preconditions=client.V1Preconditions(
                    resource_version=created["metadata"]["resourceVersion"]
                )
            )
        with pytest.raises(ApiException) as caught:
            await api.raw(call, *args, **kwargs)
        assert caught.value.status == 409, call
    assert api.fake.resources.get("resourceslices", "s1")["spec"]["pool"]["generation"] == 1


async def test_missing_objects_are_not_found(api: Api) -> None:
    for call, args in (
        (api.v1.read_resource_slice, ("nope",)),
        (api.v1.delete_resource_slice, ("nope",)),
        (api.v1.patch_resource_slice, ("nope", {"metadata": {"labels": {"a": "b"}}})),
        (api.v1.replace_resource_slice, ("nope", slice_body("nope"))),
        (api.v1.read_namespaced_resource_claim, ("nope", "default")),
        (api.v1.read_device_class, ("nope",)),
    ):
        with pytest.raises(ApiException) as caught:
            await api.raw(call, *args)
        assert caught.value.status == 404, call
        assert json.loads(caught.value.body)["reason"] == "NotFound"


async def test_create_twice_is_already_exists(api: Api) -> None:
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    assert caught.value.status == 409
    assert json.loads(caught.value.body)["reason"] == "AlreadyExists"


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda s: s["spec"]["devices"].append(s["spec"]["devices"][0]), "Duplicate value"),
        (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "DNS label"),
        (
            lambda s: s["spec"]["devices"][0].update(taints=[{"key": "a", "effect": "Maybe"}]),
            "Unsupported value",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(x={"int": 1, "string": "a"}),
            "exactly one of",
        ),
        (
            lambda s: s["spec"]["devices"][0]["attributes"].update(v={"version": "v1"}),
            "semver",
        ),
        (lambda s: s["spec"].update(allNodes=True), "exactly one of nodeName"),
        (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "resourceSliceCount"),
        (
            lambda s: s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"].update(
                default="1.5Mi"
            ),
            "multiple of step",
        ),
        (
            lambda s: s["spec"]["devices"][0]["capacity"]["memory"].update(value="lots"),
            "not a number",
        ),
        (
            lambda s: s["spec"].update(
                devices=[dict(s["spec"]["devices"][0], name=f"d{i}", taints=[
                    {"key": "k", "effect": "NoSchedule"}]) for i in range(65)]
            ),
            "at most 64",
        ),
    ],
)
async def test_invalid_slices_are_refused(api: Api, change: Any, complaint: str) -> None:
    body = slice_body("bad")
    change(body)
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.create_resource_slice, body)
    assert caught.value.status == 422
    assert complaint in json.loads(caught.value.body)["message"]
    assert api.fake.resources.slices() == []


@pytest.mark.parametrize(
    "patch",
    [
        {"spec": {"driver": "other.example.com"}},
        {"spec": {"nodeName": "node-b"}},
        {"spec": {"pool": {"name": "node-b"}}},
    ],
)
async def test_immutable_slice_fields(api: Api, patch: dict[str, Any]) -> None:
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.patch_resource_slice, "s1", patch)
    assert caught.value.status == 422
    assert "immutable" in caught.value.body


async def test_json_patch_and_merge_patch_content_types(api: Api) -> None:
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    patched = await api.raw(
        api.v1.patch_resource_slice,
        "s1",
        [{"op": "add", "path": "/spec/devices/0/taints", "value": [
            {"key": "gpu.vgpu.io/xid", "value": "79", "effect": "NoExecute"}]}],
    )
    assert api.fake.requests[-1].content_type == "application/json-patch+json"
    assert patched["spec"]["devices"][0]["taints"][0]["effect"] == "NoExecute"
    assert patched["spec"]["devices"][0]["taints"][0]["timeAdded"]  # stamped by the server
    assert patched["metadata"]["generation"] == 2
    merged = await api.raw(
        api.v1.patch_resource_slice,
        "s1",
        {"spec": {"pool": {"generation": 3}}},
        _content_type="application/merge-patch+json",
    )
    assert merged["spec"]["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}


async def test_delete_and_delete_collection(api: Api) -> None:
    for node in ("node-a", "node-a", "node-b"):
        await api.raw(api.v1.create_resource_slice, slice_body(node=node))
    await api.raw(
        api.v1.delete_collection_resource_slice, field_selector="spec.nodeName=node-a"
    )
    assert [s["spec"]["nodeName"] for s in api.fake.resources.slices()] == ["node-b"]
    name = api.fake.resources.slices()[0]["metadata"]["name"]
    gone = await api.raw(api.v1.delete_resource_slice, name)
    assert gone["metadata"]["name"] == name
    assert api.fake.resources.slices() == []


async def test_claim_status_subresource_and_immutable_spec(api: Api) -> None:
    claim = {
        "metadata": {"name": "c1", "namespace": "team"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "vgpu",
                            "count": 1,
                            "capacity": {"requests": {"memory": "10240Mi", "cores": "30"}},
                        },
                    }
                ]
            }
        },
        "status": {"allocation": {"devices": {"results": []}}},
    }
    created = await api.raw(api.v1.create_namespaced_resource_claim, "team", claim)
    assert "status" not in created  # status is dropped on create
    exactly = created["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["count"] == 1 and exactly["capacity"]["requests"]["memory"] == "10Gi"
    allocation = {
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": "node-a",
                    "device": "gpu-0",
                    "consumedCapacity": {"memory": "10240Mi", "cores": "30"},
                    "shareID": "9b6a1c0e-0000-4000-8000-000000000001",
                }
            ]
        }
    }
    created["status"] = {"allocation": allocation}
    ignored = await api.raw(api.v1.replace_namespaced_resource_claim, "c1", "team", created)
    assert "status" not in ignored  # the main resource ignores status
    allocated = await api.raw(
        api.v1.replace_namespaced_resource_claim_status, "c1", "team", created
    )
    result = allocated["status"]["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "10Gi", "cores": "30"}
    assert allocated["metadata"]["generation"] == 1  # a status write is no spec change
    got = await api.raw(api.v1.read_namespaced_resource_claim, "c1", "team")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]

    got["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "other"
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.replace_namespaced_resource_claim, "c1", "team", got)
    assert caught.value.status == 422 and "immutable" in caught.value.body
    listed = await api.raw(api.v1.list_resource_claim_for_all_namespaces)
    assert [c["metadata"]["namespace"] for c in listed["items"]] == ["team"]


async def test_device_class_round_trip(api: Api) -> None:
    body = {
        "metadata": {"name": "vgpu.gpu.vgpu.io"},
        "spec": {
            "selectors": [{"cel": {"expression": 'device.driver == "gpu.vgpu.io"'}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    await api.raw(api.v1.create_device_class, body)
    got = await api.raw(api.v1.read_device_class, "vgpu.gpu.vgpu.io")
    assert got["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    body["spec"]["selectors"] = [{"cel": {}}]
    body["metadata"]["name"] = "broken"
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.create_device_class, body)
    assert caught.value.status == 422


async def read_watch(response: Any, count: int) -> list[dict[str, Any]]:
    lines = []
    async with asyncio.timeout(5):
        while len(lines) < count:
            line = await response.content.readline()
            if not line:
                break
            lines.append(json.loads(line))
    return lines


async def test_watch_from_a_resource_version_sees_changes_for_its_selector(api: Api) -> None:
    listed = await api.raw(api.v1.list_resource_slice, field_selector="spec.nodeName=node-a")
    response = await api.v1.list_resource_slice(
        watch=True,
        field_selector="spec.nodeName=node-a",
        resource_version=listed["metadata"]["resourceVersion"],
        _preload_content=False,
    )
    try:
        await api.raw(api.v1.create_resource_slice, slice_body("other", node="node-b"))
        await api.raw(api.v1.create_resource_slice, slice_body("s1"))
        api.fake.resources.edit(
            "resourceslices", "s1", lambda s: s["spec"]["pool"].update(generation=2)
        )
        await api.raw(api.v1.delete_resource_slice, "s1")
        events = await read_watch(response, 3)
    finally:
        response.release()
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "s1"),
        ("MODIFIED", "s1"),
        ("DELETED", "s1"),
    ]
    assert events[1]["object"]["spec"]["pool"]["generation"] == 2


async def test_watch_without_version_lists_first_and_ends_on_timeout_or_restart(
    api: Api,
) -> None:
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    response = await api.v1.list_resource_slice(
        watch=True, timeout_seconds=1, _preload_content=False
    )
    try:
        first = await read_watch(response, 1)
        rest = await read_watch(response, 1)  # ends by itself after timeoutSeconds
    finally:
        response.release()
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in first] == [("ADDED", "s1")]
    assert rest == []

    response = await api.v1.list_resource_slice(watch=True, _preload_content=False)
    try:
        await read_watch(response, 1)
        api.fake.resources.close_watches()
        assert await read_watch(response, 1) == []
    finally:
        response.release()
    assert api.fake.resources.watchers == []


async def test_watch_from_a_compacted_version_is_gone(api: Api) -> None:
    created = await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    api.fake.resources.edit(
        "resourceslices", "s1", lambda s: s["spec"]["pool"].update(generation=2)
    )
    api.fake.resources.compact()
    response = await api.v1.list_resource_slice(
        watch=True, resource_version=created["metadata"]["resourceVersion"],
        _preload_content=False,
    )
    try:
        events = await read_watch(response, 2)
    finally:
        response.release()
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410


async def test_injected_failures_apply_to_resource_paths(api: Api) -> None:
    api.fake.fail(500, path="/resourceslices")
    with pytest.raises(ApiException) as caught:
        await api.raw(api.v1.list_resource_slice)
    assert caught.value.status == 500
    api.fake.stall(2.0, path="/resourceslices")
    with pytest.raises(TimeoutError):
        await api.raw(api.v1.list_resource_slice, _request_timeout=0.2)
    assert (await api.raw(api.v1.list_resource_slice))["items"] == []


def test_label_selector_parsing_rejects_garbage() -> None:
    selector = parse_label_selector("a=b,c!=d,e in (f, g),h,!i")
    labels = {"a": "b", "c": "x", "e": "g", "h": ""}
    assert selector.matches(labels.get)
    assert not selector.matches({**labels, "i": "1"}.get)
    assert not selector.matches({**labels, "c": "d"}.get)
    with pytest.raises(ApiError):
        parse_label_selector("a=(b")


async def test_a_slice_leaving_a_watched_selector_is_deleted_for_the_watcher(api: Api) -> None:
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    response = await api.v1.list_resource_slice(
        watch=True, label_selector="app=vgpu", _preload_content=False
    )
    try:
        first = await read_watch(response, 1)
        api.fake.resources.edit(
            "resourceslices", "s1", lambda s: s["metadata"]["labels"].update(app="other")
        )
        gone = await read_watch(response, 1)
    finally:
        response.release()
    assert [e["type"] for e in first + gone] == ["ADDED", "DELETED"]


async def test_kinds_are_served_only_at_their_scope(api: Api) -> None:
    for path in (
        "/apis/resource.k8s.io/v1/namespaces/team/resourceslices",
        "/apis/resource.k8s.io/v1/resourceclaims/c1",
        "/apis/resource.k8s.io/v1/widgets",
    ):
        with pytest.raises(ApiException) as caught:
            await api.raw(api.client.call_api, path, "GET", auth_settings=["BearerToken"])
        assert caught.value.status == 404, path


async def test_a_stopped_server_refuses_connections_and_keeps_its_port_for_the_restart():
    """While stopped, the port is bound but not listening: a client is refused (not answered
    by whichever other server the machine handed the port to), and the restart gets it back."""
    import socket

    api = FakeKubeAPI()
    await api.start()
    port = api.port
    await api.stop()
    try:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        other = socket.socket()
        with pytest.raises(OSError):  # nobody else may listen there meanwhile
            other.bind(("127.0.0.1", port))
            other.listen()
        other.close()
        await api.start()
        assert api.port == port
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()
    finally:
        await api.stop()


async def test_a_watch_still_open_when_the_server_stops_is_dropped_not_waited_for(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that opens a watch just as the server stops (after its open watches were ended)
    # must not hold the stop for aiohttp's shutdown timeout (60 s): a server going away drops
    # its connections. Here the watch is left open by making the ending a no-op.
    await api.raw(api.v1.create_resource_slice, slice_body("s1"))
    response = await api.v1.list_resource_slice(watch=True, _preload_content=False)
    try:
        assert len(await read_watch(response, 1)) == 1
        monkeypatch.setattr(api.fake.resources, "close_watches", lambda: None)
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(10):
            await api.fake.stop()
        assert loop.time() - started < 5
        try:  # the stream is cut: it ends or fails, it does not stay open
            rest = await read_watch(response, 1)
        except TimeoutError:
            pytest.fail("the watch stayed open")
        except Exception:  # a dropped connection, by whichever client error
            rest = []
        assert rest == []
    finally:
        response.release()

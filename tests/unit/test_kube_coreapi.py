"""`CoreApi` sends what the generated `CoreV1Api` sends for the calls the agent makes: both are
driven through an `ApiClient` that records each request instead of sending it, and the
requests are compared whole (method, URL, query, headers, body)."""

from __future__ import annotations

from typing import Any

import pytest

from vgpu_agent.kube.coreapi import CoreApi

from kubernetes_asyncio import client  # isort: skip  (after vgpu_agent.kube: the lean client)


class _Recording(client.ApiClient):
    """An ApiClient whose requests are recorded, answered by a stand-in raw response."""

    def __init__(self) -> None:
        configuration = client.Configuration(
            host="https://api.example:6443", api_key={"BearerToken": "token-1"},
            api_key_prefix={"BearerToken": "Bearer"})
        super().__init__(configuration=configuration)
        self.sent: list[tuple[str, str, Any, dict[str, str], Any, Any]] = []

    async def request(self, method: str, url: str, query_params: Any = None,
                      headers: Any = None, post_params: Any = None, body: Any = None,
                      _preload_content: bool = True, _request_timeout: Any = None) -> Any:
        self.sent.append((method, url, query_params, dict(headers or {}), body,
                          _request_timeout))
        return "raw response"


VERBS = {"read": "GET", "patch": "PATCH", "create": "POST", "list": "GET"}
LABELS_PATCH = {"metadata": {"labels": {"vgpu.io/slices": "16"}}}
CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("read_node", ("node-a",), {}),
    ("patch_node", ("node-a", LABELS_PATCH), {}),
    ("patch_node", ("node-a", [{"op": "remove", "path": "/metadata/labels/x"}]), {}),
    ("patch_node", ("node-a", LABELS_PATCH),
     {"_content_type": "application/merge-patch+json"}),
    ("create_namespaced_event", ("team-a", {"kind": "Event", "reason": "Throttled"}), {}),
    ("create_namespaced_pod_eviction",
     ("train-0", "team-a", {"kind": "Eviction", "metadata": {"name": "train-0"}}), {}),
    ("list_pod_for_all_namespaces", (), {"field_selector": "spec.nodeName=node-a"}),
    ("list_pod_for_all_namespaces", (),
     {"field_selector": "spec.nodeName=node-a", "watch": True, "resource_version": "41",
      "allow_watch_bookmarks": True, "timeout_seconds": 290}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), CALLS,
                         ids=[f"{name}-{n}" for n, (name, _, _) in enumerate(CALLS)])
async def test_each_call_sends_what_the_generated_client_sends(name, args, kwargs):
    ours, theirs = _Recording(), _Recording()
    try:
        options = {"_preload_content": False, "_request_timeout": (3.0, 30.0), **kwargs}
        got = await getattr(CoreApi(ours), name)(*args, **options)
        want = await getattr(client.CoreV1Api(theirs), name)(*args, **options)
        assert got == want == "raw response"
        assert ours.sent == theirs.sent and len(ours.sent) == 1
        method, url, _, headers, _, timeout = ours.sent[0]
        assert method == VERBS[name.split("_")[0]]
        assert url.startswith("https://api.example:6443/api/v1/")
        assert headers["authorization"] == "Bearer token-1" and timeout == (3.0, 30.0)
    finally:
        await ours.close()
        await theirs.close()


async def test_path_parameters_are_quoted_as_the_generated_client_quotes_them():
    ours, theirs = _Recording(), _Recording()
    try:
        await CoreApi(ours).read_node("node a/b", _preload_content=False)
        await client.CoreV1Api(theirs).read_node("node a/b", _preload_content=False)
        assert ours.sent == theirs.sent
        assert ours.sent[0][1].endswith("/api/v1/nodes/node%20a%2Fb")
    finally:
        await ours.close()
        await theirs.close()


async def test_an_argument_the_agent_never_passes_is_refused_by_name():
    api_client = _Recording()
    try:
        with pytest.raises(TypeError, match=r"unexpected arguments \['label_selector'\]"):
            await CoreApi(api_client).list_pod_for_all_namespaces(label_selector="a=b")
        with pytest.raises(TypeError, match=r"unexpected arguments \['pretty'\]"):
            await CoreApi(api_client).read_node("node-a", pretty="true")
        assert api_client.sent == []
    finally:
        await api_client.close()

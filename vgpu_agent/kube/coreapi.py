"""The calls of the Kubernetes core API the agent makes, without the generated `CoreV1Api`.

kubernetes_asyncio's `CoreV1Api` is one generated module of some 38,000 lines (2.7 MB imported
alone; the idle agent 1.2 MB lighter without it, measured side by side) for the five endpoints
the agent calls (a node read and patched, events created, a pod evicted, pods listed and
watched). Each method here builds the request the generated one
builds for the arguments the agent passes (path, query names, `Accept`, for a patch the
`Content-Type` `ApiClient.select_header_content_type` picks; for a create none, so that the
client sends JSON; bearer-token auth) and hands it to the same
`ApiClient.call_api`, so TLS, authentication and timeouts stay the library's. The method names
are the generated ones (the RBAC test maps them to the verbs the ClusterRole grants).

Answers come back raw (`_preload_content=False`, which every caller passes): the callers read
the JSON themselves (`node.call_json`), and nothing here builds model objects.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio.client import ApiClient

# what the generated methods send (the generator's lists, as `ApiClient` narrows them)
_ACCEPT = ["application/json", "application/yaml", "application/vnd.kubernetes.protobuf",
           "application/cbor"]
_PATCH_TYPES = ["application/json-patch+json", "application/merge-patch+json",
                "application/strategic-merge-patch+json", "application/apply-patch+yaml",
                "application/apply-patch+cbor"]
_AUTH = ["BearerToken"]
# the request options callers may pass through, as the generated methods take them
_OPTIONS = frozenset({"_preload_content", "_request_timeout", "_request_auth", "_content_type",
                      "_headers"})


class CoreApi:
    """`CoreV1Api`'s methods the agent uses, over an `ApiClient`."""

    def __init__(self, api_client: ApiClient) -> None:
        self.api_client = api_client

    async def read_node(self, name: str, **options: Any) -> Any:
        return await self._call("GET", "/api/v1/nodes/{name}", {"name": name}, [], None,
                                options)

    async def patch_node(self, name: str, body: object, **options: Any) -> Any:
        return await self._call("PATCH", "/api/v1/nodes/{name}", {"name": name}, [], body,
                                options, content_types=_PATCH_TYPES)

    async def create_namespaced_event(self, namespace: str, body: object, **options: Any
                                      ) -> Any:
        return await self._call("POST", "/api/v1/namespaces/{namespace}/events",
                                {"namespace": namespace}, [], body, options)

    async def create_namespaced_pod_eviction(self, name: str, namespace: str, body: object,
                                             **options: Any) -> Any:
        return await self._call("POST", "/api/v1/namespaces/{namespace}/pods/{name}/eviction",
                                {"name": name, "namespace": namespace}, [], body, options)

    async def list_pod_for_all_namespaces(
        self, *, allow_watch_bookmarks: bool | None = None, field_selector: str | None = None,
        resource_version: str | None = None, timeout_seconds: int | None = None,
        watch: bool | None = None, **options: Any,
    ) -> Any:
        # in the generated method's order of its query parameters
        query = [(key, value) for key, value in (
            ("allowWatchBookmarks", allow_watch_bookmarks), ("fieldSelector", field_selector),
            ("resourceVersion", resource_version), ("timeoutSeconds", timeout_seconds),
            ("watch", watch)) if value is not None]
        return await self._call("GET", "/api/v1/pods", {}, query, None, options)

    async def _call(self, method: str, path: str, path_params: dict[str, str],
                    query: list[tuple[str, Any]], body: object, options: dict[str, Any],
                    content_types: list[str] | None = None) -> Any:
        unknown = sorted(options.keys() - _OPTIONS)
        if unknown:
            raise TypeError(f"CoreApi.{method} {path}: unexpected arguments {unknown}; allowed: "
                            f"{sorted(_OPTIONS)}")
        client = self.api_client
        headers = dict(options.get("_headers", {}))
        headers["Accept"] = client.select_header_accept(_ACCEPT)
        if content_types is not None:
            headers["Content-Type"] = options.get(
                "_content_type", client.select_header_content_type(content_types, method, body))
        return await client.call_api(
            path, method, path_params, query, headers, body=body, post_params=None, files=None,
            response_types_map={}, auth_settings=_AUTH, _return_http_data_only=True,
            _preload_content=options.get("_preload_content", True),
            _request_timeout=options.get("_request_timeout"), collection_formats={},
            _request_auth=options.get("_request_auth"))

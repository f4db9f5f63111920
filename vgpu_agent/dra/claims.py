"""Reads ResourceClaims from the API server (`resource.k8s.io/v1`) for NodePrepareResources.

The kubelet's request names a claim, not its allocation: the allocation is read here, as JSON
(the client's model objects are skipped: they cost milliseconds per claim on the loop that also
serves the kubelet). Every failure is a `ClaimReadError` whose message says what the kubelet
should show: the claim is gone, access is denied, or the API is unreachable (retried by the
kubelet's next call).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ClaimReadError(Exception):
    """The claim could not be read; the message names it and the reason."""


class ClaimReader:
    def __init__(
        self,
        kubeconfig: str | None,
        *,
        request_timeout: float = 5.0,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ):
        self._kubeconfig = kubeconfig
        self._timeout = request_timeout
        self._environ = dict(os.environ if environ is None else environ)
        self._sa_dir = service_account_dir
        self._api_client: client.ApiClient | None = None
        self._api: client.ResourceV1Api | None = None

    async def start(self) -> None:
        """Load the API configuration. Raises ClaimReadError if there is none or it is bad."""
        configuration = client.Configuration()
        try:
            if self._kubeconfig:
                await config.load_kube_config(
                    config_file=self._kubeconfig, client_configuration=configuration
                )
            elif self._environ.get("KUBERNETES_SERVICE_HOST"):
                InClusterConfigLoader(
                    token_filename=str(self._sa_dir / "token"),
                    cert_filename=str(self._sa_dir / "ca.crt"),
                    environ=self._environ,  # type: ignore[arg-type]
                ).load_and_set(configuration)
            else:
                raise ClaimReadError("no kubeconfig and no in-cluster configuration")
        except ClaimReadError:
            raise
        except Exception as err:
            raise ClaimReadError(f"cannot load the Kubernetes API configuration: {err}") from err
        self._api_client = client.ApiClient(configuration=configuration)
        self._api = client.ResourceV1Api(self._api_client)
        log.info("dra_claim_reader_ready", server=configuration.host)

    async def read(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim as JSON. Raises ClaimReadError."""
        if self._api is None:
            await self.start()
        assert self._api is not None
        what = f"ResourceClaim {namespace}/{name}"
        try:
            # raw response (no models): Any, since the client's stubs promise a model
            response: Any = await self._api.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            )
            try:
                body = await response.read()
            finally:
                response.release()
        except ApiException as err:  # raised for some statuses even without preloading
            raise ClaimReadError(f"{what}: HTTP {err.status} {err.reason}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            reason = "request timed out" if isinstance(err, TimeoutError) else str(err)
            raise ClaimReadError(
                f"{what}: Kubernetes API unreachable ({type(err).__name__}: {reason}); "
                "the kubelet retries"
            ) from None
        if response.status == 404:
            raise ClaimReadError(f"{what} not found: deleted after it was allocated")
        if not 200 <= response.status <= 299:
            raise ClaimReadError(f"{what}: HTTP {response.status}: {_message(body)}")
        try:
            claim = json.loads(body)
        except ValueError:
            raise ClaimReadError(f"{what}: the API server answered with no JSON") from None
        if not isinstance(claim, dict):
            raise ClaimReadError(f"{what}: the API server answered with no object")
        return claim

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
            self._api = None


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", ""))[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")

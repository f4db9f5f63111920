"""Reads ResourceClaims from the API server (`resource.k8s.io/v1`) for NodePrepareResources.

The kubelet's request names a claim, not its allocation: the allocation is read here, as JSON
(the client's model objects are skipped: they cost milliseconds per claim on the loop that also
serves the kubelet). Every failure is a `ClaimReadError` whose message says what the kubelet
should show: the claim is gone, access is denied, or the API is unreachable (retried by the
kubelet's next call).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client

from vgpu_agent.kube.apiclient import (
    SERVICE_ACCOUNT_DIR,
    ApiException,
    KubeConfigError,
    call_json,
    describe,
    load_configuration,
)

log = structlog.get_logger(__name__)


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
        try:
            configuration = await load_configuration(
                self._kubeconfig, None, self._environ, self._sa_dir
            )
        except KubeConfigError as err:
            raise ClaimReadError(str(err)) from err
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
            claim = await call_json(
                self._api.read_namespaced_resource_claim,
                name,
                namespace,
                request_timeout=self._timeout,
            )
        except ApiException as err:
            if err.status == 404:
                raise ClaimReadError(f"{what} not found: deleted after it was allocated") from None
            raise ClaimReadError(f"{what}: {describe(err)}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise ClaimReadError(
                f"{what}: Kubernetes API unreachable ({describe(err)}); the kubelet retries"
            ) from None
        except ValueError:
            raise ClaimReadError(f"{what}: the API server answered with no JSON") from None
        if not isinstance(claim, dict) or not claim:
            raise ClaimReadError(f"{what}: the API server answered with no object")
        return claim

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
            self._api = None


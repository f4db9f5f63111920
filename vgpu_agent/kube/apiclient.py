"""Loading the Kubernetes API configuration and calling the API for plain JSON.

Shared by the adapters that talk to the API server: where the configuration comes from (an
explicit kubeconfig, else the in-cluster service account), and a call that skips
kubernetes_asyncio's model objects (building them costs milliseconds on the shared event loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from vgpu_agent.kube.node import (  # call_json, describe, status_of: callers import them here
    SERVICE_ACCOUNT_DIR,
    KubeConfigError,
    call_json,
    describe,
    status_of,
)

__all__ = [
    "SERVICE_ACCOUNT_DIR",
    "ApiException",
    "KubeConfigError",
    "call_json",
    "describe",
    "load_configuration",
    "status_of",
]

Source = Literal["kubeconfig", "in-cluster"]


def config_source(
    kubeconfig: str | None, in_cluster: bool | None, environ: Mapping[str, str]
) -> Source | None:
    if kubeconfig:
        return "kubeconfig"
    if in_cluster is True:
        return "in-cluster"
    if in_cluster is None and environ.get("KUBERNETES_SERVICE_HOST"):
        return "in-cluster"
    return None


async def load_configuration(
    kubeconfig: str | None,
    in_cluster: bool | None,
    environ: Mapping[str, str],
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> client.Configuration:
    """The API configuration, or KubeConfigError naming what is missing or unusable."""
    source = config_source(kubeconfig, in_cluster, environ)
    if source is None:
        raise KubeConfigError(
            "no Kubernetes API configuration: give a kubeconfig, or run in a cluster "
            "(KUBERNETES_SERVICE_HOST and the service account token)"
        )
    configuration = client.Configuration()
    try:
        if source == "kubeconfig":
            await config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration
            )
        else:
            InClusterConfigLoader(
                token_filename=str(service_account_dir / "token"),
                cert_filename=str(service_account_dir / "ca.crt"),
                environ=dict(environ),  # type: ignore[arg-type]
            ).load_and_set(configuration)
    except Exception as exc:
        what = f"kubeconfig {kubeconfig}" if source == "kubeconfig" else "in-cluster"
        raise KubeConfigError(f"cannot load {what} configuration: {exc}") from exc
    return configuration



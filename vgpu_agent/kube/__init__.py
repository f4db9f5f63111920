"""Adapters for the Kubernetes API. The client library is registered lean before any of them
imports it (see `leanclient`)."""

from vgpu_agent.kube import leanclient

leanclient.install()

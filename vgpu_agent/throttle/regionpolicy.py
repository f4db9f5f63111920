"""Writes each region's compute policy and priority from its pod's annotations.

A region is bound to its container by PodResources (`RegionStore.identity`); the pod is looked up
by namespace and name in a cache of this node's pods (`kube/pods.py`, keyed by UID, so a pod
re-created under the same name is a new pod). `podpolicy.resolve` decides within the node's rules,
and the result goes into the region's `control` (agent-owned fields: per-device `policy`, header
`priority`); the shim sees the policy at its next launch and the controller both at its next tick.

What applies when the pod is not known:
- a region not bound yet, or whose pod the cache has not seen: what `control` holds, i.e. the node
  default for a new region, and the last value written for a region the agent re-adopted;
- the API unreachable: the cache keeps the last known pods, so the last known policy stays.

Refusals are handed to `on_refusal` every time they are found; the receiver deduplicates (one
event per pod UID and refusal).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

import structlog

from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.throttle.podpolicy import (
    SOURCE_DEFAULT,
    SOURCE_POD,
    PodInfo,
    PodPolicyRules,
    Refusal,
    Source,
    resolve,
)

log = structlog.get_logger(__name__)

ContainerKey = tuple[str, str, str]  # namespace, pod, container


class PodLookup(Protocol):
    def pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod of that name now on this node, None when unknown."""


class PolicyRegion(Protocol):
    @property
    def alloc_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def device_uuids(self) -> tuple[str, ...]: ...

    def policy(self, dev: int) -> CorePolicy: ...

    def set_policy(self, policy: CorePolicy, priority: int) -> bool:
        """Store both in `control`; False when they were already in force."""


class RegionPolicies:
    """Keeps every bound region's policy and priority what its pod asks for, within the rules."""

    def __init__(
        self,
        regions: Callable[[], Iterable[PolicyRegion]],
        identity: Callable[[str], ContainerKey | None],
        rules: PodPolicyRules,
        *,
        pods: PodLookup | None = None,
        on_refusal: Callable[[PodInfo, Refusal], None] | None = None,
    ):
        self.regions = regions
        self.identity = identity
        self.rules = rules
        self.pods = pods
        self.on_refusal = on_refusal
        self.writes = 0  # regions rewritten, for the metrics and tests
        self.failures = 0
        self._sources: dict[str, Source] = {}
        self._applied: dict[str, str] = {}  # alloc_id -> the pod UID whose choice is in force
        self._wake = asyncio.Event()

    def source(self, alloc_id: str) -> Source:
        """Whether the region's policy is the pod's choice or the node default."""
        return self._sources.get(alloc_id, SOURCE_DEFAULT)

    def poke(self) -> None:
        """Ask `run()` to apply soon (bindings or pods changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Apply at once, then whenever poked, until cancelled."""
        while True:
            self.apply()
            await self._wake.wait()
            self._wake.clear()

    def apply(self) -> int:
        """Resolve and write every bound region whose pod is known; returns regions rewritten."""
        changed = 0
        seen: set[str] = set()
        for region in list(self.regions()):
            alloc_id = region.alloc_id
            seen.add(alloc_id)
            try:
                changed += self._apply_one(region)
            except Exception:  # one bad region must not keep the others at their old policy
                self.failures += 1
                log.exception("region_policy_failed", alloc_id=alloc_id)
        for gone in [a for a in self._sources if a not in seen]:
            del self._sources[gone]
            self._applied.pop(gone, None)
        return changed

    def _apply_one(self, region: PolicyRegion) -> int:
        alloc_id = region.alloc_id
        key = self.identity(alloc_id)
        pod = self.pods.pod(key[0], key[1]) if key is not None and self.pods is not None else None
        if key is None or pod is None:
            if alloc_id not in self._sources:
                self._sources[alloc_id] = self._found_source(region)
            return 0
        chosen = resolve(pod.annotations, pod.namespace, key[2], self.rules)
        if self.on_refusal is not None:
            for refusal in chosen.refusals:
                self.on_refusal(pod, refusal)
        self._sources[alloc_id] = chosen.source
        written = region.set_policy(chosen.policy, chosen.priority)
        if written or self._applied.get(alloc_id) != pod.uid:
            log.info(
                "region_policy_applied",
                alloc_id=alloc_id,
                namespace=key[0],
                pod=key[1],
                container=key[2],
                pod_uid=pod.uid,
                policy=chosen.policy,
                priority=chosen.priority,
                source=chosen.source,
                refused=[r.annotation for r in chosen.refusals],
            )
        self._applied[alloc_id] = pod.uid
        if written:
            self.writes += 1
        return 1 if written else 0

    def _found_source(self, region: PolicyRegion) -> Source:
        """A region not resolved yet: a new one holds the node default; one re-adopted after a
        restart holds what was written for its pod, which differs from the default only when
        the pod chose it."""
        in_force = {region.policy(dev) for dev in range(len(region.device_uuids))}
        default = in_force == {self.rules.default_policy} and (
            region.priority == self.rules.default_priority
        )
        return SOURCE_DEFAULT if default else SOURCE_POD

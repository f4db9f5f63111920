"""NodePrepareResources and NodeUnprepareResources, independent of the gRPC version serving them.

Prepare, per claim: read the claim from the API (uid checked), turn this driver's results into a
grant (`dra.grant`), refuse it if it would overfill a GPU beside the claims already prepared,
create its region with exactly the granted memory and cores, write its CDI spec and remember
it in the checkpoint. The answer lists, per allocated device, the NVIDIA toolkit's CDI device for
the physical GPU and (on the claim's first device) the claim's own CDI device.

Unprepare, per claim: remove the region and the spec, forget the claim. A claim this agent does
not know is already unprepared (success), as the kubelet expects after a restart.

Each claim's outcome is its own: one failure never fails the call. Calls are idempotent (a
claim prepared again gets the answer it got the first time, without an API read) and safe when
concurrent: one lock per claim keeps two calls for the same claim in order, and one lock around
the capacity check, the region and the checkpoint keeps two claims from both taking the last of
a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog

from vgpu_agent.deviceplugin.allocation import container_envs
from vgpu_agent.dra import cdi
from vgpu_agent.dra.checkpoint import Checkpoint, PreparedClaim, ReportedDevice
from vgpu_agent.dra.claims import ClaimReadError
from vgpu_agent.dra.grant import (
    ClaimError,
    ClaimGrant,
    ClaimPriorityBound,
    ClaimRef,
    DeviceCapacity,
    claim_grant,
    over_capacity,
)
from vgpu_agent.shm.api import CorePolicy
from vgpu_agent.shm.regions import RegionError, RegionStore

log = structlog.get_logger(__name__)

ClaimRead = Callable[[str, str], Awaitable[dict[str, Any]]]
ResultHook = Callable[[str, float], None]


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[ReportedDevice, ...] = ()
    error: str = ""


class DraDriver:
    def __init__(
        self,
        *,
        driver: str,
        node: str,
        devices: Callable[[], Mapping[str, DeviceCapacity]],
        read_claim: ClaimRead,
        regions: RegionStore,
        cdi_dir: str,
        checkpoint: Checkpoint,
        gpu_cdi_kind: str = "nvidia.com/gpu",
        on_result: ResultHook | None = None,
        on_prepared: Callable[[], None] | None = None,
        priority_bound: ClaimPriorityBound | None = None,
    ):
        self.driver = driver
        # what a claim's own configuration may set as priority (`grant.ClaimPriorityBound`)
        self.priority_bound = priority_bound
        self.node = node
        self._devices = devices
        self._read_claim = read_claim
        self._regions = regions
        self._cdi_dir = cdi_dir
        self._checkpoint = checkpoint
        self._gpu_cdi_kind = gpu_cdi_kind
        self._on_result = on_result
        self._on_prepared = on_prepared
        self._claim_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._commit = asyncio.Lock()

    @property
    def prepared(self) -> Mapping[str, PreparedClaim]:
        return self._checkpoint.claims

    def restore(self) -> None:
        """At start: reload the checkpoint, pin the regions of prepared claims, delete CDI specs
        no prepared claim owns (a crash between writing one and the checkpoint)."""
        claims = self._checkpoint.load()
        for claim in claims.values():
            if claim.alloc_id is None:
                continue
            if self._regions.get(claim.alloc_id) is None:
                log.warning(
                    "dra_claim_region_missing",
                    claim=str(claim.claim),
                    alloc_id=claim.alloc_id,
                    effect="its containers keep their limits; nothing else to restore",
                )
            self._regions.pin(claim.alloc_id)
        owned = {c.spec_file for c in claims.values()}
        for uid, name in cdi.our_specs(self._cdi_dir, self.driver).items():
            if name not in owned:
                with contextlib.suppress(OSError):
                    cdi.remove_spec(self._cdi_dir, name)
                log.info("dra_cdi_spec_leftover_removed", claim_uid=uid, file=name)
        log.info("dra_claims_restored", count=len(claims))

    # --- the two calls ----------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        started = time.perf_counter()
        results = await asyncio.gather(*(self._prepare_one(c) for c in claims))
        self._result("prepare", started)
        return {c.uid: r for c, r in zip(claims, results, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        started = time.perf_counter()
        results = await asyncio.gather(*(self._unprepare_one(c) for c in claims))
        self._result("unprepare", started)
        return {c.uid: r for c, r in zip(claims, results, strict=True)}

    # --- one claim --------------------------------------------------------------------------------

    async def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        if not ref.uid or not ref.name or not ref.namespace:
            return PrepareResult(error=f"claim {ref}: namespace, name and uid are all required")
        async with self._lock(ref.uid):
            known = self._checkpoint.claims.get(ref.uid)
            if known is not None:
                return PrepareResult(known.devices)
            try:
                obj = await self._read_claim(ref.namespace, ref.name)
                granted = claim_grant(
                    obj, ref, driver=self.driver, node=self.node, devices=self._devices(),
                    priority_bound=self.priority_bound,
                )
                prepared = await self._commit_claim(granted)
            except (ClaimReadError, ClaimError, RegionError, OSError) as err:
                message = str(err)
                if ref.name not in message:  # the kubelet shows it beside the pod: name the claim
                    message = f"claim {ref}: {message}"
                log.warning("dra_prepare_failed", claim=str(ref), error=message)
                return PrepareResult(error=message)
            except Exception as err:  # a bug must fail this claim only, and say so
                log.exception("dra_prepare_failed", claim=str(ref), error=str(err))
                return PrepareResult(error=f"claim {ref}: internal error: {err}")
        log.info(
            "dra_claim_prepared",
            claim=str(ref),
            alloc_id=prepared.alloc_id,
            devices=[d.device for d in prepared.devices],
            consumed={u: list(v) for u, v in prepared.consumed.items()},
        )
        if self._on_prepared is not None:
            self._on_prepared()
        return PrepareResult(prepared.devices)

    async def _commit_claim(self, granted: ClaimGrant) -> PreparedClaim:
        ref = granted.claim
        async with self._commit:
            reason = over_capacity(granted, self._holdings(), self._devices())
            if reason is not None:
                raise ClaimError(reason)
            region = None
            spec_file = None
            try:
                spec = None
                if granted.grant is not None:
                    region = self._regions.create(
                        granted.grant,
                        policies=cast(Sequence[CorePolicy | None], granted.policies),
                        priority=granted.priority,
                        pinned=True,
                    )
                    self._regions.prepare_spares(len(granted.grant.devices))
                    extras = self._regions.extras_for(region)
                    envs = container_envs(granted.grant, "cdi")
                    envs.update(extras.envs)
                    spec = cdi.claim_spec(self.driver, ref.uid, envs, extras.mounts)
                    spec_file = cdi.spec_name(self.driver, ref.uid)
                prepared = PreparedClaim(
                    ref,
                    region.alloc_id if region else None,
                    spec_file,
                    self._reported(granted, spec_file is not None),
                    dict(granted.consumed),
                )
                self._checkpoint.claims[ref.uid] = prepared
                try:
                    # one hop to a thread for both files: the spec first, so the checkpoint
                    # never names a spec that is not there
                    await asyncio.to_thread(self._write_files, spec_file, spec)
                except OSError:
                    del self._checkpoint.claims[ref.uid]
                    raise
            except BaseException:
                if spec_file is not None:
                    with contextlib.suppress(OSError):
                        cdi.remove_spec(self._cdi_dir, spec_file)
                if region is not None:
                    await self._regions.remove(region.alloc_id, "its claim failed to prepare")
                raise
            return prepared

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        async with self._lock(ref.uid), self._commit:
            known = self._checkpoint.claims.get(ref.uid)
            try:
                # a spec without a checkpoint entry is a crash's leftover: removed too
                spec = known.spec_file if known else cdi.spec_name(self.driver, ref.uid)
                if spec is not None:
                    await asyncio.to_thread(cdi.remove_spec, self._cdi_dir, spec)
                if known is None:
                    return ""
                if known.alloc_id is not None:
                    await self._regions.remove(known.alloc_id, "its claim was unprepared")
                del self._checkpoint.claims[ref.uid]
                await asyncio.to_thread(self._checkpoint.save)
            except OSError as err:
                log.warning("dra_unprepare_failed", claim=str(ref), error=str(err))
                return f"claim {ref}: {err}"
        log.info("dra_claim_unprepared", claim=str(ref), alloc_id=known.alloc_id)
        return ""

    # --- internals --------------------------------------------------------------------------------

    def _write_files(self, spec_file: str | None, spec: Mapping[str, Any] | None) -> None:
        if spec_file is not None and spec is not None:
            cdi.write_spec(self._cdi_dir, spec_file, spec)
        self._checkpoint.save()

    def _reported(self, granted: ClaimGrant, with_claim_device: bool) -> tuple[ReportedDevice, ...]:
        out = []
        claim_device = cdi.device_id(self.driver, granted.claim.uid)
        for i, d in enumerate(granted.devices):
            ids = [f"{self._gpu_cdi_kind}={d.uuid}"]
            if with_claim_device and i == 0:
                ids.append(claim_device)  # once per claim: the runtime applies it once
            out.append(ReportedDevice(d.requests, d.pool, d.device, d.share_id, tuple(ids)))
        return tuple(out)

    def _holdings(self) -> Iterable[ClaimGrant]:
        for c in self._checkpoint.claims.values():
            yield ClaimGrant(c.claim, (), None, (), 0, c.consumed)

    @contextlib.asynccontextmanager
    async def _lock(self, uid: str) -> AsyncIterator[None]:
        """One lock per claim UID, dropped when nobody holds or waits for it."""
        entry = self._claim_locks.get(uid)
        if entry is None:
            entry = self._claim_locks[uid] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._claim_locks[uid]

    def _result(self, call: str, started: float) -> None:
        if self._on_result is not None:
            self._on_result(call, time.perf_counter() - started)

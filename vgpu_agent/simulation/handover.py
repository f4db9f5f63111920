"""The demo's shared GPU: a service that is idle and busy in turns, and a batch job beside it.

The service runs `strict` at a high priority and the batch job `work-conserving` (their pods say
so by annotation, and the agent writes it into their regions). While the service is idle the batch
job borrows the whole GPU; the moment the service is busy again the controller takes the loan
back, within a tick. `HandoverLog` shows it: around every change of the service's phase it logs,
per controller tick, the SM share each of the two really had on the simulated GPU (ground truth,
not what the controller believed) and the controller's targets (`demo_handover` lines).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from vgpu_agent.simulation.demo import DemoWorkloads
from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.throttle.controller import DeviceStatus

log = structlog.get_logger(__name__)

SERVICE_PHASE_S = 6.0  # idle, then busy, then idle ... for this long each


def service_workload(phase_s: float = SERVICE_PHASE_S, cycles: int = 500) -> Workload:
    """Short kernels, idle for `phase_s`, busy for `phase_s`, and so on (`cycles` times)."""
    if not phase_s > 0:
        raise ValueError(f"phase must be > 0 s, got {phase_s!r}")
    busy = tuple((phase_s * (2 * k + 1), phase_s * (2 * k + 2)) for k in range(cycles))
    return Workload(kernel_s=0.001, blocks=512, threads_per_block=256, busy=busy)


BATCH_WORKLOAD = Workload(kernel_s=0.002, blocks=1024, threads_per_block=256)


@dataclass(frozen=True)
class TickShares:
    tick: int  # controller ticks since the service's phase changed (-1: the tick before)
    service_busy: bool
    service_share: float  # percent of the GPU's SM time during the tick, ground truth
    batch_share: float
    service_target: float  # what the controller aims at (0 before its first decision)
    batch_target: float


class HandoverLog:
    """Call after every demo step; logs the pair's shares per tick around each phase change."""

    def __init__(
        self,
        find: Callable[[str], str | None],
        controller_status: Callable[[], Mapping[tuple[str, int], DeviceStatus]],
        *,
        service: str = "inference",
        batch: str = "batch",
        tick_s: float = 0.1,
        ticks_after: int = 4,
    ):
        self.find = find  # pod name -> alloc_id of its allocation, None until known
        self.controller_status = controller_status
        self.names = (service, batch)
        self.tick_ns = round(tick_s * 1e9)
        self.ticks_after = ticks_after
        self.logged: list[TickShares] = []
        self._last: tuple[int, float, float] | None = None  # at ns, service SM s, batch SM s
        self._previous: TickShares | None = None
        self._busy: bool | None = None
        self._since_change: int | None = None

    def __call__(self, demo: DemoWorkloads) -> None:
        service_id, batch_id = (self.find(name) for name in self.names)
        if service_id is None or batch_id is None:
            return
        ids = (service_id, batch_id)
        service, batch = demo.containers.get(service_id), demo.containers.get(batch_id)
        if service is None or batch is None:
            return
        gpu, service_proc = service.on_gpus[0]
        batch_proc = next((p for g, p in batch.on_gpus if g is gpu), None)
        if batch_proc is None:
            return  # not on the same GPU: nothing to show
        now = gpu.now_ns
        if self._last is None:
            self._last = (now, service_proc.total_sm_s, batch_proc.total_sm_s)
            return
        at, service_sm, batch_sm = self._last
        if now - at < self.tick_ns:
            return
        period_s = (now - at) / 1e9
        self._last = (now, service_proc.total_sm_s, batch_proc.total_sm_s)
        busy = service_proc.workload.busy_at(gpu.elapsed_s - 1e-9)
        status = self.controller_status()
        shares = TickShares(
            tick=0,
            service_busy=busy,
            service_share=100 * (service_proc.total_sm_s - service_sm) / period_s,
            batch_share=100 * (batch_proc.total_sm_s - batch_sm) / period_s,
            service_target=_target(status, ids[0]),
            batch_target=_target(status, ids[1]),
        )
        if self._busy is not None and busy != self._busy:
            self._since_change = 0
            if self._previous is not None:
                self._log(self._previous, -1)
        self._busy = busy
        if self._since_change is not None:
            self._log(shares, self._since_change)
            self._since_change += 1
            if self._since_change > self.ticks_after:
                self._since_change = None
        self._previous = shares

    def _log(self, shares: TickShares, tick: int) -> None:
        shown = TickShares(tick, *[getattr(shares, f) for f in _FIELDS[1:]])
        self.logged.append(shown)
        log.info(
            "demo_handover",
            tick=tick,
            service_busy=shown.service_busy,
            service_share=round(shown.service_share, 1),
            batch_share=round(shown.batch_share, 1),
            service_target=round(shown.service_target, 1),
            batch_target=round(shown.batch_target, 1),
        )


_FIELDS = ("tick", "service_busy", "service_share", "batch_share", "service_target",
           "batch_target")


def _target(status: Mapping[tuple[str, int], DeviceStatus], alloc_id: str | None) -> float:
    decided = status.get((alloc_id, 0)) if alloc_id is not None else None
    return decided.target if decided is not None else 0.0

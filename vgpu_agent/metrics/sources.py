"""What the metrics read, as one explicit object: every other part of the agent is reached only
through the callables and views here, so the collectors can be tested with stand-ins and the
agent decides the wiring.

Every callable is called on the event loop (never from a worker thread) and must be cheap: it
returns what its owner already holds in memory. A source the agent does not have (no throttle
controller, no PodResources client) is left at its default and its series are simply absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from vgpu_agent.gpu.model import GpuInfo
from vgpu_agent.shm.api import RegionHandle

# (namespace, pod, container) of the container an allocation serves
Identity = tuple[str, str, str]


class ThrottleStatus(Protocol):
    """The throttle controller's last decision for one device of one allocation."""

    @property
    def measured_util(self) -> float | None:
        """Percent of the GPU's SM time the container used (NVML per-process samples, mapped)."""

    @property
    def rate(self) -> int:
        """Refill rate written for the device, tokens per second."""

    @property
    def open_loop(self) -> bool:
        """True while the GPU gives no per-process samples (rates are not steered by use)."""

    @property
    def target(self) -> float:
        """Percent of the GPU's SM time the controller steers the container to."""

    @property
    def policy(self) -> str:
        """The core policy the controller applied."""

    @property
    def rate_limited(self) -> bool:
        """True when the container wanted more than its target in the last tick."""

    @property
    def paused(self) -> bool:
        """True while the container is paused for a neighbour's turn alone on its GPU."""


class RegistrationView(Protocol):
    """The device plugin's standing with the kubelet."""

    @property
    def registered(self) -> bool: ...

    @property
    def registrations(self) -> int: ...

    @property
    def kubelet_restarts(self) -> int: ...

    @property
    def last_error(self) -> str: ...


class TaskView(Protocol):
    """Liveness of the agent's supervised tasks."""

    @property
    def running(self) -> set[str]: ...

    @property
    def restarts(self) -> dict[str, int]: ...

    @property
    def cpu_seconds(self) -> dict[str, float]:
        """Per task, the event loop thread's CPU its own steps took (`cpumeter.CpuMeter`)."""

    @property
    def loop_heartbeat(self) -> float:
        """`time.monotonic()` of the event loop's last heartbeat."""


def _no_regions() -> Iterable[RegionHandle]:
    return ()


def _no_identity(alloc_id: str) -> Identity | None:
    return None


def _empty() -> Mapping[str, int]:
    return {}


@dataclass
class MetricsSources:
    """Where each metric comes from. `gpus` is empty until the GPU backend has started."""

    node: str
    gpus: Callable[[], Sequence[GpuInfo]]
    slices_per_gpu: int
    regions: Callable[[], Iterable[RegionHandle]] = _no_regions
    identity: Callable[[str], Identity | None] = _no_identity
    healthy: Callable[[], Mapping[str, bool]] | None = None
    xid_counts: Callable[[], Mapping[str, int]] | None = None
    throttle_status: Callable[[], Mapping[tuple[str, int], ThrottleStatus]] | None = None
    # GPUs whose NVML samples the throttle controller reads as time-sliced, and per GPU the
    # changes of phase its split found (`ThrottleController.time_sliced_gpus`, `phase_changes`)
    time_sliced_gpus: Callable[[], Iterable[str]] | None = None
    phase_changes: Callable[[], Mapping[str, int]] | None = None
    # GPUs whose use NVML gives only to processes no container claims while containers spend
    # (`ThrottleController.use_only_strangers_gpus`)
    use_only_strangers_gpus: Callable[[], Iterable[str]] | None = None
    # per time-sliced GPU, the points of its use charged to nobody at the last batch
    # (`ThrottleController.use_charged_to_nobody`)
    use_charged_to_nobody: Callable[[], Mapping[str, float]] | None = None
    # per GPU, the turns alone the controller gave (`ThrottleController.solo_turns_given`)
    solo_turns: Callable[[], Mapping[str, int]] | None = None
    # per time-sliced GPU, the containers spending without a trusted figure
    # (`ThrottleController.unmeasured_containers`)
    unmeasured: Callable[[], Mapping[str, int]] | None = None
    # per GPU read so far, NVML's sample period in seconds (`ThrottleController.
    # nvml_sample_periods`)
    sample_periods: Callable[[], Mapping[str, float]] | None = None
    # per GPU read so far, NVML's sample periods between two asks now (`ThrottleController.
    # nvml_poll_periods_now`)
    poll_periods: Callable[[], Mapping[str, int]] | None = None
    # per GPU asked so far, NVML's per-process utilization calls and the seconds they took
    # (`ThrottleController.nvml_utilization_calls`)
    nvml_utilization_calls: Callable[[], Mapping[str, tuple[int, float]]] | None = None
    throttle_ticks: Callable[[], int] | None = None  # the controller's ticks since start
    registration: Callable[[], RegistrationView | None] | None = None
    nvml_errors: Callable[[], Mapping[str, int]] = _empty
    region_events: Callable[[], Mapping[str, int]] = _empty  # created/adopted/removed/corrupt
    pod_resources_failures: Callable[[], int] | None = None
    tasks: Callable[[], TaskView | None] | None = None
    backend_error: Callable[[], str] | None = None
    # DRA: region alloc_id -> (claim namespace, claim name, claim uid) of its prepared claim
    claims: Callable[[], Mapping[str, tuple[str, str, str]]] | None = None
    allocate_error: Callable[[], str] | None = None  # why Allocate cannot work now, "" if it can
    # "pod" when the region's core policy and priority are its pod's choice, else "default"
    policy_source: Callable[[str], str] | None = None

"""/healthz and /readyz decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

from vgpu_agent.metrics.probes import liveness, readiness
from vgpu_agent.metrics.sources import MetricsSources


@dataclass
class Tasks:
    running: set[str] = field(default_factory=lambda: {"device-plugin", "health"})
    restarts: dict[str, int] = field(default_factory=dict)
    loop_heartbeat: float = 100.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Registration:
    registered: bool = True
    registrations: int = 1
    kubelet_restarts: int = 0
    last_error: str = ""


def _sources(tasks: Tasks | None = None, registration: Registration | None = None,
             backend_error: str = "") -> MetricsSources:
    return MetricsSources(
        node="n", gpus=lambda: (), slices_per_gpu=1,
        tasks=lambda: tasks, registration=lambda: registration,
        backend_error=lambda: backend_error,
    )


def test_live_while_the_loop_beats_and_tasks_run() -> None:
    ok, lines = liveness(_sources(Tasks()), now=101.0)
    assert ok and "device-plugin" in lines[0]


def test_not_live_when_the_heartbeat_is_old() -> None:
    ok, lines = liveness(_sources(Tasks(loop_heartbeat=50.0)), now=100.0)
    assert not ok and "50.0 s ago" in lines[0]


def test_not_live_while_a_task_waits_to_restart() -> None:
    tasks = Tasks(running={"health"}, restarts={"device-plugin": 3, "health": 1})
    ok, lines = liveness(_sources(tasks), now=100.5)
    assert not ok
    assert lines == ["task device-plugin: failed 3 times, waiting to restart"]


def test_ready_needs_registration_and_backend() -> None:
    assert readiness(_sources(registration=Registration()))[0]
    ok, lines = readiness(_sources(registration=None, backend_error="nvmlInit failed: driver"))
    assert not ok
    assert lines == ["gpu backend: not up: nvmlInit failed: driver",
                     "kubelet registration: device plugin not started"]
    ok, lines = readiness(
        _sources(registration=Registration(registered=False, last_error="connect refused"))
    )
    assert not ok and lines == ["kubelet registration: not registered (last error: connect refused)"]

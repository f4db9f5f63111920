"""/healthz and /readyz answers, from the same `MetricsSources` the metrics read.

Live: the event loop keeps beating and no supervised task is stuck in its restart backoff.
Ready: the GPU backend is up, the device plugin is registered with the kubelet and the last
attempt to create a region (an Allocate's, or a spare's made after one) did not fail.
Each answer lists, one line per part, what is wrong, so `kubectl describe` shows the reason.
"""

from __future__ import annotations

import time

from vgpu_agent.metrics.sources import MetricsSources

DEFAULT_MAX_HEARTBEAT_AGE_S = 10.0


def liveness(
    sources: MetricsSources,
    now: float | None = None,
    max_heartbeat_age_s: float = DEFAULT_MAX_HEARTBEAT_AGE_S,
) -> tuple[bool, list[str]]:
    tasks = sources.tasks() if sources.tasks else None
    if tasks is None:
        return True, ["event loop: answering"]
    now = time.monotonic() if now is None else now
    problems = []
    age = now - tasks.loop_heartbeat
    if age > max_heartbeat_age_s:
        problems.append(
            f"event loop: last heartbeat {age:.1f} s ago (allowed {max_heartbeat_age_s:.0f} s)"
        )
    running = set(tasks.running)
    for name, restarts in sorted(tasks.restarts.items()):
        if restarts > 0 and name not in running:
            problems.append(f"task {name}: failed {restarts} times, waiting to restart")
    if problems:
        return False, problems
    return True, [f"event loop: beating; tasks running: {', '.join(sorted(running)) or 'none'}"]


def readiness(sources: MetricsSources) -> tuple[bool, list[str]]:
    problems = []
    error = sources.backend_error() if sources.backend_error else ""
    if error:
        problems.append(f"gpu backend: not up: {error}")
    registration = sources.registration() if sources.registration else None
    if registration is None:
        problems.append("kubelet registration: device plugin not started")
    elif not registration.registered:
        detail = f" (last error: {registration.last_error})" if registration.last_error else ""
        problems.append(f"kubelet registration: not registered{detail}")
    allocate = sources.allocate_error() if sources.allocate_error else ""
    if allocate:
        problems.append(f"allocate: regions cannot be created: {allocate}")
    if problems:
        return False, problems
    return True, ["gpu backend: up", "kubelet registration: registered"]

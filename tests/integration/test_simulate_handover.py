"""The demo's shared GPU in simulated time: a work-conserving batch job borrows what an idle
strict service leaves, and gives it back within a tick when the service is busy again.

Real pieces on one simulated clock: a `RegionStore`'s region files, the pods' annotations written
into them by `RegionPolicies`, the agent's controller, and the demo's simulated processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.shm.regions import RegionStore
from vgpu_agent.simulation.demo import DemoWorkloads
from vgpu_agent.simulation.handover import BATCH_WORKLOAD, HandoverLog, service_workload
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.podpolicy import PodInfo, PodPolicyRules
from vgpu_agent.throttle.regionpolicy import RegionPolicies

PHASE_S = 3.0
PODS = {
    ("demo", "inference"): PodInfo("u1", "demo", "inference", {
        "vgpu.io/core-policy": "strict", "vgpu.io/priority": "50"}),
    ("demo", "batch"): PodInfo("u2", "demo", "batch", {"vgpu.io/core-policy": "work-conserving"}),
}


class Pods:
    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return PODS.get((namespace, name))


async def test_batch_borrows_idle_compute_and_gives_it_back_within_a_tick(tmp_path: Path) -> None:
    clock = [9_000 * 10**9]
    store = RegionStore(tmp_path, default_policy="strict", clock=lambda: clock[0])
    backend = SimBackend("1xA100-80GB")
    backend.start()
    uuid = backend.uuids[0]
    regions = {}
    for n, pod in enumerate(("inference", "batch")):
        grant = Grant((f"{uuid}::{n}",), (GrantedDevice(uuid, 0, 1, 8 << 30, 25.0),))
        regions[pod] = store.create(grant)
    await store.reconcile({f"{uuid}::0": ("demo", "inference", "server"),
                           f"{uuid}::1": ("demo", "batch", "train")})
    rules = PodPolicyRules(priority_namespaces=frozenset({"demo"}))
    RegionPolicies(store.regions, store.identity, rules, pods=Pods()).apply()
    assert (regions["inference"].policy(0), regions["inference"].priority) == ("strict", 50)
    assert regions["batch"].policy(0) == "work-conserving"

    # the simulated node proves which container runs each simulated process (its /proc, here)
    controller = ThrottleController(backend, store.regions, tick_s=0.1, clock=lambda: clock[0],
                                    evidence=backend)
    by_pod = {r.alloc_id: pod for pod, r in regions.items()}
    workloads = {"inference": (service_workload(PHASE_S), 0.3), "batch": (BATCH_WORKLOAD, 0.3)}
    demo = DemoWorkloads(store.regions, backend, clock=lambda: clock[0],
                         host_pids=iter(range(4_100_000, 4_100_010)),
                         workload_for=lambda alloc_id: workloads[by_pod[alloc_id]])
    handover = HandoverLog(lambda pod: regions[pod].alloc_id, lambda: controller.status)
    with capture_logs() as logs:
        for step in range(round(4.5 * PHASE_S / 0.025)):  # idle, busy, idle, busy, half idle
            clock[0] += 25_000_000
            demo.step()
            handover(demo)
            if step % 4 == 3:
                await controller.tick()
    demo.close()
    store.close()

    lines = [e for e in logs if e["event"] == "demo_handover"]
    assert lines and len(lines) == len(handover.logged)
    episodes: list[list] = []
    for shares in handover.logged:
        if shares.tick == -1:
            episodes.append([])
        episodes[-1].append(shares)
    # busy, idle, busy, idle: the first busy phase is the service's cold start (the controller
    # learns its tokens-per-percent then); from the second on it is served at once
    assert [e[1].service_busy for e in episodes] == [True, False, True, False]
    busy_again, idle_again = episodes[2], episodes[3]
    before, first, *after = busy_again
    # Before: the service idle, the batch job on the whole GPU though its slice is 25%.
    assert before.service_share < 1 and before.batch_share > 90
    # In the tick the service turns busy it is served, and the batch job gives back the loan.
    assert first.service_share >= 20 and first.batch_share <= 80
    assert first.batch_target == pytest.approx(75, abs=1)
    for shares in after:
        assert shares.service_share == pytest.approx(25, abs=3), busy_again
        # a full simulated GPU loses 1.25 % to context switches between the two
        assert shares.batch_share == pytest.approx(75 * 0.9875, abs=3), busy_again
    # And when the service is idle again the batch job borrows the GPU back within a few ticks.
    assert idle_again[-1].batch_share > 90 and idle_again[-1].service_share < 1, idle_again

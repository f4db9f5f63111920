"""The agent's own limit check, which no shim setting switches off: a container whose processes
hold more GPU memory than allowed (the shim disabled, a static binary), or that runs a strict
share far above its limit, is found through NVML and the host's /proc, and only that container."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from pathlib import Path

from tests.fakes.hostproc import FakeHostProc
from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.throttle.backstop import BackstopParams, Breach
from vgpu_agent.throttle.identity import Attributor, NamespacePidResolver, ProcEvidence
from vgpu_agent.throttle.watch import BackstopWatch

GIB = 1 << 30
UUID = "GPU-eeeeeeee-0000-0000-0000-000000000005"


@dataclass(frozen=True)
class Status:
    limit: float
    policy: str
    measured_util: float | None


class Nvml:
    def __init__(self) -> None:
        self.procs: list[tuple[int, int | None]] = []
        self.fail = False

    def running_processes(self, uuid: str) -> list[tuple[int, int | None]]:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return list(self.procs) if uuid == UUID else []


class Node:
    def __init__(self, root: Path):
        self.host = FakeHostProc(root / "proc")
        self.nvml = Nvml()
        self.regions: dict[str, Region] = {}
        self.status: dict[tuple[str, int], Status] = {}
        self.reported: list[Breach] = []
        self.now = 0.0
        self.root = root
        self.watch = BackstopWatch(
            self.nvml, lambda: list(self.regions.values()), lambda: self.status,
            Attributor(ProcEvidence(self.host.path), NamespacePidResolver(self.host.path),
                       budget_slots=False),
            self.reported.append, params=BackstopParams(window_s=10, context_bytes=GIB // 2),
            clock=lambda: self.now,
        )

    def container(self, name: str, seq: int, memory: int) -> Region:
        ids = [f"{UUID}::{seq}"]
        alloc_id = format_alloc_id(seq, ids, seq)
        make_region(self.root / "regions", alloc_id, [DeviceSpec(UUID, memory, 25.0, "strict")],
                    ids, seq=seq)
        region = self.regions[name] = Region.open(self.root / "regions" / alloc_id)
        return region

    def close(self) -> None:
        for region in self.regions.values():
            region.close()


async def test_a_container_bypassing_its_shim_is_found_by_nvml_memory_and_only_it(tmp_path):
    node = Node(tmp_path)
    victim = node.container("victim", 1, 8 * GIB)
    rogue = node.container("rogue", 2, 4 * GIB)
    node.host.container_process(9_001, victim.path)
    node.host.container_process(9_002, rogue.path)  # VGPU_DISABLE: no slot, nothing in state
    node.host.container_process(9_003, rogue.path, inner_pid=2)
    # and it claims the victim's process in its state, to push its use onto the victim
    writer = ShimWriter(rogue.path)
    writer.process(0, 1, 9_001, 0)
    try:
        node.nvml.procs = [(9_001, 6 * GIB), (9_002, 3 * GIB), (9_003, 3 * GIB)]
        found = await node.watch.check()
        assert [(b.alloc_id, b.kind) for b in found] == [(rogue.alloc_id, "memory")]
        assert found[0].measured == 6 * GIB and found[0].allowed == 5 * GIB  # 4 + 2 x 0.5
        assert node.reported == found and node.watch.breaches == {"memory": 1, "sm": 0}
        assert await node.watch.check() == []  # one report per episode
        node.nvml.procs = [(9_001, 6 * GIB), (9_002, GIB)]
        assert await node.watch.check() == []  # back under: the episode ends
        node.nvml.procs = [(9_001, 6 * GIB), (9_002, 7 * GIB)]
        assert [b.alloc_id for b in await node.watch.check()] == [rogue.alloc_id]
    finally:
        writer.close()
        node.close()


async def test_a_strict_share_far_above_its_limit_is_a_breach_after_the_window(tmp_path):
    node = Node(tmp_path)
    a = node.container("a", 1, 8 * GIB)
    node.status = {(a.alloc_id, 0): Status(25.0, "strict", 90.0)}
    try:
        seen: list[Breach] = []
        for second in range(12):
            node.now = float(second)
            seen += await node.watch.check()
        assert [(b.kind, round(b.measured)) for b in seen] == [("sm", 90)]
    finally:
        node.close()


async def test_nvml_failing_is_counted_and_judges_nothing(tmp_path):
    node = Node(tmp_path)
    region = node.container("a", 1, GIB)
    node.host.container_process(9_001, region.path)
    node.nvml.procs = [(9_001, 50 * GIB)]
    node.nvml.fail = True
    try:
        assert await node.watch.check() == []
        assert node.watch.nvml_errors == 1
        node.nvml.fail = False
        assert len(await node.watch.check()) == 1
    finally:
        node.close()


async def test_unknown_per_process_memory_is_no_breach(tmp_path):
    node = Node(tmp_path)
    region = node.container("a", 1, GIB)
    node.host.container_process(9_001, region.path)
    node.nvml.procs = [(9_001, None), (9_001, 50 * GIB)]
    try:
        assert await node.watch.check() == []
    finally:
        node.close()


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.submitted += 1
        return super().submit(*args, **kwargs)


async def test_with_no_containers_a_round_wakes_no_worker_thread(tmp_path):
    node = Node(tmp_path)
    executor = CountingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    try:
        for _ in range(3):
            assert await node.watch.check() == []
        assert executor.submitted == 0
        region = node.container("a", 1, GIB)  # a container: NVML is read in the worker again
        node.host.container_process(9_001, region.path)
        node.nvml.procs = [(9_001, 50 * GIB)]
        assert len(await node.watch.check()) == 1
        assert executor.submitted == 1
    finally:
        node.close()

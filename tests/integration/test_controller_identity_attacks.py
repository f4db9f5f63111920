"""A container cannot take another's GPU use: attribution rests on the host's /proc, not on
what a container writes in its `state` slots.

Each attack runs next to the same node without it, on the same inputs: the victim's measured
use, target and rate must come out identical, and the lie is counted for the liar.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.fakes.hostproc import FakeHostProc, in_filesystem, mount_line, region_mounts
from tests.fakes.shimstate import DeviceSpec, ShimWriter, make_region
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.throttle.controller import ThrottleController

GIB = 1 << 30
UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
VICTIM_PID, ATTACKER_PID, STRANGER_PID = 5_000, 5_001, 5_002


class Samples:
    def __init__(self, util: dict[int, int]):
        self.util = util
        self.now_us = 1_000
        self.lock = threading.Lock()

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        with self.lock:
            self.now_us += 100_000
            return [ProcessSample(pid, self.now_us, u) for pid, u in self.util.items()]


class Node:
    """Real region files, a fake host /proc, the real controller; the shim played by writers."""

    def __init__(self, root: Path, util: dict[int, int]):
        self.root = root
        self.host = FakeHostProc(root / "proc")
        self.regions: dict[str, Region] = {}
        self.shims: dict[str, ShimWriter] = {}
        self.spent: dict[str, int] = {}
        self.ns = 10**12
        self.backend = Samples(util)
        self.controller = ThrottleController(
            self.backend, lambda: list(self.regions.values()), clock=lambda: self.ns,
            proc_root=self.host.path,
        )

    def container(self, name: str, seq: int, limit: float = 30.0) -> Region:
        ids = [f"{UUID}::{seq}"]
        alloc_id = format_alloc_id(seq, ids, 1_000 + seq)
        make_region(self.root / "regions", alloc_id, [DeviceSpec(UUID, 4 * GIB, limit, "strict")],
                    ids, seq=seq)
        region = self.regions[name] = Region.open(self.root / "regions" / alloc_id)
        self.shims[name] = ShimWriter(region.path)
        self.spent[name] = 0
        return region

    async def tick(self, spend: dict[str, int]) -> None:
        for name, tokens in spend.items():
            self.spent[name] += tokens
            self.shims[name].device_totals(0, memory=0, tokens=self.spent[name])
        self.ns += 100_000_000
        await self.controller.tick()

    def status(self, name: str) -> tuple[float | None, float, int, int]:
        s = self.controller.status[(self.regions[name].alloc_id, 0)]
        return s.measured_util, s.target, s.rate, s.burst

    def close(self) -> None:
        for shim in self.shims.values():
            shim.close()
        for region in self.regions.values():
            region.close()


def two_containers(root: Path) -> Node:
    node = Node(root, {VICTIM_PID: 30, ATTACKER_PID: 10, STRANGER_PID: 40})
    victim = node.container("victim", 1)
    attacker = node.container("attacker", 2)
    node.host.container_process(VICTIM_PID, victim.path, inner_pid=7, start=1111)
    node.host.container_process(ATTACKER_PID, attacker.path, inner_pid=7, start=2222)
    node.host.process(STRANGER_PID, start=3333)  # a host process, in no container
    node.shims["victim"].process(0, 7, VICTIM_PID, 0)
    node.shims["attacker"].process(0, 7, ATTACKER_PID, 0)
    return node


async def run_side_by_side(  # type: ignore[no-untyped-def]
    tmp_path: Path, attack, attacker_unchanged: bool = True
) -> tuple[Node, Node]:
    honest = two_containers(tmp_path / "honest")
    attacked = two_containers(tmp_path / "attacked")
    attack(attacked)
    spend = {"victim": 3_000_000, "attacker": 1_000_000}
    for _ in range(12):
        await honest.tick(spend)
        await attacked.tick(spend)
        assert attacked.status("victim") == honest.status("victim")
        if attacker_unchanged:
            assert attacked.status("attacker") == honest.status("attacker")
    return honest, attacked


async def test_a_slot_claiming_the_victims_host_pid_takes_nothing_from_it(tmp_path):
    def claim_victim(node: Node) -> None:
        node.shims["attacker"].process(1, 8, VICTIM_PID, 0)

    honest, attacked = await run_side_by_side(tmp_path, claim_victim)
    try:
        assert attacked.status("victim")[0] == 30
        assert attacked.status("attacker")[0] == 10
        victim_rate = attacked.status("victim")[2]
        assert 0 < victim_rate < 1 << 52  # steered, not left unlimited
        rejected = attacked.controller.attributor.rejected
        assert rejected == {attacked.regions["attacker"].alloc_id: 1}
        assert attacked.controller.attributor.rejected_total == 1  # counted once, not per tick
        assert honest.controller.attributor.rejected_total == 0
    finally:
        honest.close()
        attacked.close()


async def test_a_slot_claiming_the_victims_namespace_pid_and_start_time_is_rejected(tmp_path):
    def claim_victim(node: Node) -> None:
        node.shims["attacker"].process(1, 7, 0, 0)  # host pid unknown: in-container pid only
        _set_start_time(node.shims["attacker"], 1, 1111)  # the victim's start time

    honest, attacked = await run_side_by_side(tmp_path, claim_victim)
    try:
        assert attacked.status("victim")[0] == 30
        assert attacked.controller.attributor.rejected == {
            attacked.regions["attacker"].alloc_id: 1
        }
    finally:
        honest.close()
        attacked.close()


@pytest.mark.parametrize("where", ["same disk, own directory", "own tmpfs, the victim's path"])
async def test_a_mount_of_a_look_alike_control_file_proves_nothing(tmp_path, where):
    # In a mount namespace of its own, the attacker mounts a file of its own at the region path:
    # from its volume on the state dir's disk, in a directory named like the victim's region, or
    # from a filesystem of its own at exactly the victim's path.
    def forge(node: Node) -> None:
        victim = node.regions["victim"]
        assert victim.control_dev is not None
        real = in_filesystem(victim.path / "control")
        if where.startswith("same disk"):
            dev, root = victim.control_dev, f"/kubelet/pods/p/x/regions/{victim.alloc_id}/control"
        else:
            dev, root = _other_dev(victim.control_dev), real
        forged = mount_line(1300, dev, root, "/run/vgpu/control")
        node.host.process(ATTACKER_PID, inner_pid=7, start=2222,
                          mounts=region_mounts(node.regions["attacker"].path) + forged)
        node.shims["attacker"].process(0, 7, 0, 0)

    honest, attacked = await run_side_by_side(tmp_path, forge, attacker_unchanged=False)
    try:
        assert attacked.status("victim")[0] == 30
        # Its process now proves no region: the attacker only lost its own measurement.
        assert attacked.status("attacker")[0] == 0
    finally:
        honest.close()
        attacked.close()


async def test_same_pid_and_start_time_in_two_containers_never_merges_them(tmp_path):
    # Every container runs its main process as pid 1, and these started in the same second.
    node = Node(tmp_path, {6_001: 20, 6_002: 45})
    a = node.container("a", 1)
    b = node.container("b", 2)
    node.host.container_process(6_001, a.path, inner_pid=1, start=500)
    node.host.container_process(6_002, b.path, inner_pid=1, start=500)
    node.shims["a"].process(0, 1, 0, 0)
    node.shims["b"].process(0, 1, 0, 0)
    _set_start_time(node.shims["a"], 0, 500)
    _set_start_time(node.shims["b"], 0, 500)
    try:
        for _ in range(3):
            await node.tick({"a": 1_000, "b": 2_000})
        assert node.status("a")[0] == 20
        assert node.status("b")[0] == 45
        assert node.controller.attributor.rejected_total == 0
    finally:
        node.close()


async def test_a_process_without_any_slot_is_still_its_containers(tmp_path):
    # A static binary, or the shim switched off: no slot, the host still knows its container.
    node = Node(tmp_path, {7_001: 60})
    region = node.container("bypass", 1)
    node.host.container_process(7_001, region.path)
    try:
        await node.tick({"bypass": 0})
        assert node.status("bypass")[0] == 60
    finally:
        node.close()


async def test_a_vanished_process_is_unattributed_and_a_cgroup_sibling_of_a_proven_one_counts(
    tmp_path,
):
    node = Node(tmp_path, {8_001: 10, 8_002: 15, 8_003: 70})
    region = node.container("c", 1)
    cgroup = "0::/kubepods/burstable/pod42/cri-containerd-abc\n"
    node.host.container_process(8_001, region.path, cgroup=cgroup)
    # 8002: mount table unreadable (exited between NVML's sample and the read), same cgroup
    d = node.host.process(8_002, cgroup=cgroup)
    (d / "mountinfo").unlink()
    # 8003: unreadable too, in another cgroup, and claimed by the region's state
    d = node.host.process(8_003, cgroup="0::/kubepods/besteffort/pod9/cri-containerd-zzz\n")
    (d / "mountinfo").unlink()
    node.shims["c"].process(0, 3, 8_003, 0)
    try:
        await node.tick({"c": 0})
        assert node.status("c")[0] == 25
        assert node.controller.attributor.rejected_total == 0  # nothing to refute it with
    finally:
        node.close()


def _set_start_time(shim: ShimWriter, slot: int, start: int) -> None:
    import struct

    from vgpu_agent.shm import layout

    base = layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE
    struct.pack_into("<Q", shim._map, base + layout.SLOT_OFFSETS["start_time"], start)


def _other_dev(dev: int | None) -> int:
    import os

    assert dev is not None
    return os.makedev(0, 99) if dev != os.makedev(0, 99) else os.makedev(0, 98)


async def test_a_container_marking_every_slot_used_is_read_only_as_far_as_its_processes(tmp_path):
    from vgpu_agent.shm import layout
    from vgpu_agent.shm.regions import SLOT_HEADROOM

    node = Node(tmp_path, {VICTIM_PID: 30, ATTACKER_PID: 10, 5_003: 10})
    victim = node.container("victim", 1)
    attacker = node.container("attacker", 2)
    node.host.container_process(VICTIM_PID, victim.path)
    node.host.container_process(ATTACKER_PID, attacker.path, inner_pid=1)
    node.host.container_process(5_003, attacker.path, inner_pid=2)
    node.shims["victim"].process(0, 1, VICTIM_PID, 0)
    try:
        for tick in range(6):
            for slot in range(layout.MAX_PROCS):  # every slot "used", counters churning
                node.shims["attacker"].process(slot, 10 + slot, 0, 0, launches=tick + slot,
                                               wait_ns=tick, tokens=tick)
            await node.tick({"victim": 3_000_000, "attacker": 1_000_000})
        # two proven processes: their slots and the headroom are read, never the 1,024
        assert attacker.slot_budget == SLOT_HEADROOM + 2
        assert len(attacker.usage().processes) == SLOT_HEADROOM + 2
        assert victim.slot_budget == SLOT_HEADROOM + 1
        assert node.status("victim")[0] == 30 and node.status("attacker")[0] == 20
    finally:
        node.close()

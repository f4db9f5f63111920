"""The controller on real region files: it writes rates and heartbeats into `control`, reads the
shim's `state`, survives a corrupt `state`, and an agent restart keeps the rate in force.

The simulated GPU plays the shim: before each step it reads the rate from `control` and after it
writes its process slots and device totals into `state`, in the ABI layout.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import CONTROL_FILE, STATE_FILE, Region, format_alloc_id
from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, SimProcess, Workload
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle.controller import ThrottleController

UUID = "GPU-11111111-2222-3333-4444-555555555555"


def make_region_dir(root: Path, limit_pct: float, policy: int) -> Path:
    alloc_id = format_alloc_id(1, (f"{UUID}::0",), 42)
    path = root / alloc_id
    path.mkdir()
    control = layout.Control(
        devices=(layout.ControlDevice(
            uuid=UUID, core_limit=round(limit_pct * layout.CORE_LIMIT_FULL / 100), policy=policy,
        ),),
        device_ids=(f"{UUID}::0",),
        seq=1,
        created_ns=42,
    )
    (path / CONTROL_FILE).write_bytes(layout.encode_control(control))
    (path / STATE_FILE).write_bytes(layout.encode_state(1))
    return path


class FileShim:
    """Carries rates from `control` to the simulated bucket and usage from it to `state`."""

    def __init__(self, path: Path, region: Region, sim: SimRegion):
        self.path, self.region, self.sim = path, region, sim

    def before_step(self) -> None:
        self.sim.rates[0] = self.region.rate(0)

    def after_step(self) -> None:
        with open(self.path / STATE_FILE, "r+b") as f:
            buf = bytearray(f.read())
            dev = layout.STATE_OFFSETS["devices"]
            total = sum(p.tokens_spent[0] for p in self.sim.processes)
            struct.pack_into("<qQ", buf, dev, self.sim.balances[0], self.sim.last_refill_ns[0])
            struct.pack_into("<Q", buf, dev + layout.STATE_DEVICE_OFFSETS["tokens_spent"], total)
            # the totals over all processes the shim keeps in the header, as the shim does
            for name in ("launches", "wait_ns"):
                struct.pack_into("<Q", buf, dev + layout.STATE_DEVICE_OFFSETS[name],
                                 sum(getattr(p, name)[0] for p in self.sim.processes))
            mark = layout.STATE_OFFSETS["slot_high_water"]
            count = len(self.sim.processes)
            layout.store_u64(buf, mark, max(layout.load_u64(buf, mark), count))  # as the shim
            for i, p in enumerate(self.sim.processes):
                base = layout.STATE_OFFSETS["slots"] + i * layout.SLOT_SIZE
                struct.pack_into("<QQ", buf, base, p.pid, p.host_pid)
                struct.pack_into("<5Q", buf, base + layout.SLOT_OFFSETS["devices"], 0,
                                 p.launches[0], p.tokens_spent[0], p.wait_ns[0],
                                 p.last_launch_ns[0])
            f.seek(0)
            f.write(buf)


class Setup:
    def __init__(self, tmp_path: Path, limit: float = 30.0, policy: int = layout.POLICY_STRICT):
        self.path = make_region_dir(tmp_path, limit, policy)
        self.region = Region.open(self.path)
        self.gpu = SimGpu(UUID)
        self.sim = SimRegion(self.region.alloc_id, (UUID,), (limit,), (self.region.policy(0),))
        self.proc: SimProcess = self.gpu.shim_process("c", Workload(kernel_s=0.002), self.sim)
        self.shim = FileShim(self.path, self.region, self.sim)
        self.controller = self.new_controller()

    def new_controller(self) -> ThrottleController:
        return ThrottleController(SimBackend([self.gpu]), lambda: [self.region],
                                  clock=lambda: self.gpu.now_ns,
                                  evidence=SimHostEvidence([self.gpu]))

    async def run(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.1)):
            self.shim.before_step()
            self.gpu.advance(0.1)
            self.shim.after_step()
            await self.controller.tick()

    def share(self, last_s: float) -> float:
        return self.gpu.shares(self.proc, last_s)[-1][1]


async def test_controller_holds_a_strict_limit_through_the_region_files(tmp_path):
    s = Setup(tmp_path)
    generation = s.region.generation
    await s.run(5)
    assert s.share(2) == pytest.approx(30, abs=1.5)
    control = layout.decode_control((s.path / CONTROL_FILE).read_bytes())
    assert 0 <= s.gpu.now_ns - control.heartbeat_ns < 10**9  # once a second
    assert control.generation > generation and control.generation % 2 == 0
    assert (control.devices[0].rate, control.devices[0].burst) == s.region.rate(0)
    assert 0 < control.devices[0].rate < 1 << 40  # a real, finite rate
    # The limits the allocation was granted are never rewritten.
    assert control.devices[0].core_limit == 300_000
    assert control.devices[0].policy == layout.POLICY_STRICT


async def test_agent_restart_keeps_the_rate_in_force_and_the_share(tmp_path):
    s = Setup(tmp_path)
    await s.run(5)
    rate_before = s.region.rate(0)
    # A new agent: the region is adopted from its files, a controller starts from scratch.
    s.region.close()
    s.region = Region.open(s.path)
    s.shim.region = s.region
    s.controller = s.new_controller()
    await s.run(0.5)
    assert s.region.rate(0) == rate_before  # kept until learned, never reset to "unlimited"
    await s.run(2.5)
    assert s.share(3) == pytest.approx(30, abs=1.5)


async def test_a_corrupt_state_file_is_counted_and_the_rate_left_alone(tmp_path):
    s = Setup(tmp_path)
    await s.run(4)
    rate_before = s.region.rate(0)
    s.shim.after_step = lambda: (s.path / STATE_FILE).write_bytes(b"\x00garbage" * 100)
    await s.run(1)
    assert s.controller.error_counts["region_corrupt"] == 10
    assert s.region.rate(0) == rate_before
    assert 0 <= s.gpu.now_ns - s.region.heartbeat_ns < 10**9  # still beaten, once a second

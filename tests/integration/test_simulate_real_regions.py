"""`vgpu-agent simulate`'s workloads on the agent's real region files: the simulated processes
write their slots, counters and bucket into `state` as the shim does, spend by the rate the
controller writes into `control`, serve their samples through the agent's simulated backend, and
the agent's own controller brings each container to its limit.

Most tests run in simulated time (the controller and the demo share a clock that the test moves);
one runs the whole agent with the kubelet stand-in in real time, as `simulate` does.
"""

from __future__ import annotations

import asyncio
import re
import struct
import urllib.request
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.fakes.clock import ManualClock
from tests.integration.plugin_harness import RESOURCE, config_for, running_agent, short_dir
from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice, preferred_allocation
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.kubelet.standin import Admission
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import STATE_FILE, Region, RegionStore
from vgpu_agent.simulation.demo import DemoWorkloads, run_demo_workloads
from vgpu_agent.simulation.shimfile import RegionShim, ShimFileError
from vgpu_agent.throttle.controller import ThrottleController

GIB = 1 << 30
START_NS = 7_000 * 10**9


class Bench:
    """Regions from a real `RegionStore`, the agent's simulated backend, the real controller and
    the demo, all on one simulated clock."""

    def __init__(self, root: Path, spec: str = "2xA100-80GB"):
        self.clock = ManualClock(START_NS)
        self.store = RegionStore(root, default_policy="strict", clock=self.clock)
        self.backend = SimBackend(spec)
        self.backend.start()
        self.uuids = self.backend.uuids
        self.live: list[Region] = []
        self.unattributed: list[int] = []
        self.controller = ThrottleController(
            self.backend, lambda: list(self.live), tick_s=0.1, clock=self.clock,
            pid_resolver=lambda pid, known: self.unattributed.append(pid),
            evidence=self.backend,
        )
        pids = iter(range(4_000_000, 4_000_100))
        self.demo = DemoWorkloads(lambda: list(self.live), self.backend, clock=self.clock,
                                  controller_status=lambda: self.controller.status,
                                  host_pids=pids)

    def allocate(self, *devices: tuple[int, float], memory: int = 8 * GIB) -> Region:
        granted = tuple(
            GrantedDevice(self.uuids[gpu], gpu, 1, memory, limit) for gpu, limit in devices
        )
        ids = tuple(f"{d.uuid}::{len(self.live)}" for d in granted)
        region = self.store.create(Grant(ids, granted))
        self.live.append(region)
        return region

    async def run(self, seconds: float, *, controller: bool = True) -> None:
        for _ in range(round(seconds / 0.025)):
            self.clock.ns += 25_000_000
            self.demo.step()
            if controller and self.clock.ns % 100_000_000 == 0:
                await self.controller.tick()

    def close(self) -> None:
        self.demo.close()
        self.store.close()


@pytest.fixture
def bench(tmp_path):
    with capture_logs() as logs:
        b = Bench(tmp_path)
        b.logs = logs
        yield b
        b.close()


def last_refill_ns(path: Path, dev: int) -> int:
    data = (path / STATE_FILE).read_bytes()
    offset = (layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
              + layout.STATE_DEVICE_OFFSETS["last_refill_ns"])
    return struct.unpack_from("<Q", data, offset)[0]


async def test_the_agents_controller_brings_each_container_to_its_limit(bench):
    a = bench.allocate((0, 30.0))
    b = bench.allocate((0, 50.0))
    c = bench.allocate((1, 25.0), (0, 10.0))
    await bench.run(6)
    bench.demo.shares()
    readings: dict[tuple[str, int], list[float]] = {}
    for _ in range(30):  # 3 s, the status looked at every tick
        await bench.run(0.1)
        for key, device in bench.controller.status.items():
            if device.measured_util is not None:
                readings.setdefault(key, []).append(device.measured_util)
    shares = {(s.alloc_id, s.uuid): s for s in bench.demo.shares()}
    assert len(shares) == 4
    expected = {(a.alloc_id, 0): 30, (b.alloc_id, 0): 50, (c.alloc_id, 1): 25, (c.alloc_id, 0): 10}
    for (alloc_id, gpu), limit in expected.items():
        share = shares[(alloc_id, bench.uuids[gpu])]
        assert share.share == pytest.approx(limit, abs=2), share
        assert share.limit == pytest.approx(limit)
    # The status shows NVML's readings of each device (one reading scatters by 2-3 points
    # at these shares on the simulated GPU: their mean over the 3 s is compared with the SM
    # time each device really got then)
    gpu_of = {(a.alloc_id, 0): 0, (b.alloc_id, 0): 0, (c.alloc_id, 0): 1, (c.alloc_id, 1): 0}
    assert {k: sum(v) / len(v) for k, v in readings.items()} == pytest.approx(
        {(alloc_id, dev): shares[(alloc_id, bench.uuids[gpu])].share
         for (alloc_id, dev), gpu in gpu_of.items()},
        abs=3,  # tight enough to tell the devices apart (their shares are 5 points apart or more)
    )
    # Every sampled pid was found in a slot: the cgroup fallback was never asked.
    assert bench.unattributed == []
    # The simulated shim spends by what the controller wrote into `control`.
    for region in (a, b, c):
        shim = bench.demo.containers[region.alloc_id].shim
        assert shim.mirror.rates == [region.rate(d) for d in range(region.device_count)]
        assert all(rate > 0 for rate, _ in shim.mirror.rates)


async def test_state_files_show_what_the_processes_did(bench):
    region = bench.allocate((0, 40.0), (1, 20.0), memory=10 * GIB)
    await bench.run(2)
    usage = region.usage()  # the agent's own reader
    assert not usage.corrupt and usage.skipped_records == 0
    [proc] = usage.processes
    container = bench.demo.containers[region.alloc_id]
    assert proc.host_pid == container.process.counters.host_pid == 4_000_000
    assert proc.pid == 1 and proc.start_time > 0
    assert all(n > 0 for n in proc.launches) and all(t > 0 for t in proc.tokens_spent)
    assert all(0 < m <= 10 * GIB for m in proc.memory_used)
    assert usage.memory_used == proc.memory_used
    assert usage.tokens_spent == proc.tokens_spent
    assert all(START_NS < t <= bench.clock.ns for t in proc.last_launch_ns)
    # Held to a rate, the bucket is refilled lazily and never holds more than the burst.
    for dev in range(2):
        _, burst = region.rate(dev)
        assert usage.bucket_balance[dev] <= burst
        assert START_NS < last_refill_ns(region.path, dev) <= bench.clock.ns
    # NVML's view: samples of that pid on both GPUs, readings from the processes' use.
    for dev, uuid in enumerate(bench.uuids):
        samples = bench.backend.process_utilization(uuid, 0)
        assert samples and {s.pid for s in samples} == {proc.host_pid}
        readings = bench.backend.readings(uuid)
        assert readings.memory_used == proc.memory_used[dev]
        assert 0 < readings.utilization <= 1


async def test_the_rate_in_control_is_obeyed_and_followed_when_it_changes(bench):
    region = bench.allocate((0, 50.0))
    await bench.run(0.2, controller=False)  # no controller: the test writes the rates
    cost = 1024 * 256  # the first demo workload's kernels
    spent = []
    for rate in (40 * cost, 120 * cost):
        region.set_rate(0, rate, 2 * cost)
        await bench.run(0.1, controller=False)  # the bucket settles at the new rate
        before = region.usage().tokens_spent[0]
        await bench.run(2, controller=False)
        spent.append((region.usage().tokens_spent[0] - before) / 2)
    assert spent[0] == pytest.approx(40 * cost, rel=0.05)
    assert spent[1] == pytest.approx(120 * cost, rel=0.05)


async def test_allocations_that_come_get_a_process_and_those_that_go_give_it_back(bench):
    first = bench.allocate((0, 40.0))
    await bench.run(1)
    second = bench.allocate((0, 30.0))
    await bench.run(1)
    assert set(bench.demo.containers) == {first.alloc_id, second.alloc_id}
    assert len(second.usage().processes) == 1
    ended_pid = first.usage().processes[0].host_pid
    spent = first.usage().tokens_spent[0]
    bench.live.remove(first)
    await bench.run(1)
    assert set(bench.demo.containers) == {second.alloc_id}
    assert [p.name for p in bench.demo.gpus[bench.uuids[0]].processes] == [f"{second.alloc_id}/0"]
    # The ended process gave its slot and memory back; the device totals keep what it did.
    usage = first.usage()
    assert usage.processes == () and usage.memory_used == (0,)
    assert usage.tokens_spent[0] == spent > 0
    # Its samples are no longer served: nobody could attribute them.
    served = bench.backend.process_utilization(bench.uuids[0], 0)
    assert ended_pid not in {s.pid for s in served}
    assert bench.unattributed == []


async def test_a_new_process_in_a_used_region_counts_on_top_of_the_ended_ones(bench, tmp_path):
    region = bench.allocate((0, 40.0))
    await bench.run(1)
    bench.live.remove(region)
    await bench.run(0.1)
    before = region.usage()
    bench.live.append(region)  # the same region again: a fresh process in it
    await bench.run(1)
    after = region.usage()
    [proc] = after.processes
    assert after.tokens_spent[0] == before.tokens_spent[0] + proc.tokens_spent[0]
    assert proc.host_pid != 4_000_000  # a pid of its own


@pytest.mark.parametrize(
    ("damage", "complaint"),
    [
        (lambda p: (p / "state").write_bytes(b"short"), "a regular file of"),
        (lambda p: (p / "state").unlink(), "cannot open"),
        (lambda p: (p / "state").write_bytes(b"\0" * layout.STATE_SIZE), "magic"),
        (lambda p: (p / "state").write_bytes(layout.encode_state(3)), "3 devices, control has 1"),
    ],
)
async def test_a_region_with_broken_files_is_refused_and_the_others_run(bench, damage, complaint):
    broken = bench.allocate((0, 40.0))
    good = bench.allocate((1, 30.0))
    damage(broken.path)
    await bench.run(1)
    assert set(bench.demo.containers) == {good.alloc_id}
    assert complaint in bench.demo.refused[broken.alloc_id]
    warnings = [e for e in bench.logs if e["event"] == "demo_region_unusable"]
    assert [w["alloc_id"] for w in warnings] == [broken.alloc_id]  # once, not every tick
    assert good.usage().processes[0].launches[0] > 0
    bench.live.remove(broken)
    await bench.run(0.1)
    assert broken.alloc_id not in bench.demo.refused


def test_the_simulated_shim_refuses_a_control_file_of_another_format(tmp_path):
    (tmp_path / "control").write_bytes(b"x" * layout.CONTROL_SIZE)
    (tmp_path / "state").write_bytes(layout.encode_state(1))
    with pytest.raises(ShimFileError, match="magic"):
        RegionShim(tmp_path)


async def test_simulate_workloads_drive_the_agents_regions_metrics_and_controller():
    with short_dir() as root, capture_logs() as logs:
        async with running_agent(config_for(root)) as run:
            agent = run.agent

            async def admit(pod: str, policy: str) -> None:
                chosen = preferred_allocation(run.kubelet.free_devices(RESOURCE), [], 2, policy)
                response = await run.kubelet.allocate(RESOURCE, chosen)
                run.kubelet.admissions.append(
                    Admission("demo", pod, "main", RESOURCE, chosen, response)
                )

            await admit("spread-pod", "spread")
            demo = asyncio.create_task(run_demo_workloads(
                agent.regions.regions, agent.backend,
                controller_status=lambda: agent.controller.status,
                report_every_s=1.0, duration_s=7.0,
            ))
            await asyncio.sleep(1.5)
            await admit("binpack-pod", "binpack")  # a later allocation gets a workload too
            await asyncio.sleep(5.0)
            regions = agent.regions.regions()
            status = agent.controller.status
            usages = {r.alloc_id: r.usage() for r in regions}
            body = await asyncio.to_thread(_scrape, agent.metrics.url)
            last = await demo
    assert len(regions) == 2
    for region in regions:
        [proc] = usages[region.alloc_id].processes
        assert all(n > 0 for n in proc.launches) and all(t > 0 for t in proc.tokens_spent)
        assert all(0 < m <= region.memory_limit(d) for d, m in enumerate(proc.memory_used))
        for dev in range(region.device_count):
            decided = status[(region.alloc_id, dev)]
            assert decided.measured_util is not None
            # the last NVML sample alone: noisy by a few points on the simulated GPU
            assert decided.measured_util == pytest.approx(region.core_limit(dev), abs=9)
    assert len(last) == 3  # two devices of the spread pod, one of the binpack pod
    for share in last:
        # the real share over the last 1 s report, on the imperfect GPU (noisy NVML samples,
        # jitter), some 5 s after the binpack pod arrived: near its limit, not settled to a point
        # (settling and steady error are measured by bench_throttle)
        assert share.share == pytest.approx(share.limit, abs=6), share
    reports = [e for e in logs if e["event"] == "demo_share"]
    assert {"alloc_id", "uuid", "limit", "share", "target", "measured"} <= set(reports[-1])
    launches = re.findall(rb"^vgpu_container_kernel_launches_total\{.*\} (\S+)$", body, re.M)
    assert len(launches) == 3 and all(float(v) > 0 for v in launches)
    utilization = re.findall(rb"^vgpu_container_core_utilization_ratio\{.*\} (\S+)$", body, re.M)
    assert len(utilization) == 3 and all(0.1 < float(v) < 0.6 for v in utilization)
    # On the way out the processes ended and gave their slots back.
    assert all(not r.usage().processes for r in regions if not r.closed)


def _scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()

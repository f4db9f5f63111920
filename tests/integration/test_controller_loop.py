"""The throttle controller driving simulated containers: steering, heartbeats, open loop, faults."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from structlog.testing import capture_logs

from vgpu_agent.gpu.model import GpuError, ProcessSample
from vgpu_agent.simulation.gpu import NoShim, SimGpu, Workload
from vgpu_agent.simulation.imperfections import IDEAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.simulation.runner import SIM_UUID, ContainerSpec, ControlledRun
from vgpu_agent.throttle.control import UNLIMITED_RATE
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.identity import CgroupPidResolver

BUSY = Workload(kernel_s=0.002)


def share(run: ControlledRun, name: str, last_s: float = 1.0) -> float:
    return sum(run.gpu.shares(p, last_s)[-1][1] for p in run.procs[name])


async def test_steers_containers_to_their_limits_and_beats_every_tick():
    run = ControlledRun((ContainerSpec("a", 25, BUSY), ContainerSpec("b", 75, Workload(
        kernel_s=0.0005, blocks=512))))
    await run.advance(4)
    assert share(run, "a") == pytest.approx(25, abs=2)
    assert share(run, "b") == pytest.approx(75, abs=2)
    # beaten at the heartbeat rate (once a second), not every tick
    assert all(0 <= run.gpu.now_ns - r.heartbeat_ns < run.controller.heartbeat_ns
               for r in run.regions.values())
    assert run.controller.ticks == 40
    status = run.controller.status[("a", 0)]
    assert status.uuid == SIM_UUID and status.limit == 25 and status.policy == "work-conserving"
    assert run.regions["a"].rates[0] == (status.rate, status.burst)
    assert status.measured_util == pytest.approx(25, abs=9)  # one sample, noisy by 3 points
    assert not status.open_loop and not run.controller.open_loop_gpus
    assert run.controller.error_counts == {}


async def test_a_paced_run_ticks_at_the_controllers_own_pace():
    """`paced` steps the plant by the controller's `interval_s`, as the agent's loop sleeps:
    fast while it settles, slower once calm (up to 2 s, also while a work-conserving container
    borrows the GPU's unallocated rest: no idle container's wake-up to watch for); unpaced,
    every tick_s."""
    strict = (ContainerSpec("solo", 40, BUSY, policy="strict"),)
    lending = (ContainerSpec("solo", 40, BUSY),)
    fixed, paced = ControlledRun(strict), ControlledRun(strict, paced=True)
    lent = ControlledRun(lending, paced=True)
    for run in (fixed, paced, lent):
        await run.advance(20)
    assert fixed.controller.ticks == 200
    assert 25 <= paced.controller.ticks < 80  # 0.1 s at first, then up to 1 s
    assert paced.controller.interval_s > 0.4
    assert share(paced, "solo") == pytest.approx(40, abs=3)
    assert 25 <= lent.controller.ticks < 80
    assert lent.controller.interval_s > 0.4 and lent.controller.watch_s is None
    assert share(lent, "solo") > 90  # lent the idle rest of the GPU


@pytest.mark.parametrize("paced", [False, True])
async def test_a_run_stepped_in_pieces_is_the_run_one_call_gives(paced):
    """The tick schedule outlives `advance`: pieces shorter than the tick (which ticked the
    controller at every call, 20 times a second for 0.05 s pieces) change nothing."""
    containers = (ContainerSpec("a", 30, BUSY, policy="strict"),
                  ContainerSpec("b", 70, Workload(kernel_s=0.0005, blocks=512)))
    whole = ControlledRun(containers, paced=paced)
    await whole.advance(6)
    for piece in (0.05, 0.13, 1.0):
        sliced = ControlledRun(containers, paced=paced)
        for _ in range(round(6 / piece)):
            await sliced.advance(piece)
        await sliced.advance(6 - sliced.gpu.elapsed_s)
        assert sliced.controller.ticks == whole.controller.ticks, piece
        for name in ("a", "b"):
            assert sliced.regions[name].rates == whole.regions[name].rates, (piece, name)
            assert share(sliced, name, 6) == share(whole, name, 6), (piece, name)
    if paced:
        assert whole.controller.ticks < 60  # calm: slower than every 0.1 s
    else:
        assert whole.controller.ticks == 60


async def test_rates_are_written_only_when_they_change():
    run = ControlledRun((ContainerSpec("solo", 40, BUSY, policy="strict"),))
    await run.advance(5)
    writes = run.regions["solo"].rate_writes
    await run.advance(2)
    # Settled: a correction at most per NVML sample (6 a second), not one write per tick.
    assert run.regions["solo"].rate_writes - writes <= 12


async def test_open_loop_when_the_gpu_cannot_report_per_process_use():
    with capture_logs() as logs:
        run = ControlledRun((ContainerSpec("solo", 40, BUSY, policy="strict"),),
                            per_process_samples=False)
        await run.advance(3)
    assert run.controller.open_loop_gpus == {SIM_UUID}
    assert run.controller.status[("solo", 0)].open_loop
    assert [e["event"] for e in logs].count("throttle_open_loop") == 1
    # Open loop still never lets a strict container above its limit.
    assert 0 < share(run, "solo", 2) <= 41


class BrokenRegion(SimRegion):
    def usage(self):  # type: ignore[override]
        raise OSError("state file vanished")

    def counters(self):  # type: ignore[override]
        raise OSError("state file vanished")


class ReadOnlyRegion(SimRegion):
    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        raise PermissionError("read-only control file")


async def test_one_bad_region_is_counted_and_the_others_are_still_steered():
    run = ControlledRun((ContainerSpec("good", 30, BUSY, policy="strict"),))
    broken = BrokenRegion("broken", (SIM_UUID,), (50.0,), ("strict",))
    readonly = ReadOnlyRegion("readonly", (SIM_UUID,), (20.0,), ("strict",))
    run.regions["broken"] = broken
    run.regions["readonly"] = readonly
    await run.advance(3)
    assert share(run, "good") == pytest.approx(30, abs=2)
    counts = run.controller.error_counts
    assert counts["region_usage"] == run.controller.ticks
    assert counts["set_rate"] >= 1
    assert 0 <= run.gpu.now_ns - readonly.heartbeat_ns < 10**9  # beats still go out
    assert ("broken", 0) not in run.controller.status


async def test_failures_of_the_region_list_and_of_nvml_are_counted_not_fatal():
    calls = {"n": 0}
    region = SimRegion("r", ("GPU-x",), (30.0,), ("strict",))

    def regions():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("state dir unreadable")
        return [region]

    class FlakyBackend:
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            raise GpuError("GPU is lost", call="nvmlDeviceGetProcessUtilization", code=15)

    now = {"ns": 10**12}
    controller = ThrottleController(FlakyBackend(), regions, clock=lambda: now["ns"])
    for _ in range(3):
        now["ns"] += 100_000_000
        await controller.tick()
    assert controller.error_counts["list_regions"] == 1
    assert controller.error_counts["nvml"] == 2
    assert not controller.open_loop_gpus  # only NOT_SUPPORTED means open loop
    assert 0 <= now["ns"] - region.heartbeat_ns < controller.heartbeat_ns
    # Nothing measured, nothing spent: the never-configured region is left unthrottled.
    assert region.rates[0] == (UNLIMITED_RATE, UNLIMITED_RATE)


def write_cgroup(root, pid: int, text: str) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "cgroup").write_text(text)


async def test_a_process_the_host_cannot_show_is_found_through_a_proven_siblings_cgroup(tmp_path):
    pod = "0::/kubepods/burstable/pod1234/cri-containerd-abc\n"
    # the ideal plant: this checks whose samples are counted, which noise would blur
    gpu = SimGpu(SIM_UUID, imperfections=IDEAL)
    region = SimRegion("r", (SIM_UUID,), (100.0,), ("work-conserving",))
    known = gpu.shim_process("known", Workload(kernel_s=0.001), region, pid=4001)
    hidden = gpu.shim_process("hidden", Workload(kernel_s=0.001), region, pid=4002,
                              report_host_pid=False)
    stranger = gpu.add_process("stranger", Workload(kernel_s=0.001),
                               NoShim(), pid=4003)
    write_cgroup(tmp_path, known.pid, pod)
    write_cgroup(tmp_path, hidden.pid, pod)
    write_cgroup(tmp_path, stranger.pid, "0::/kubepods/besteffort/pod9/cri-containerd-zzz\n")
    from vgpu_agent.simulation.gpu import SimBackend

    class Host:  # /proc shows the known process's mounts; the hidden one's table is unreadable
        def owner(self, host_pid: int, marks: object) -> str | None:
            return {known.pid: "r", hidden.pid: None}.get(host_pid, "")

        def forget_except(self, live: object) -> None:
            pass

    controller = ThrottleController(SimBackend([gpu]), lambda: [region],
                                    pid_resolver=CgroupPidResolver(str(tmp_path)),
                                    clock=lambda: gpu.now_ns, evidence=Host())
    for _ in range(10):
        gpu.advance(0.1)
        await controller.tick()
    # Three processes time-share the GPU; the region owns two of them: about 67%, not 33%
    # (hidden ignored) and not 100% (stranger counted).
    assert controller.status[("r", 0)].measured_util == pytest.approx(67, abs=3)


def test_cgroup_resolver_reads_v1_and_v2_and_survives_missing_processes(tmp_path):
    write_cgroup(tmp_path, 10, "0::/kubepods/pod-a/ctr-1\n")
    write_cgroup(tmp_path, 11, "0::/kubepods/pod-a/ctr-1\n")
    write_cgroup(tmp_path, 20, "12:memory:/kubepods/pod-b/ctr-2\n11:cpu,cpuacct:/kubepods/pod-b/"
                               "ctr-2\n")
    write_cgroup(tmp_path, 21, "12:memory:/kubepods/pod-b/ctr-2\n11:cpu,cpuacct:/kubepods/pod-b/"
                               "ctr-2\n")
    write_cgroup(tmp_path, 30, "0::/\n")  # the root cgroup names no container
    write_cgroup(tmp_path, 31, "0::/\n")
    resolver = CgroupPidResolver(str(tmp_path))
    known = {10: "alloc-a", 20: "alloc-b", 31: "alloc-root"}
    assert resolver(11, known) == "alloc-a"
    assert resolver(21, known) == "alloc-b"
    assert resolver(30, known) is None
    assert resolver(99, known) is None  # exited before we looked
    (tmp_path / "40").mkdir()
    (tmp_path / "40" / "cgroup").write_bytes(b"\xff\xfe garbage")
    assert resolver(40, known) is None


def test_cgroups_a_container_named_with_any_bytes_are_told_apart(tmp_path):
    """A container may make cgroups of its own, named with bytes that are no UTF-8: its
    processes there are still each other's siblings, and a name differing by a byte is another
    cgroup."""
    for pid, name in ((50, b"\xff"), (51, b"\xff"), (60, b"\xfe")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_bytes(b"0::/kubepods/pod-c/ctr-3/" + name + b"\n")
    resolver = CgroupPidResolver(str(tmp_path))
    assert resolver(51, {50: "alloc-c"}) == "alloc-c"
    assert resolver(60, {50: "alloc-c"}) is None


async def test_run_ticks_until_cancelled():
    region = SimRegion("r", ("GPU-x",), (30.0,), ("strict",))

    class Quiet:
        def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
            return []

    controller = ThrottleController(Quiet(), lambda: [region], tick_s=0.01)
    task = asyncio.create_task(controller.run())
    await asyncio.sleep(0.15)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert controller.ticks >= 5
    assert region.heartbeat_ns > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tick_s": 0}, "tick"),
    ({"default_policy": "fair"}, "default core policy"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ThrottleController(SimBackend_empty(), list, **kwargs)


def SimBackend_empty():
    from vgpu_agent.simulation.gpu import SimBackend

    return SimBackend([])


async def test_a_policy_and_priority_written_for_the_pod_apply_from_the_next_tick():
    run = ControlledRun((ContainerSpec("batch", 25, BUSY, policy="strict"),))
    await run.advance(3)
    assert share(run, "batch") == pytest.approx(25, abs=2)
    assert run.controller.status[("batch", 0)].priority == 0

    assert run.regions["batch"].set_policy("work-conserving", 7)  # as the pod's annotations ask
    await run.advance(run.tick_s)
    status = run.controller.status[("batch", 0)]
    assert (status.policy, status.priority) == ("work-conserving", 7)
    await run.advance(3)
    assert share(run, "batch") > 90  # alone on the GPU, it now borrows the idle rest

    assert run.regions["batch"].set_policy("strict", 7)
    assert not run.regions["batch"].set_policy("strict", 7)  # nothing to write
    await run.advance(3)
    assert share(run, "batch") == pytest.approx(25, abs=2)

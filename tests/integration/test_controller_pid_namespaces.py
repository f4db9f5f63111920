"""Host PIDs from NVML and the shim slots' (in-container pid, start time), through the host's
/proc: the identity that lets a claim be checked (attribution itself rests on the mount table)."""

from __future__ import annotations

from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm.api import ProcessUsage, RegionUsage
from vgpu_agent.throttle.controller import ThrottleController
from vgpu_agent.throttle.identity import NamespacePidResolver

UUID = "GPU-11111111-2222-3333-4444-555555555555"
REGION_DEV = 0xFE01


def mount(alloc_id: str) -> str:
    return (f"1211 1201 254:1 /var/lib/vgpu-agent/regions/{alloc_id}/control /run/vgpu/control "
            "ro,relatime - ext4 /dev/vda1 rw\n")


def write_proc(root, host_pid: int, nspids: str, start: int, comm: str = "python train.py",
               mounts: str = "") -> None:
    d = root / str(host_pid)
    d.mkdir()
    d.joinpath("status").write_text(f"Name:\tpython\nPid:\t{host_pid}\nNSpid:\t{nspids}\n")
    fields = ["S", "1"] + ["0"] * 17 + [str(start), "0"]  # fields 3.. ; field 22 is start time
    d.joinpath("stat").write_text(f"{host_pid} ({comm}) {' '.join(fields)}\n")
    d.joinpath("mountinfo").write_text(mounts)


class Region:
    """A region whose shim knows only in-container pids (no host pids), like a real container."""

    def __init__(self, alloc_id: str, procs: list[tuple[int, int]]):
        self.alloc_id = alloc_id
        self.seq = 1
        self.priority = 0
        self.device_ids = (f"{UUID}::0",)
        self.device_uuids = (UUID,)
        self._procs = procs
        self.rates: list[tuple[int, int]] = [(0, 0)]
        self.control_dev = REGION_DEV
        self.closed = False

    def memory_limit(self, dev: int) -> int:
        return 1 << 30

    def core_limit(self, dev: int) -> float:
        return 50.0

    def policy(self, dev: int) -> str:
        return "strict"

    def rate(self, dev: int) -> tuple[int, int]:
        return self.rates[dev]

    def usage(self) -> RegionUsage:
        procs = tuple(
            ProcessUsage(pid=pid, host_pid=0, memory_used=(0,), launches=(0,), tokens_spent=(0,),
                         wait_ns=(0,), last_launch_ns=(0,), start_time=start)
            for pid, start in self._procs
        )
        return RegionUsage(processes=procs, memory_used=(0,), tokens_spent=(0,))

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        self.rates[dev] = (rate, burst)

    def beat(self, now_ns: int) -> None:
        pass


class Samples:
    def __init__(self, samples: list[ProcessSample]):
        self.samples = samples

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        return [s for s in self.samples if s.timestamp_us > since_us]


def test_resolver_reads_innermost_pid_and_start_time_even_with_spaces_in_the_name(tmp_path):
    write_proc(tmp_path, 4242, "4242\t7", 98765, comm="a b) c")
    resolver = NamespacePidResolver(str(tmp_path))
    assert resolver.identity(4242) == (7, 98765)
    assert resolver.resolve(4242, {(7, 98765): "alloc-a"}) == "alloc-a"
    assert resolver.resolve(4242, {(7, 11111): "alloc-a"}) is None  # pid 7 of another start
    assert resolver.identity(5000) is None  # gone before we looked
    (tmp_path / "6000").mkdir()
    (tmp_path / "6000" / "status").write_text("NSpid:\tgarbage\n")
    (tmp_path / "6000" / "stat").write_text("nonsense")
    assert resolver.identity(6000) is None


def test_resolver_forgets_pids_that_stopped_appearing(tmp_path):
    write_proc(tmp_path, 10, "10\t3", 500)
    resolver = NamespacePidResolver(str(tmp_path))
    assert resolver.identity(10) == (3, 500)
    # pid 10 exits and is reused by a process that started later
    import shutil

    shutil.rmtree(tmp_path / "10")
    write_proc(tmp_path, 10, "10\t9", 900)
    assert resolver.identity(10) == (3, 500)  # cached while it keeps appearing
    resolver.forget_except([])
    assert resolver.identity(10) == (9, 900)


async def test_controller_attributes_utilization_across_namespaces(tmp_path):
    # Two containers both have an in-container pid 7; their mount tables tell them apart.
    write_proc(tmp_path, 4001, "4001\t7", 1000, mounts=mount("alloc-a"))
    write_proc(tmp_path, 4002, "4002\t7", 2000, mounts=mount("alloc-b"))
    write_proc(tmp_path, 4003, "4003", 3000)  # a host process, in no container
    a = Region("alloc-a", [(7, 1000)])
    b = Region("alloc-b", [(7, 2000)])
    samples = Samples([
        ProcessSample(4001, 1_000_000, 30),
        ProcessSample(4002, 1_000_000, 20),
        ProcessSample(4003, 1_000_000, 40),
    ])
    now = {"ns": 10**12}
    controller = ThrottleController(samples, lambda: [a, b], proc_root=str(tmp_path),
                                    clock=lambda: now["ns"])
    now["ns"] += 100_000_000
    await controller.tick()
    assert controller.status[("alloc-a", 0)].measured_util == 30
    assert controller.status[("alloc-b", 0)].measured_util == 20
    assert controller.attributor.rejected_total == 0

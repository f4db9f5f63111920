"""Agent CPU, Allocate and /healthz with hostile containers that mark every `state` slot used.

    python tests/bench/bench_hostile.py [--containers 30] [--seconds 10] [--rounds 2]

The agent side runs in a child process: the real region files and reader, the throttle
controller ticking every 100 ms with host evidence from a fake host /proc (each container's
process proven by its mount table), the metrics service (/healthz, NVML poll 1 s), and the
region store answering an Allocate (`on_grant`: region creation on the event loop) every
200 ms. This process plays the containers: *behaving*, each runs one process whose slot's
counters move every 100 ms; *hostile*, the same containers also mark all 1,024 slots used and
rewrite them every 100 ms, so nothing the agent keeps between reads helps. Phases alternate
(behaving, hostile, ...) in one run; reported: the agent's CPU per phase (median over rounds)
and the hostile/behaving ratio, Allocate (region creation) and /healthz latency p50/p99.

Goal: hostile CPU <= 1.2x behaving; Allocate and /healthz p50 <= 1.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench import machine  # noqa: E402
from tests.bench.nodeparts import cpu_seconds  # noqa: E402

GIB = 1 << 30
HOST_PID_BASE = 300_000
CHURN = 64  # slots a hostile container rewrites every tick (all 1,024 are marked used)


def build(root: Path, containers: int) -> list[dict[str, object]]:
    from tests.fakes.hostproc import FakeHostProc
    from tests.fakes.shimstate import DeviceSpec, make_region
    from vgpu_agent.gpu.sim import build_inventory
    from vgpu_agent.shm.regions import format_alloc_id

    inventory = build_inventory("2xA100-80GB")
    host = FakeHostProc(root / "proc")
    rows = []
    for n in range(containers):
        uuid = inventory[n % 2].uuid
        ids = [f"{uuid}::{n // 2}"]
        alloc_id = format_alloc_id(n + 1, ids, 1_000 + n)
        make_region(root / "regions", alloc_id, [DeviceSpec(uuid, 4 * GIB, 3.0, "strict")], ids,
                    seq=n + 1)
        host.container_process(HOST_PID_BASE + n, root / "regions" / alloc_id, inner_pid=1)
        rows.append({"alloc_id": alloc_id, "uuid": uuid, "host_pid": HOST_PID_BASE + n})
    (root / "layout.json").write_text(json.dumps(rows))
    return rows


class Containers:
    """The shims: one process each, counters moving; hostile ones fill every slot."""

    def __init__(self, root: Path, rows: list[dict[str, object]]):
        from tests.fakes.shimstate import store_words
        from vgpu_agent.shm import layout

        self.layout = layout
        self.store_words = store_words  # one 8-byte store a field, as the shim's atomics
        self.maps = []
        for row in rows:
            fd = os.open(root / "regions" / str(row["alloc_id"]) / "state", os.O_RDWR)
            self.maps.append((mmap.mmap(fd, 0), int(str(row["host_pid"]))))
            os.close(fd)
        slots = layout.MAX_PROCS
        self.junk = []
        for variant in range(2):  # two fillings, alternated, so every read sees new bytes
            blob = bytearray(slots * layout.SLOT_SIZE)
            for i in range(1, slots):
                base = i * layout.SLOT_SIZE
                struct.pack_into("<QQQ", blob, base, 1000 + i, 0, 7 + variant)
                dev = base + layout.SLOT_OFFSETS["devices"]
                struct.pack_into("<5Q", blob, dev, GIB, i + variant, i * 10, variant, 1)
            self.junk.append(bytes(blob))
        self.step = 0
        self.filled = False

    def tick(self, hostile: bool) -> None:
        layout = self.layout
        self.step += 1
        slot0 = layout.STATE_OFFSETS["slots"]
        mark = layout.STATE_OFFSETS["slot_high_water"]
        junk = self.junk[self.step % 2]
        for buf, host_pid in self.maps:
            if hostile:
                # Every slot used, the first CHURN of them rewritten each tick (the agent cannot
                # tell which changed; rewriting all 673 KiB would only load this machine's
                # shared cores, which a real node's tenant does not share with the agent).
                if not self.filled:
                    buf[slot0 : slot0 + len(junk)] = junk
                buf[slot0 : slot0 + CHURN * layout.SLOT_SIZE] = junk[: CHURN * layout.SLOT_SIZE]
                layout.store_u64(buf, mark, layout.MAX_PROCS)
            else:
                layout.store_u64(buf, mark, 1)
            self.store_words(buf, slot0, 1, host_pid, 0)
            dev = slot0 + layout.SLOT_OFFSETS["devices"]
            self.store_words(buf, dev, GIB, self.step * 50, self.step * 50_000, 0, 1)
            totals = layout.STATE_OFFSETS["devices"]
            self.store_words(buf, totals + layout.STATE_DEVICE_OFFSETS["tokens_spent"],
                             self.step * 50_000)
        self.filled = hostile

    def reset(self) -> None:
        self.filled = False
        for buf, _ in self.maps:
            slot0 = self.layout.STATE_OFFSETS["slots"]
            buf[slot0 : slot0 + len(self.junk[0])] = bytes(len(self.junk[0]))


# ------------------------------------------------------------------ the agent (child)


async def serve(root: Path, port_file: Path, phase_file: Path, out_file: Path,
                headroom: int | None) -> None:
    import structlog

    from vgpu_agent.shm import regions as regions_module

    if headroom is not None:  # to show what the slot budget saves
        regions_module.SLOT_HEADROOM = headroom

    from vgpu_agent.deviceplugin.allocation import Grant, GrantedDevice
    from vgpu_agent.gpu.model import ProcessSample
    from vgpu_agent.gpu.sim import SimBackend, build_inventory
    from vgpu_agent.metrics.http import MetricsService
    from vgpu_agent.metrics.sources import MetricsSources
    from vgpu_agent.shm.regions import Region, RegionStore
    from vgpu_agent.throttle.controller import ThrottleController

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    rows = json.loads((root / "layout.json").read_text())
    regions = [Region.open(root / "regions" / row["alloc_id"]) for row in rows]
    inventory = build_inventory("2xA100-80GB")
    backend = SimBackend("2xA100-80GB")
    backend.start()
    pids: dict[str, list[int]] = {}
    for row in rows:
        pids.setdefault(row["uuid"], []).append(row["host_pid"])

    def samples(uuid: str, since_us: int) -> list[ProcessSample]:
        now_us = time.time_ns() // 1000
        return [ProcessSample(pid, now_us, 3) for pid in pids.get(uuid, [])]

    backend.set_sample_source(samples)
    controller = ThrottleController(backend, lambda: regions, tick_s=0.1,
                                    proc_root=str(root / "proc"))
    sources = MetricsSources(
        node="bench", gpus=lambda: inventory, slices_per_gpu=16, regions=lambda: regions,
        healthy=lambda: {g.uuid: True for g in inventory}, xid_counts=lambda: {},
        throttle_status=lambda: controller.status,
    )
    service = MetricsService(sources, host="127.0.0.1", port=0, backend=backend, poll_s=1.0)
    store = RegionStore(root / "allocations", default_policy="strict")
    store.adopt()
    device = GrantedDevice(inventory[0].uuid, 0, 1, 4 * GIB, 3.0)
    allocs: dict[str, list[float]] = {}

    async def allocate() -> None:
        n = 0
        while True:
            await asyncio.sleep(0.2)
            n += 1
            phase = phase_file.read_text() if phase_file.exists() else "warmup"
            started = time.perf_counter()
            await store.on_grant(Grant((f"{device.uuid}::{n}",), (device,)))
            allocs.setdefault(phase, []).append((time.perf_counter() - started) * 1000)
            for region in store.regions():  # keep the directory small
                if region.alloc_id.startswith("0000000") and n % 50 == 0:
                    await store.reconcile({})

    tasks = [asyncio.create_task(service.run()), asyncio.create_task(controller.run()),
             asyncio.create_task(allocate())]
    while not service.port:
        await asyncio.sleep(0.01)
    port_file.with_suffix(".tmp").write_text(str(service.port))
    port_file.with_suffix(".tmp").rename(port_file)  # whole, never half-written
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    out_file.write_text(json.dumps({"allocate_ms": allocs,
                                    "rejected": controller.attributor.rejected_total,
                                    "budgets": sorted({r.slot_budget for r in regions})}))
    store.close()


# ------------------------------------------------------------------ measuring (parent)


def healthz(port: int) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
        response.read()
    return (time.perf_counter() - started) * 1000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--containers", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--headroom", type=int, default=None,
                        help="override SLOT_HEADROOM (1024: no slot budget, as before)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        root, port_file, phase_file, out_file = map(Path, args.child)
        asyncio.run(serve(root, port_file, phase_file, out_file, args.headroom))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = build(root, args.containers)
        port_file, phase_file, out_file = root / "port", root / "phase", root / "out.json"
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", str(root), str(port_file), str(phase_file),
             str(out_file), *([] if args.headroom is None else ["--headroom", str(args.headroom)])],
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            while not port_file.exists():
                time.sleep(0.05)
            port = int(port_file.read_text())
            shims = Containers(root, rows)
            cpu: dict[str, list[float]] = {"behaving": [], "hostile": []}
            health: dict[str, list[float]] = {"behaving": [], "hostile": []}
            for _ in range(20):  # warm up: regions read, processes proven
                shims.tick(False)
                time.sleep(0.1)
            for _ in range(args.rounds):
                for phase in ("behaving", "hostile"):
                    phase_file.write_text(phase)
                    if phase == "behaving":
                        shims.reset()
                    before = cpu_seconds(child.pid)
                    started = time.monotonic()
                    next_at = started
                    while time.monotonic() - started < args.seconds:
                        shims.tick(phase == "hostile")
                        health[phase].append(healthz(port))
                        next_at += 0.1
                        time.sleep(max(0.0, next_at - time.monotonic()))
                    elapsed = time.monotonic() - started
                    cpu[phase].append((cpu_seconds(child.pid) - before) / elapsed * 100)
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=30)
        result = json.loads(out_file.read_text())
    allocs = result["allocate_ms"]
    print(f"machine: {machine.describe()}")
    print(f"{args.containers} containers, {args.rounds} rounds x {args.seconds:.0f} s per phase; "
          f"slot budgets at the end {result['budgets']}, identity rejections {result['rejected']}")
    print(f"{'phase':10} {'agent CPU %':>12} {'alloc p50':>10} {'alloc p99':>10} "
          f"{'healthz p50':>12} {'healthz p99':>12}")
    for phase in ("behaving", "hostile"):
        print(f"{phase:10} {statistics.median(cpu[phase]):12.2f} "
              f"{pct(allocs.get(phase, [0]), 0.5):10.2f} {pct(allocs.get(phase, [0]), 0.99):10.2f} "
              f"{pct(health[phase], 0.5):12.2f} {pct(health[phase], 0.99):12.2f}")
    ratio = statistics.median(cpu["hostile"]) / max(1e-9, statistics.median(cpu["behaving"]))
    a = pct(allocs.get("hostile", [0]), 0.5) / max(1e-9, pct(allocs.get("behaving", [0]), 0.5))
    h = pct(health["hostile"], 0.5) / max(1e-9, pct(health["behaving"], 0.5))
    print(f"ratios hostile/behaving: CPU {ratio:.2f}x (goal <= 1.2), Allocate p50 {a:.2f}x, "
          f"/healthz p50 {h:.2f}x (goal <= 1.5)")


if __name__ == "__main__":
    main()

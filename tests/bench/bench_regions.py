"""Region benchmarks: what creating a region adds to Allocate, and what reading `state` costs.

    python tests/bench/bench_regions.py [--calls 2000]

1. Allocate over a unix socket to the real servicer, three servers in this process, calls
   alternating between them so they share the machine's noise: no region hook; the region store's
   hook doing its file I/O on the event loop; the same hook doing it in a worker thread
   (`offload_io=True`). Prints p50/p99 and the ratios to the bare servicer.
2. `RegionStore.create` alone (the file work: two files, a rename, an mmap).
3. `Region.usage()` on a state file with 0, 8 and 1024 live process slots (it reads the header
   and the slots below the high-water mark), against a pread of the whole file decoded with
   `layout.decode_state` (what a reader without the mark pays). Measured on busy regions (a
   shim-like writer moves a counter before every read, so every read decodes) and on unchanged
   ones (the decode is cached), beside `Region.counters()`, the controller's lean read of the
   header alone.
4. The sweep of an old-style region directory (mounted into the container by older agents)
   after a tenant filled it with a tree of `--flood` files: passes until it is gone, the
   longest and the median pass (the sweep runs on the event loop, so the longest pass is what
   an Allocate or a scrape may wait behind), and the whole time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import mmap
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import grpc
import structlog

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench import machine  # noqa: E402
from vgpu_agent._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402
from vgpu_agent.deviceplugin.allocation import Split, grant  # noqa: E402
from vgpu_agent.deviceplugin.ids import format_device_id  # noqa: E402
from vgpu_agent.deviceplugin.server import DevicePluginServicer, DeviceState  # noqa: E402
from vgpu_agent.gpu.model import GpuInfo  # noqa: E402
from vgpu_agent.shm import layout  # noqa: E402
from vgpu_agent.shm.regions import STATE_FILE, RegionStore  # noqa: E402

GIB = 1 << 30
SPLIT = Split(16)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def line(name: str, values: list[float], unit: str = "ms") -> str:
    return (
        f"  {name:<34} n={len(values):>5}  p50={statistics.median(values):8.3f} {unit}  "
        f"p99={pct(values, 0.99):8.3f} {unit}"
    )


def gpus() -> list[GpuInfo]:
    return [
        GpuInfo(i, f"GPU-bench-{i:04d}", "NVIDIA A100-SXM4-80GB", 80 * GIB, i, f"0000:{i:02x}:00.0")
        for i in range(8)
    ]


async def serve(path: str, servicer: DevicePluginServicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    return server


async def bench_allocate(root: Path, calls: int) -> None:
    inventory = gpus()
    state = DeviceState(inventory, SPLIT)
    variants = {
        "bare servicer": None,
        "regions, I/O on the loop": RegionStore(root / "inline", offload_io=False),
        "regions, I/O in a thread": RegionStore(root / "thread", offload_io=True),
    }
    for store in variants.values():
        if store is not None:  # installed shim, so every response gets all its mounts
            store.shim_dir.mkdir(parents=True)
            (store.shim_dir / "libvgpu.so").write_bytes(b"\x7fELF")
            (store.shim_dir / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
    servers, stubs, channels = [], {}, []
    for n, (name, store) in enumerate(variants.items()):
        servicer = DevicePluginServicer(
            state,
            policy="spread",
            strategy="envvar",
            on_grant=None if store is None else store.on_grant,
        )
        path = str(root / f"p{n}.sock")
        servers.append(await serve(path, servicer))
        channel = grpc.aio.insecure_channel(f"unix:{path}")
        channels.append(channel)
        stubs[name] = api_pb2_grpc.DevicePluginStub(channel)
    ids = [format_device_id(g.uuid, n) for g in inventory for n in range(SPLIT.count)]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(calls + 50):
        request = api_pb2.AllocateRequest(
            container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[ids[(2 * i) % len(ids)]])
            ]
        )
        for name, stub in stubs.items():
            started = time.perf_counter()
            await stub.Allocate(request)
            if i >= 50:  # warm-up calls are not counted
                times[name].append((time.perf_counter() - started) * 1e3)
    bare = times["bare servicer"]
    print("Allocate round trip (one container, one slice):")
    for name, values in times.items():
        ratio = (
            f"  p50 x{statistics.median(values) / statistics.median(bare):.2f}"
            f"  p99 x{pct(values, 0.99) / pct(bare, 0.99):.2f}"
        )
        print(line(name, values) + ratio)
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


def bench_create(root: Path, calls: int) -> None:
    store = RegionStore(root / "create")
    g = grant([format_device_id("GPU-bench-0000", 0)], {g.uuid: g for g in gpus()}, SPLIT)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        store.create(g)
        times.append((time.perf_counter() - started) * 1e6)
    print("RegionStore.create (files, rename, mmap):")
    print(line("create", times, "us"))
    store.close()


def bench_sweep(root: Path, files: int) -> None:
    store = RegionStore(root / "sweep")
    region = store.create(grant([format_device_id("GPU-bench-0000", 0)],
                                {g.uuid: g for g in gpus()}, SPLIT))
    flood = region.path / "flood"
    per_dir = 1000
    for i in range(max(1, files // per_dir)):
        sub = flood / f"d{i}" / "nested"
        sub.mkdir(parents=True)
        for j in range(per_dir):
            (sub / f"f{j}").touch()
    passes = []
    started = time.perf_counter()
    while flood.exists():
        t = time.perf_counter()
        region._sweep()  # what every 16th check of the region's files runs
        passes.append((time.perf_counter() - t) * 1e3)
    whole = time.perf_counter() - started
    print(f"sweep of a {max(1, files // per_dir) * per_dir}-file tree: {len(passes)} passes, "
          f"longest {max(passes):.2f} ms, median {statistics.median(passes):.2f} ms, "
          f"all {whole:.2f} s")
    store.close()


def bench_usage(root: Path, calls: int) -> None:
    store = RegionStore(root / "usage")
    g = grant([format_device_id("GPU-bench-0000", 0)], {g.uuid: g for g in gpus()}, SPLIT)
    print("Region.usage() (header + slots below the high-water mark) against a pread of the")
    print("whole file and decode_state of it (what a reader without the mark pays):")
    mark = layout.STATE_OFFSETS["slot_high_water"]
    for live in (0, 8, layout.MAX_PROCS):
        region = store.create(g)
        with open(region.path / STATE_FILE, "r+b") as f:
            for slot in range(live):  # as the shim claims: the mark first, then the pid
                f.seek(mark)
                f.write(struct.pack("<Q", slot + 1))
                f.seek(layout.STATE_OFFSETS["slots"] + slot * layout.SLOT_SIZE)
                f.write(struct.pack("<QQ", 100 + slot, 5000 + slot))
        # as the controller allows once the host has proven the container's processes (without
        # it a region's reads stop at SLOT_HEADROOM slots, whatever the container claims)
        region.limit_slots(live)
        fd = os.open(region.path / STATE_FILE, os.O_RDWR)
        shim = mmap.mmap(fd, 0)
        spent_at = layout.STATE_OFFSETS["devices"] + layout.STATE_DEVICE_OFFSETS["tokens_spent"]
        whole = bytearray(layout.STATE_SIZE)
        busy, idle, lean, full = [], [], [], []
        for n in range(max(20, calls // 20)):
            struct.pack_into("<Q", shim, spent_at, n + 1)  # the shim spent: `state` changed
            if live:
                struct.pack_into("<Q", shim, layout.STATE_OFFSETS["slots"] + layout.SLOT_OFFSETS[
                    "devices"] + layout.PROC_DEVICE_OFFSETS["tokens_spent"], n + 1)
            started = time.perf_counter()
            usage = region.usage()
            busy.append((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
            region.usage()
            idle.append((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
            counters = region.counters()
            lean.append((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
            size = os.preadv(fd, [whole], 0)
            layout.decode_state(memoryview(whole)[:size], 1)
            full.append((time.perf_counter() - started) * 1e6)
        shim.close()
        os.close(fd)
        assert len(usage.processes) == live and usage.skipped_records == 0
        assert counters is not None and counters[0] == n + 1
        ours = busy
        print(line(f"usage(), {live} live slots, busy", busy, "us"))
        print(line(f"usage(), {live} live slots, unchanged", idle, "us"))
        print(line(f"counters() (header only), {live} slots", lean, "us")
              + f"  busy usage() / counters() p50 x"
              f"{statistics.median(busy) / statistics.median(lean):.1f}")
        print(
            line(f"whole file, {live} live slots", full, "us")
            + f"  ratio to busy usage() p50 x{statistics.median(full) / statistics.median(ours):.1f}"
            + f"  p99 x{pct(full, 0.99) / pct(ours, 0.99):.1f}"
        )
        if live == 8:
            per_tick_ms = statistics.median(ours) * 128 / 1e3
            lean_ms = statistics.median(lean) * 128 / 1e3
            print(f"  128 busy regions of 8 processes each, read every 100 ms: usage() "
                  f"{per_tick_ms:.2f} ms a tick ({per_tick_ms / 100:.1%} of a core), counters() "
                  f"{lean_ms:.2f} ms ({lean_ms / 100:.1%}) (p50)")
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--usage-only", action="store_true", help="only the state-reading part")
    parser.add_argument("--flood", type=int, default=100_000,
                        help="files in the tree a tenant leaves in its region directory")
    parser.add_argument(
        "--dirs",
        default="/tmp,/dev/shm",
        help="comma-separated parent dirs for the state dir (a disk and a tmpfs, say)",
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"machine: {machine.describe()}")
    for parent in [] if args.usage_only else args.dirs.split(","):
        root = Path(tempfile.mkdtemp(prefix="vgb-", dir=parent))
        fs = fs_type(root)
        print(f"\n== state dir on {parent} ({fs})")
        try:
            asyncio.run(bench_allocate(root, args.calls))
            bench_create(root, args.calls)
            bench_sweep(root, args.flood)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    root = Path(tempfile.mkdtemp(prefix="vgb-", dir="/tmp"))
    try:
        print()
        bench_usage(root, args.calls)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fs_type(path: Path) -> str:
    """The type of the filesystem holding `path`, from /proc/mounts (longest mount prefix)."""
    best, kind = "", "?"
    for entry in Path("/proc/mounts").read_text().splitlines():
        fields = entry.split()
        mount = fields[1]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fields[2]
    return kind


if __name__ == "__main__":
    main()

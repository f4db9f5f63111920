"""`vgpu-agent simulate`: the whole agent on simulated GPUs, with an in-process kubelet stand-in.

It shows, in readable log lines, the registration, the advertised devices and one sample
allocation per policy, then keeps running (until Ctrl-C or `--duration`). With `view` (the
default when stdout is a terminal) the log goes to a file and the terminal shows the live
`vgpu-agent top` view of the agent's own status instead of the share log lines.

Two more pods share one GPU and choose their compute policy by annotation (served to the agent by
`DemoPods` in place of the API server): an `inference` service (strict, priority 50) that is idle
and busy in turns, and a `batch` job (work-conserving) that borrows what the service leaves idle;
`demo_handover` lines show the loan taken back within a tick of the service turning busy.

With `--mode dra` the kubelet's DRA side registers the driver through its plugin watcher, the
agent publishes its ResourceSlice to an in-process API server stand-in, two claims (`memory:
10Gi, cores: 30`, and one default share) are allocated from that slice as the scheduler would,
prepared through the driver and run as simulated workloads steered to their grants. The API
stand-in and the allocator are the ones the tests use (`vgpu_agent/standins/`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import structlog

from vgpu_agent.agent import Agent
from vgpu_agent.config import Config
from vgpu_agent.deviceplugin.allocation import preferred_allocation
from vgpu_agent.deviceplugin.ids import parse_device_id
from vgpu_agent.gpu.sim import SimBackend
from vgpu_agent.kubelet.drastandin import DraKubeletStandIn
from vgpu_agent.kubelet.standin import Admission, KubeletStandIn
from vgpu_agent.shm.regions import SHIM_FILE
from vgpu_agent.simulation.demo import run_demo_workloads
from vgpu_agent.simulation.gpu import Workload
from vgpu_agent.simulation.handover import BATCH_WORKLOAD, HandoverLog, service_workload
from vgpu_agent.throttle.podpolicy import PodInfo

log = structlog.get_logger("vgpu_agent.simulate")

DEMO_NAMESPACE = "demo"
SIM_ROOT_PREFIX = "vgpu-agent-sim-"


def simulate_defaults() -> dict[str, object]:
    """Defaults for simulate: simulated GPUs, a fresh temporary root, loopback metrics."""
    root = tempfile.mkdtemp(prefix=SIM_ROOT_PREFIX)
    return {
        "backend": "sim",
        "sim_gpus": "2xA100-80GB,1xL4-24GB",
        "device_plugin_dir": os.path.join(root, "device-plugins"),
        "pod_resources_socket": os.path.join(root, "pod-resources", "kubelet.sock"),
        "state_dir": os.path.join(root, "state"),
        "metrics_address": "127.0.0.1:9394",
        "log_format": "console",
        "node_name": "sim-node",
        "plugin_registry_dir": os.path.join(root, "plugins_registry"),
        "dra_plugin_dir": os.path.join(root, "plugins"),
        "cdi_dir": os.path.join(root, "cdi"),
        "pod_priority_namespaces": DEMO_NAMESPACE,  # the inference pod's priority is accepted
    }


# The pair sharing one GPU: pod name -> (container, annotations, workload, memory part)
PAIR: dict[str, tuple[str, dict[str, str], Workload, float]] = {
    "inference": (
        "server",
        {"vgpu.io/core-policy": "strict", "vgpu.io/priority": "50"},
        service_workload(),
        0.3,
    ),
    "batch": ("train", {"vgpu.io/core-policy": "work-conserving"}, BATCH_WORKLOAD, 0.5),
}


class DemoPods:
    """The demo pods' annotations, as the agent's pod watch would read them from the API."""

    def __init__(self) -> None:
        self.pods = {
            (DEMO_NAMESPACE, name): PodInfo(f"demo-uid-{name}", DEMO_NAMESPACE, name, notes)
            for name, (_, notes, _, _) in PAIR.items()
        }

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self.pods.get((namespace, name))


def _say_who_plays_the_shim(agent: Agent) -> None:
    """Said before the agent's own `shim_not_installed` warning, which on a real node means
    containers run unenforced: here no container runs, and the demo plays the shim."""
    shim = agent.regions.shim_dir / SHIM_FILE
    if not shim.exists():
        log.info("sim_shim_played_by_the_demo", missing=str(shim),
                 why="no container runs here: the simulated workloads play the shim on the "
                     "region files, so the agent's shim_not_installed warning below is expected")


async def simulate(config: Config, duration: float = 0.0, view: bool = False) -> int:
    if config.mode == "dra":
        return await simulate_dra(config, duration, view)
    log_file = _log_to_file(config) if view else None
    kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
    await kubelet.start()
    agent = Agent(config, pods=DemoPods())
    _say_who_plays_the_shim(agent)
    agent_task = asyncio.create_task(agent.run(), name="agent")
    demo: asyncio.Task[object] | None = None
    view_task: asyncio.Task[None] | None = None
    try:
        resource = config.resource_name
        await kubelet.wait_for(
            lambda: bool(kubelet.registrations) and bool(_devices(kubelet, resource)), limit_s=30
        )
        reg = kubelet.registrations[-1]
        log.info(
            "kubelet_saw_registration",
            resource=reg.resource_name,
            endpoint=reg.endpoint,
            preferred_allocation=reg.options.get_preferred_allocation_available,
        )
        devices = _devices(kubelet, resource)
        log.info("kubelet_saw_devices", count=len(devices), first=devices[:3], last=devices[-1])
        for policy in ("spread", "binpack"):
            admission = await _sample_allocation(kubelet, resource, policy)
            log.info(
                "sample_allocation",
                policy=policy,
                pod=f"{admission.namespace}/{admission.pod}",
                device_ids=admission.device_ids,
                envs=dict(sorted(admission.response.envs.items())),
                mounts=[m.container_path for m in admission.response.mounts],
            )
        pair = await _share_one_gpu(kubelet, resource)
        if pair:
            await _until_bound(agent, pair)

        def pod_of(alloc_id: str) -> str | None:
            key = agent.regions.identity(alloc_id)
            return key[1] if key is not None and key[0] == DEMO_NAMESPACE else None

        def workload_for(alloc_id: str) -> tuple[Workload, float] | None:
            chosen = PAIR.get(pod_of(alloc_id) or "")
            return (chosen[2], chosen[3]) if chosen is not None else None

        def find(pod: str) -> str | None:
            return next((r.alloc_id for r in agent.regions.regions() if pod_of(r.alloc_id) == pod),
                        None)

        # The simulated containers play the shim on the allocations' real region files and
        # feed the simulated GPU's per-process samples to the agent's own controller.
        demo = asyncio.create_task(
            run_demo_workloads(
                agent.regions.regions,
                agent.backend if isinstance(agent.backend, SimBackend) else None,
                controller_status=lambda: agent.controller.status,
                report_every_s=5.0,
                workload_for=workload_for,
                on_step=HandoverLog(find, lambda: agent.controller.status,
                                    tick_s=config.throttle_tick_seconds),
            ),
            name="demo-workloads",
        )
        await agent.serving.wait()
        view_task = _announce(agent, log_file)
        await _run_for(agent_task, duration)
    finally:
        await _stop(agent, agent_task, view_task, demo)
        await kubelet.stop()
        _remove_own_root(config)
        if log_file is not None:
            log_file.close()
    return 0


def _log_to_file(config: Config) -> TextIO:
    """Send the log to a file that outlives the run, so the terminal can show the view."""
    from vgpu_agent.logging import configure

    fd, path = tempfile.mkstemp(prefix="vgpu-agent-simulate-", suffix=".log")
    os.close(fd)
    handle = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the run
    configure(config.log_format, config.log_level, stream=handle)
    return handle


async def _live_view(agent: Agent, interval_s: float = 1.0) -> None:
    """The `top` view of the agent's own status, refreshed every `interval_s`, on stdout."""
    from rich.console import Console
    from rich.live import Live

    from vgpu_agent.top import render

    console = Console(file=sys.stdout)
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            try:
                status = json.loads(await agent.metrics.status())
            except Exception as err:  # the view must never stop the demo
                log.warning("live_view_failed", error=repr(err))
            else:
                live.update(render(status), refresh=True)
            await asyncio.sleep(interval_s)


def _announce(agent: Agent, log_file: TextIO | None) -> asyncio.Task[None] | None:
    """Say where the metrics (and the log) are; with a log file, start the live view."""
    log.info("metrics_url", url=agent.metrics.url)
    print(f"metrics: {agent.metrics.url}  (Ctrl-C to stop)", flush=True)
    if log_file is None:
        return None
    print(f"log: {log_file.name}", flush=True)
    return asyncio.create_task(_live_view(agent), name="live-view")


async def _run_for(agent_task: asyncio.Task[None], duration: float) -> None:
    if duration > 0:
        await asyncio.wait({agent_task}, timeout=duration)
    else:
        await agent_task


async def _stop(
    agent: Agent,
    agent_task: asyncio.Task[None],
    *tasks: asyncio.Task[Any] | None,
) -> None:
    """Cancel the demo's own tasks, then stop the agent and wait for it."""
    for task in tasks:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    agent.stop()
    with contextlib.suppress(asyncio.CancelledError):
        await agent_task


def _remove_own_root(config: Config) -> None:
    """Remove the temporary root `simulate_defaults` made (never a directory the user chose)."""
    root = os.path.dirname(config.state_dir)
    inside = all(
        os.path.dirname(p) == root
        for p in (config.device_plugin_dir, os.path.dirname(config.pod_resources_socket))
    )
    if inside and os.path.basename(root).startswith(SIM_ROOT_PREFIX):
        shutil.rmtree(root, ignore_errors=True)


def _devices(kubelet: KubeletStandIn, resource: str) -> list[str]:
    state = kubelet.resources.get(resource)
    return sorted(state.devices) if state else []


async def _share_one_gpu(kubelet: KubeletStandIn, resource: str) -> list[Admission]:
    """One slice each for the inference and the batch pod, on the GPU with the most free slices."""
    by_gpu: dict[str, list[str]] = {}
    for device_id in kubelet.free_devices(resource):
        by_gpu.setdefault(parse_device_id(device_id).uuid, []).append(device_id)
    free = max(by_gpu.values(), key=len, default=[])
    if len(free) < len(PAIR):
        log.warning("demo_pair_skipped", reason="no GPU has two free slices")
        return []
    admitted = []
    for (name, (container, notes, _, _)), device_id in zip(PAIR.items(), sorted(free),
                                                           strict=False):
        response = await kubelet.allocate(resource, [device_id])
        admission = Admission(DEMO_NAMESPACE, name, container, resource, [device_id], response)
        kubelet.admissions.append(admission)
        admitted.append(admission)
        log.info("sample_pod", pod=f"{DEMO_NAMESPACE}/{name}", device_ids=[device_id],
                 annotations=notes)
    return admitted


async def _until_bound(agent: Agent, pair: list[Admission], limit_s: float = 10.0) -> None:
    """Wait until PodResources has bound the pair's regions (the demo picks workloads by pod)."""
    wanted = {(a.namespace, a.pod, a.container) for a in pair}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while loop.time() < deadline:
        bound = {agent.regions.identity(r.alloc_id) for r in agent.regions.regions()}
        if wanted <= bound:
            return
        await asyncio.sleep(0.1)
    log.warning("demo_pair_unbound", effect="the pair runs the default demo workloads")


async def _sample_allocation(kubelet: KubeletStandIn, resource: str, policy: str) -> Admission:
    """Choose two slices by `policy` among the free ones and allocate them for a demo pod."""
    free = kubelet.free_devices(resource)
    chosen = preferred_allocation(free, [], 2, "spread" if policy == "spread" else "binpack")
    response = await kubelet.allocate(resource, chosen)
    admission = Admission(DEMO_NAMESPACE, f"{policy}-pod", "main", resource, chosen, response)
    kubelet.admissions.append(admission)
    return admission


# --- DRA mode ------------------------------------------------------------------------------------

DRA_DEMO_CLAIMS = (
    ("sized", {"memory": "10Gi", "cores": "30"}),
    ("default-share", None),
)


async def simulate_dra(config: Config, duration: float = 0.0, view: bool = False) -> int:
    from vgpu_agent.standins.dra_allocator import allocate_in
    from vgpu_agent.standins.kubeapi import FakeKubeAPI as fake_api
    log_file = _log_to_file(config) if view else None
    api = fake_api(token=None)
    await api.start()
    node = config.node_name or "sim-node"
    api.add_node(node)
    driver = config.dra_driver_name
    api.resources.create(
        "deviceclasses",
        "",
        {
            "metadata": {"name": driver},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
        },
    )
    root = Path(config.state_dir).parent
    kubeconfig = api.write_kubeconfig(root / "kubeconfig")
    config = dataclasses.replace(config, kubeconfig=str(kubeconfig), node_name=node)
    kubelet = KubeletStandIn(config.device_plugin_dir, config.pod_resources_socket)
    await kubelet.start()
    dra = DraKubeletStandIn(config.plugin_registry_dir, config.dra_plugin_dir, kubelet=kubelet)
    await dra.start()
    agent = Agent(config)
    agent_task = asyncio.create_task(agent.run(), name="agent")
    demo: asyncio.Task[object] | None = None
    view_task: asyncio.Task[None] | None = None
    try:
        plugin = await dra.wait_registered(driver, limit_s=30)
        log.info("kubelet_saw_dra_driver", driver=driver, endpoint=plugin.endpoint,
                 version=plugin.version)  # fmt: skip
        for _ in range(600):  # the publisher's first write, at most 30 s
            if api.resources.slices(node, driver):
                break
            await asyncio.sleep(0.05)
        (published,) = api.resources.slices(node, driver)
        for device in published["spec"]["devices"]:
            log.info(
                "api_saw_resourceslice_device",
                device=device["name"],
                capacity={k: v["value"] for k, v in device.get("capacity", {}).items()},
            )
        for name, capacity in DRA_DEMO_CLAIMS:
            exactly: dict[str, Any] = {"deviceClassName": driver}
            if capacity:
                exactly["capacity"] = {"requests": capacity}
            requests = [{"name": "gpu", "exactly": exactly}]
            body = {"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}}
            created = api.resources.create("resourceclaims", DEMO_NAMESPACE, body)
            allocated = allocate_in(api.resources, DEMO_NAMESPACE, name, node)
            ref = (DEMO_NAMESPACE, name, created["metadata"]["uid"])
            (claim,) = await dra.start_container(DEMO_NAMESPACE, f"{name}-pod", "main", driver,
                                                 [ref])  # fmt: skip
            result = allocated["status"]["allocation"]["devices"]["results"][0]
            log.info(
                "sample_claim_prepared",
                claim=f"{DEMO_NAMESPACE}/{name}",
                device=result["device"],
                consumed=result.get("consumedCapacity"),
                cdi_devices=[list(d.cdi_device_ids) for d in claim.devices],
            )
        demo = asyncio.create_task(
            run_demo_workloads(
                agent.regions.regions,
                agent.backend if isinstance(agent.backend, SimBackend) else None,
                controller_status=lambda: agent.controller.status,
                report_every_s=5.0,
            ),
            name="demo-workloads",
        )
        await agent.serving.wait()
        view_task = _announce(agent, log_file)
        await _run_for(agent_task, duration)
    finally:
        await _stop(agent, agent_task, view_task, demo)
        await dra.stop()
        await kubelet.stop()
        await api.stop()
        _remove_own_root(config)
        if log_file is not None:
            log_file.close()
    return 0

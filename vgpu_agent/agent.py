"""Composition: builds every adapter from the `Config` and runs them as named, supervised tasks.

Start-up order: GPU backend (retried with backoff until it starts) -> inventory -> device state
-> device plugin (serving, then registered) -> health monitor. What the kubelet does not wait for
is imported and started after `Register`: the metrics endpoint (aiohttp and prometheus_client,
a third of the start-up's imports; its port is checked at once, it serves at the latest
`METRICS_START_LATEST_S` after start, and at once when the GPU backend fails to start), then the
Kubernetes client. Shutdown (SIGTERM/SIGINT or `stop()`): the task group is cancelled; the plugin
runner removes its socket on the way out.

`mode` picks the kubelet-facing front door: the device plugin, or the DRA driver (claims read
from the API, registration through the plugin watcher). Never both: a node must not serve the
same GPUs twice. Everything behind the front door (regions, the throttle controller, metrics,
health, node labels and events) is the same in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import gc
import importlib
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from vgpu_agent import __version__, hostmemory
from vgpu_agent.backoff import Backoff
from vgpu_agent.config import Config, ConfigError
from vgpu_agent.cpumeter import CpuMeter
from vgpu_agent.deviceplugin.allocation import (
    Grant,
    SpillHostMemoryError,
    Split,
    check_spill_host_memory,
)
from vgpu_agent.deviceplugin.registration import PluginRunner, check_plugin_dir
from vgpu_agent.deviceplugin.server import DevicePluginServicer, DeviceState, Extras
from vgpu_agent.gpu.health import HealthMonitor
from vgpu_agent.gpu.model import GpuBackend, GpuError, GpuInfo, Inventory
from vgpu_agent.kubelet.podresources import ContainerRef, PodResourcesClient
from vgpu_agent.metrics.sources import MetricsSources, RegistrationView
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import Region, RegionStore
from vgpu_agent.shm.spill import SpillNotice, SpillReports
from vgpu_agent.throttle.attribution import HostEvidence
from vgpu_agent.throttle.backstop import Breach
from vgpu_agent.throttle.controller import ThrottleController, unlent_tick
from vgpu_agent.throttle.figurefile import FILE_NAME as FIGURE_FILE_NAME
from vgpu_agent.throttle.figurefile import FigureFile
from vgpu_agent.throttle.identity import Attributor, NamespacePidResolver, ProcEvidence
from vgpu_agent.throttle.podpolicy import PodPolicyRules
from vgpu_agent.throttle.regionpolicy import PodLookup, RegionPolicies
from vgpu_agent.throttle.watch import BackstopWatch
from vgpu_agent.timerslack import slack_deadline

if TYPE_CHECKING:  # kubernetes_asyncio is imported only when something needs the API
    from vgpu_agent.dra.claims import ClaimReader
    from vgpu_agent.dra.driver import DraDriver
    from vgpu_agent.dra.server import DraPluginRunner
    from vgpu_agent.gpu.health import HealthChange
    from vgpu_agent.kube.node import NodeIntegration
    from vgpu_agent.kube.pods import NodePods
    from vgpu_agent.kube.resourceslices import ResourceSlicePublisher
    from vgpu_agent.metrics.http import MetricsService

log = structlog.get_logger(__name__)

SPILL_CHECK_S = 5.0  # how often regions are read for spilled memory (only with spilling on)
# A stopped agent exits within this many seconds whatever hangs (the kubelet's SIGKILL comes later)
SHUTDOWN_DEADLINE_S = 4.5
# The metrics endpoint waits for `Register` (the kubelet's probes start seconds later), but no
# longer than this after `run()` starts: a kubelet that is not there must not keep probes off.
METRICS_START_LATEST_S = 1.0


def make_backend(config: Config) -> GpuBackend:
    if config.backend == "sim":
        from vgpu_agent.gpu.sim import SimBackend

        return SimBackend(config.sim_gpus)
    from vgpu_agent.gpu.nvml import NvmlBackend

    return NvmlBackend(config.nvml_library)


def pod_policy_rules(config: Config) -> PodPolicyRules:
    """What pods may choose by annotation on this node, from the configuration."""
    return PodPolicyRules(
        default_policy=config.core_policy,
        allowed_policies=frozenset(config.pod_core_policies),
        priority_max=config.pod_priority_max,
        priority_namespaces=frozenset(config.pod_priority_namespaces),
    )


@dataclass
class TaskHealth:
    """Liveness of the supervised tasks, for /healthz, and the CPU each spent on the loop."""

    restarts: dict[str, int] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    loop_heartbeat: float = field(default_factory=time.monotonic)
    meters: dict[str, CpuMeter] = field(default_factory=dict)

    @property
    def cpu_seconds(self) -> dict[str, float]:
        """Per task, the event loop thread's CPU its own steps took, restarts included."""
        return {name: meter.seconds for name, meter in list(self.meters.items())}


def _simulated_host(backend: GpuBackend) -> HostEvidence | None:
    """A simulated node answers for its simulated processes; a real one is examined in /proc."""
    from vgpu_agent.gpu.sim import SimBackend

    return backend if isinstance(backend, SimBackend) else None


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        backend: GpuBackend | None = None,
        pods: PodLookup | None = None,
        host_memory: Callable[[], int] | None = None,
        exit_process_after_s: float | None = None,
    ):
        self.config = config
        self.exit_process_after_s = exit_process_after_s
        self._watchdog: threading.Timer | None = None
        self.backend = backend or make_backend(config)
        self.split = Split(
            config.split_count,
            config.memory_scaling,
            config.cores_scaling,
            spill=config.memory_oversubscription == "spill",
        )
        self.host_memory = host_memory or (lambda: hostmemory.host_memory(config.host_proc_dir))
        self.spills = SpillReports()
        self.inventory: Inventory | None = None
        self.backend_error = ""
        self.state: DeviceState | None = None
        self.runner: PluginRunner | None = None
        self.health: HealthMonitor | None = None
        self.regions = RegionStore(
            config.state_dir,
            default_policy=config.core_policy,
            container_region_dir=config.container_region_dir,
            container_shim_path=config.container_shim_path,
            gc_grace_s=config.region_gc_grace_seconds,
            control_flags=(layout.CONTROL_ALLOW_DISABLE if config.shim_allow_disable else 0)
            | (layout.CONTROL_ALLOW_REGION_DIR if config.shim_allow_region_dir else 0),
        )
        self.pod_resources = PodResourcesClient(
            config.pod_resources_socket,
            config.resource_name,
            dra_driver=config.dra_driver_name if config.mode == "dra" else None,
        )
        self.dra: DraFrontDoor | None = None
        max_tick_s = config.throttle_tick_seconds * config.throttle_calm_slowdown
        self.controller = ThrottleController(
            self.backend,
            self.regions.regions,
            tick_s=config.throttle_tick_seconds,
            max_tick_s=max_tick_s,
            unlent_tick_s=unlent_tick(config.throttle_tick_seconds, max_tick_s,
                                      config.throttle_settled_tick_seconds),
            nvml_poll_periods=config.throttle_nvml_poll_periods,
            solo_turns=config.throttle_solo_turns,
            solo_turn_spare_priority=config.throttle_solo_turn_spare_priority,
            figure_max_age_s=config.throttle_figure_max_age_seconds,
            default_policy=config.core_policy,
            proc_root=config.host_proc_dir,
            container_region_dir=config.container_region_dir,
            # a simulated node proves its simulated processes itself; a real one through /proc
            evidence=_simulated_host(self.backend),
            # what containers alone showed on time-sliced GPUs, kept across restarts
            figure_file=FigureFile(os.path.join(config.state_dir, FIGURE_FILE_NAME)),
        )
        self.regions.on_added = self.controller.wake  # it sleeps while there are no regions
        self.node: NodeIntegration | None = None
        # The agent's own limit check, on an attributor of its own (the controller's keeps
        # per-tick state); what it finds goes to the pod (`_on_breach`).
        self.backstop = BackstopWatch(
            self.backend,
            self.regions.regions,
            lambda: self.controller.status,
            Attributor(
                _simulated_host(self.backend)
                or ProcEvidence(config.host_proc_dir, config.container_region_dir),
                NamespacePidResolver(config.host_proc_dir),
                budget_slots=False,
            ),
            self._on_breach,
        )
        # Pods' own core policy and priority (annotations); `pods` stands in for the API's pods
        # (the simulation), else the node integration's pod watch provides them.
        self.pods: NodePods | None = None  # kube.pods is imported with the node integration
        self.pod_policies = RegionPolicies(
            self._pod_policy_regions,
            self.regions.identity,
            pod_policy_rules(config),
            pods=pods,
        )
        self.tasks = TaskHealth()
        self._metrics: MetricsService | None = None  # built once the kubelet has us (`serving`)
        self._early_results: list[tuple[str, float]] = []  # Allocate results before /metrics
        self._front_door_up = asyncio.Event()  # registered with the kubelet (or DRA serving)
        self.serving = asyncio.Event()  # set once /metrics, /healthz and /readyz answer
        self.ready = asyncio.Event()  # set once the plugin is serving and the inventory is known
        self._stop = asyncio.Event()

    @property
    def metrics(self) -> MetricsService:
        """The metrics endpoint; it exists once `serving` is set."""
        if self._metrics is None:
            raise RuntimeError("the metrics endpoint is not started yet: wait for `serving`")
        return self._metrics

    def stop(self) -> None:
        self._stop.set()
        if self._watchdog is None:  # from the first stop request, wherever the agent is
            self._watchdog = self._arm_watchdog()

    async def run(self) -> None:
        """Run until `stop()` or a signal; returns after an orderly shutdown.

        Nothing that fails on the way out stops the shutdown: it is logged and the next step
        runs. With `exit_process_after_s` the process exits (status 0) that long after the stop
        was asked for even if some step hangs.
        """
        raise_open_files_limit()
        asyncio.get_running_loop().set_exception_handler(_log_loop_error)
        with _signals(self.stop):
            try:
                async with asyncio.TaskGroup() as group:
                    # Allocate needs both directories, probes the metrics port: find out now,
                    # not at the first Allocate or once registered.
                    await asyncio.to_thread(self._check_directories)
                    await asyncio.to_thread(self._check_metrics_port)
                    group.create_task(self._serve_metrics(group), name="metrics-start")
                    group.create_task(self._main(group), name="main")
                    group.create_task(self._heartbeat(), name="loop-heartbeat")
                    await self._stop.wait()
                    raise _Shutdown
            except* _Shutdown:
                pass
            except* Exception as failed:
                if not self._stop.is_set():
                    raise
                for err in failed.exceptions:
                    log.error("shutdown_step_failed", step="tasks", error=repr(err))
        for step, action in (
            ("metrics", self._stop_metrics),
            ("pod-resources", self.pod_resources.close),
            ("dra", self._close_dra),
            ("regions", lambda: _completed(self.regions.close)),
            ("gpu-backend", lambda: asyncio.to_thread(self.backend.shutdown)),
        ):
            try:
                await action()
            except Exception as err:
                log.error("shutdown_step_failed", step=step, error=repr(err))
        if self._watchdog is not None:
            self._watchdog.cancel()
        log.info("agent_stopped")

    def _arm_watchdog(self) -> threading.Timer | None:
        if self.exit_process_after_s is None:
            return None
        after_s = self.exit_process_after_s
        timer = threading.Timer(after_s, _exit_stuck, (after_s,))
        timer.daemon = True
        timer.start()
        return timer

    def _check_directories(self) -> None:
        """Raise OSError naming the path if the state dir or the plugin dir is unusable."""
        self.regions.check_usable()
        check_plugin_dir(self.config.device_plugin_dir)

    def _check_metrics_port(self) -> None:
        """Raise OSError naming the address if the metrics port cannot be bound (it is taken)."""
        check_port_bindable(*self.config.metrics_host_port())

    async def _serve_metrics(self, group: asyncio.TaskGroup) -> None:
        """Import and start the metrics endpoint once registered (at the latest after
        `METRICS_START_LATEST_S`); the import runs in a worker thread so that the kubelet's
        first calls after `Register` are answered meanwhile."""
        # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation (a stop)
        # that arrives as the event is set, and this task would go on starting things
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(METRICS_START_LATEST_S):
                await self._front_door_up.wait()
        http = await asyncio.to_thread(importlib.import_module, "vgpu_agent.metrics.http")
        host, port = self.config.metrics_host_port()
        metrics: MetricsService = http.MetricsService(
            self._metrics_sources(),
            host=host,
            port=port,
            backend=self.backend,
            poll_s=self.config.nvml_poll_seconds,
            hami=self.config.hami_metrics,
        )
        await metrics.start()
        self._metrics = metrics
        for result, seconds in self._early_results:
            metrics.instruments.on_result(result, seconds)
        self._early_results.clear()
        self._supervise(group, "metrics-caches", self._refresh_metrics)
        gc.freeze()  # what the endpoint built lives as long as the agent (see `_main`)
        self.serving.set()

    async def _stop_metrics(self) -> None:
        if self._metrics is not None:
            await self._metrics.stop()

    def _on_result(self, result: str, seconds: float) -> None:
        """Allocate's outcome for the metrics; kept until the endpoint exists."""
        if self._metrics is not None:
            self._metrics.instruments.on_result(result, seconds)
        elif len(self._early_results) < 1024:
            self._early_results.append((result, seconds))

    async def _main(self, group: asyncio.TaskGroup) -> None:
        self.inventory = await self._start_backend()
        for uuid, reason in self.inventory.skipped.items():
            log.warning("gpu_skipped", uuid=uuid, reason=reason)
        gpus = self.inventory.gpus
        log.info(
            "inventory",
            gpus=[
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_mib": g.memory_total >> 20,
                }
                for g in gpus
            ],
            split_count=self.split.count,
        )
        # DRA claims get exactly what they consume: nothing there spills (yet)
        spilling = self.split.spills and self.config.mode != "dra"
        if spilling:
            await asyncio.to_thread(self._check_spill, gpus)
        self.state = DeviceState(gpus, self.split)
        # Running containers keep their limits: existing regions are adopted as they are.
        adopted = await asyncio.to_thread(self.regions.adopt)
        log.info("regions_adopted", count=len(adopted))
        if self.config.mode == "dra":
            self.dra = DraFrontDoor(self.config, self.split, gpus, self.regions, self._on_prepared)
            self.dra.driver.restore()
            self.regions.prepare_spares(1)
            self._supervise(group, "dra-plugin", self.dra.runner.run)
            self._front_door_up.set()  # the DRA front door imported its Kubernetes client already
        else:
            self.regions.prepare_spares(1)  # most containers ask for slices of one GPU
            servicer = DevicePluginServicer(
                self.state,
                policy=self.config.allocation_policy,
                strategy=self.config.device_list_strategy,
                cdi_vendor_class=self.config.cdi_vendor_class,
                on_grant=self._on_grant,
                on_result=self._on_result,
            )
            self.runner = PluginRunner(
                servicer,
                plugin_dir=self.config.device_plugin_dir,
                endpoint=self.config.endpoint_name,
                resource_name=self.config.resource_name,
            )
            self.runner.status.listeners.append(self._front_door_up.set)
        self.health = HealthMonitor(
            self.backend,
            gpus,
            frozenset(self.config.xid_ignore),
            self.config.health_recovery_seconds,
            check_interval_s=self.config.health_check_seconds,
        )
        if self.runner is not None:
            self._supervise(group, "device-plugin", self.runner.run)
        self._supervise(group, "health", self.health.run)
        if self.dra is not None:
            # the ResourceSlice the scheduler allocates from, GPU health as device taints
            from vgpu_agent.kube.resourceslices import ResourceSlicePublisher

            publisher = ResourceSlicePublisher.from_config(self.config, gpus, health=self.health)
            self.dra.publisher = publisher
            self._supervise(group, "dra-slices", publisher.run)
        if self.runner is not None:
            self._supervise(group, "health-to-plugin", self._apply_health)
        self._supervise(
            group,
            "pod-resources",
            lambda: self.pod_resources.run(
                self.config.pod_resources_refresh_seconds,
                self._reconcile,
                idle=lambda: not self.regions.regions(),  # nothing to bind or collect
            ),
        )
        self._supervise(group, "pod-policies", self.pod_policies.run)
        self._supervise(group, "throttle", self.controller.run)
        self._supervise(group, "backstop", self.backstop.run)
        if spilling:
            self._supervise(group, "spill-events", self._watch_spills)
        self._start_node_integration(group, gpus)
        # Everything built so far lives as long as the agent: keep the collector from
        # re-scanning it on every collection during the 100 ms control ticks.
        gc.freeze()
        self.ready.set()

    def _check_spill(self, gpus: list[GpuInfo]) -> None:
        """Refuse to start when spilling could promise more than the host's share for it."""
        host = self.host_memory()
        try:
            promised = check_spill_host_memory(
                (g.memory_total for g in gpus),
                self.split,
                host,
                self.config.spill_host_memory_fraction,
            )
        except SpillHostMemoryError as err:
            log.error("spill_refused", reason=str(err), host_memory=host)
            raise ConfigError(
                "memory_oversubscription",
                self.config.memory_oversubscription,
                f"{err}; lower memory_scaling, raise spill_host_memory_fraction "
                f"(now {self.config.spill_host_memory_fraction}) or set it to off",
            ) from None
        log.info("spill_on", promised_bytes=promised, host_memory=host)

    async def _watch_spills(self) -> None:
        """Tell each container that starts spilling, once: a log line and an event on its pod."""
        while True:
            for notice in await asyncio.to_thread(self._spill_notices):
                self._report_spill(notice)
            await asyncio.sleep(SPILL_CHECK_S)

    def _spill_notices(self) -> list[SpillNotice]:
        notices = []
        regions = self.regions.regions()
        for region in regions:
            usage = region.usage()
            uuids = region.device_uuids
            limits = [region.memory_limit(dev) for dev in range(len(uuids))]
            notice = self.spills.observe(
                region.alloc_id, self.regions.identity(region.alloc_id), usage, uuids, limits
            )
            if notice is not None:
                notices.append(notice)
        self.spills.forget(r.alloc_id for r in regions)
        return notices

    def _report_spill(self, notice: SpillNotice) -> None:
        from vgpu_agent.kube.events import SpilledDevice

        namespace, pod_name, container = notice.container
        index = {g.uuid: g.index for g in self.inventory.gpus} if self.inventory else {}
        devices = [
            SpilledDevice(d.gpu_uuid, index.get(d.gpu_uuid), d.spilled_bytes, d.limit_bytes)
            for d in notice.devices
        ]
        log.info(
            "memory_spilled",
            alloc_id=notice.alloc_id,
            namespace=namespace,
            pod=pod_name,
            container=container,
            devices=[dataclasses.asdict(d) for d in devices],
        )
        pod = self.pods.pod(namespace, pod_name) if self.pods is not None else None
        if self.pods is not None and pod is not None:
            self.pods.report_spill(pod, container, devices)

    def _start_node_integration(self, group: asyncio.TaskGroup, gpus: list[GpuInfo]) -> None:
        """Labels and events through the Kubernetes API; never in the device plugin's way."""
        if not self.config.node_name:
            log.warning("kube_node_unknown", detail="no node name: node labels and events are off")
            return
        assert self.health is not None
        # Health changes from now on are kept until the integration is there to report them.
        early: list[HealthChange] = []
        self.health.add_listener(
            lambda change: self.node.on_health_change(change) if self.node else early.append(change)
        )
        group.create_task(self._node_integration(group, gpus, early), name="kube-start")

    async def _node_integration(
        self, group: asyncio.TaskGroup, gpus: list[GpuInfo], early: list[HealthChange]
    ) -> None:
        # kubernetes_asyncio takes about a second to import: a worker thread does it, and only
        # once registered and serving metrics, so that neither waits for it (the GIL is shared).
        await self.serving.wait()
        try:
            kube_node = await asyncio.to_thread(importlib.import_module, "vgpu_agent.kube.node")
            kube_pods = await asyncio.to_thread(importlib.import_module, "vgpu_agent.kube.pods")
        except Exception:
            log.exception("kube_import_failed", detail="node labels and events are off")
            return
        node: NodeIntegration = kube_node.NodeIntegration(
            self.config.node_name, self.config.kubeconfig
        )
        for change in early:
            node.on_health_change(change)
        early.clear()
        self.node = node
        self._supervise(group, "kube", node.run)
        if self.pod_policies.pods is None:
            pods = kube_pods.NodePods(
                self.config.node_name, node.api_configuration, on_change=self.pod_policies.poke
            )
            self.pods = pods
            self.pod_policies.pods = pods
            self.pod_policies.on_refusal = pods.report_refusal
            self._supervise(group, "kube-pods", pods.run)

        async def publish() -> None:
            await node.publish_labels(gpus, self.config.split_count, __version__)

        group.create_task(publish(), name="kube-labels")
        gc.freeze()

    async def _refresh_metrics(self) -> None:
        async with asyncio.TaskGroup() as group:
            if self.metrics.poller is not None:
                group.create_task(self.metrics.poller.run(), name="metrics-gpu-poller")
            group.create_task(self.metrics.regions.run(), name="metrics-region-cache")

    def _metrics_sources(self) -> MetricsSources:
        return MetricsSources(
            node=self.config.node_name,
            gpus=lambda: self.inventory.gpus if self.inventory is not None else [],
            slices_per_gpu=self.split.count,
            regions=self.regions.regions,
            identity=self.regions.identity,
            healthy=lambda: self.health.healthy() if self.health is not None else {},
            xid_counts=lambda: self.health.xid_counts if self.health is not None else {},
            throttle_status=lambda: self.controller.status,
            time_sliced_gpus=lambda: self.controller.time_sliced_gpus,
            use_only_strangers_gpus=lambda: self.controller.use_only_strangers_gpus,
            phase_changes=lambda: self.controller.phase_changes,
            use_charged_to_nobody=lambda: self.controller.use_charged_to_nobody,
            solo_turns=lambda: self.controller.solo_turns_given,
            unmeasured=lambda: self.controller.unmeasured_containers,
            sample_periods=lambda: self.controller.nvml_sample_periods,
            poll_periods=lambda: self.controller.nvml_poll_periods_now,
            nvml_utilization_calls=lambda: self.controller.nvml_utilization_calls,
            throttle_ticks=lambda: self.controller.ticks,
            registration=self._registration,
            nvml_errors=lambda: getattr(self.backend, "errors_by_call", {}),
            region_events=self._region_events,
            pod_resources_failures=lambda: self.pod_resources.failures,
            tasks=lambda: self.tasks,
            policy_source=self._policy_source,
            backend_error=lambda: (
                self.backend_error or ("" if self.inventory is not None else "GPU backend starting")
            ),
            claims=lambda: self.dra.claims_by_region() if self.dra is not None else {},
            allocate_error=lambda: self.regions.create_error,
        )

    async def _close_dra(self) -> None:
        if self.dra is not None:
            await self.dra.close()

    def _pod_policy_regions(self) -> list[Region]:
        """Regions whose policy and priority pods choose by annotation: all but DRA claims',
        which their claim's parameters (or the node default) decide once, at Prepare."""
        regions = self.regions.regions()
        if self.dra is None:
            return regions
        claims = self.dra.claims_by_region()
        return [r for r in regions if r.alloc_id not in claims]

    def _policy_source(self, alloc_id: str) -> str:
        if self.dra is not None and alloc_id in self.dra.claims_by_region():
            return "claim"
        return self.pod_policies.source(alloc_id)

    def _registration(self) -> RegistrationView | None:
        if self.runner is not None:
            return self.runner.status
        return self.dra.runner if self.dra is not None else None

    def _on_prepared(self) -> None:
        self.pod_resources.poke()  # learn soon which container uses the new claim

    def _region_events(self) -> dict[str, int]:
        events = dataclasses.asdict(self.regions.counters)
        events["state_read_corrupt"] = self.regions.corrupt_reads()
        events["state_records_skipped"] = self.regions.skipped_records()
        events.update(self.regions.tampering())
        events["backstop_memory"] = self.backstop.breaches["memory"]
        events["backstop_sm"] = self.backstop.breaches["sm"]
        if self.node is not None:
            events["backstop_evictions"] = self.node.evictions
        # claims in `state` that the host refuted (per region in the log and the controller)
        events["identity_rejected"] = self.controller.attributor.rejected_total
        # ticks in which a device's `state` claimed more tokens than its bucket let through
        events["tokens_overclaimed"] = self.controller.error_counts.get("tokens_overclaimed", 0)
        # readings of a strict container's own use above its target, twelve in a row or more,
        # not following the law's falling k (`throttle/audit.py`, OveruseWatch)
        events["use_over_target"] = self.controller.error_counts.get("use_over_target", 0)
        return events

    def _on_breach(self, breach: Breach) -> None:
        """A container over its limits: a Warning Event on its pod, evicted with `evict`."""
        owner = self.regions.identity(breach.alloc_id)
        lookup = self.pod_policies.pods  # the node's pods as the pod watch delivers them
        known = lookup.pod(owner[0], owner[1]) if owner and lookup is not None else None
        if owner is None or self.node is None or known is None:
            reason = ("its container is not known" if owner is None
                      else "no Kubernetes API" if self.node is None
                      else "its pod is not (yet) in the node's pod list")
            log.warning("backstop_breach_unreported", alloc_id=breach.alloc_id, reason=reason)
            return
        namespace, pod, container = owner
        self.node.on_container_breach(namespace, pod, known.uid, container, breach.describe(),
                                      evict=self.config.backstop_action == "evict")

    async def _reconcile(self, assignments: Mapping[str, ContainerRef]) -> dict[str, str]:
        """Bind regions to containers, then give each newly bound region its pod's policy."""
        removed = await self.regions.reconcile(assignments)
        self.pod_policies.poke()
        return removed

    async def _on_grant(self, grant: Grant) -> Extras:
        extras = await self.regions.on_grant(grant)
        self.pod_resources.poke()  # learn soon which container the new region belongs to
        return extras

    async def _start_backend(self) -> Inventory:
        backoff = Backoff(initial=0.5, cap=30.0, jitter=0)
        while True:
            try:
                await asyncio.to_thread(self.backend.start)
                inventory = await asyncio.to_thread(self.backend.discover)
                self.backend_error = ""
                return inventory
            except GpuError as err:
                self.backend_error = str(err)
                self._front_door_up.set()  # no Register soon: probes answer now, saying why
                delay = backoff.next_delay()
                log.error(
                    "gpu_backend_start_failed", error=str(err), call=err.call, retry_in_s=delay
                )
                await asyncio.sleep(delay)

    async def _apply_health(self) -> None:
        assert self.health is not None and self.state is not None
        changes = self.health.subscribe()
        while True:
            change = await changes.get()  # the monitor logs each change itself
            await self.state.set_health(change.uuid, change.healthy)

    async def _heartbeat(self) -> None:
        while True:
            self.tasks.loop_heartbeat = time.monotonic()
            await asyncio.sleep(1.0)

    def _supervise(
        self, group: asyncio.TaskGroup, name: str, factory: Callable[[], Awaitable[None]]
    ) -> None:
        """Run `factory()` as a named task; restart it with backoff if it fails, never silently."""

        async def supervised() -> None:
            backoff = Backoff(initial=0.5, cap=30.0, jitter=0)
            meter = self.tasks.meters.setdefault(name, CpuMeter())
            while True:
                self.tasks.running.add(name)
                try:
                    await meter.run(factory())
                    log.info("task_finished", task=name)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    if _cancelling():
                        # It failed on its way out (a socket that cannot be removed, say): the
                        # shutdown goes on, and a restart would keep the agent from exiting.
                        log.error("task_failed_while_stopping", task=name, error=repr(err))
                        raise asyncio.CancelledError from err
                    delay = backoff.next_delay()
                    log.exception("task_failed", task=name, restart_in_s=delay)
                    self.tasks.restarts[name] = self.tasks.restarts.get(name, 0) + 1
                finally:
                    self.tasks.running.discard(name)
                await asyncio.sleep(delay)

        group.create_task(supervised(), name=name)


class DraFrontDoor:
    """The DRA driver's parts, built from the config: claim reader, driver, sockets."""

    def __init__(
        self,
        config: Config,
        split: Split,
        gpus: list[GpuInfo],
        regions: RegionStore,
        on_prepared: Callable[[], None],
    ):
        # The DRA parts need the Kubernetes client: imported here, in DRA mode only (the lean
        # client registered first, by the kube package).
        from vgpu_agent import kube  # noqa: F401
        from vgpu_agent.dra.checkpoint import Checkpoint
        from vgpu_agent.dra.claims import ClaimReader
        from vgpu_agent.dra.driver import DraDriver
        from vgpu_agent.dra.grant import ClaimPriorityBound, device_table
        from vgpu_agent.dra.server import DraPluginRunner

        self.reader: ClaimReader = ClaimReader(config.kubeconfig)
        self.publisher: ResourceSlicePublisher | None = None  # set once the health monitor exists
        devices = device_table(gpus, split)
        plugin_dir = f"{config.dra_plugin_dir.rstrip('/')}/{config.dra_driver_name}"
        self.driver: DraDriver = DraDriver(
            driver=config.dra_driver_name,
            node=config.node_name,
            devices=lambda: devices,
            read_claim=self.reader.read,
            regions=regions,
            cdi_dir=config.cdi_dir,
            checkpoint=Checkpoint(f"{plugin_dir}/checkpoint.json"),
            gpu_cdi_kind=config.cdi_vendor_class,
            on_prepared=on_prepared,
            # a claim's own priority is held to what a pod's annotation may take
            priority_bound=ClaimPriorityBound(config.pod_priority_max,
                                              frozenset(config.pod_priority_namespaces)),
        )
        self.runner: DraPluginRunner = DraPluginRunner(
            self.driver,
            driver_name=config.dra_driver_name,
            dra_socket=config.dra_socket,
            registration_socket=config.registration_socket,
        )

    def claims_by_region(self) -> dict[str, tuple[str, str, str]]:
        return {
            c.alloc_id: (c.claim.namespace, c.claim.name, c.claim.uid)
            for c in self.driver.prepared.values()
            if c.alloc_id is not None
        }

    async def close(self) -> None:
        await self.reader.close()


class _Shutdown(Exception):
    pass


class SlackEventLoop(asyncio.SelectorEventLoop):
    """The agent process's event loop: timers due far ahead fire on a shared grid, so that the
    periodic tasks of an idle agent share their wake-ups (`vgpu_agent.timerslack`)."""

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        return super().call_at(slack_deadline(self.time(), when), callback, *args, context=context)


def run_process(agent: Agent) -> None:
    """Run `agent` as the process's whole life, on a `SlackEventLoop`."""
    with asyncio.Runner(loop_factory=SlackEventLoop) as runner:
        runner.run(agent.run())


def raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: containers often start with a soft 1024, and
    the agent's descriptors (regions, gRPC, metrics clients) must not be what runs out first."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raised = soft
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            # an unlimited hard limit still has the kernel's nr_open above it: a high number
            raised = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (OSError, ValueError) as err:
        log.warning("open_files_limit_unchanged", error=str(err))
        return
    log.info("open_files_limit", soft_before=soft, soft=raised, hard=hard)


def check_port_bindable(host: str, port: int) -> None:
    """Raise OSError naming the address if (host, port) cannot be bound; port 0 always can.

    Bound and released at once, the way the metrics server will bind it (SO_REUSEADDR): a port
    another process listens on fails here, before the agent registers, not after."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as err:
        reason = err.strerror or str(err)
        raise OSError(err.errno, f"cannot serve metrics on {host}:{port}: {reason}") from err


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """What asyncio would print as a raw traceback (a failing callback, accept() out of
    descriptors), as one structlog event."""
    error = context.get("exception")
    log.error(
        "event_loop_error",
        message=str(context.get("message", ""))[:300],
        error=repr(error)[:300] if error is not None else None,
    )


async def _completed(action: Callable[[], None]) -> None:
    action()


def _exit_stuck(after_s: float) -> None:
    """The last resort of a shutdown that hangs: a stopped agent must not need SIGKILL."""
    log.error("shutdown_deadline_exceeded", after_s=after_s, effect="exiting without cleanup")
    os._exit(0)


def _cancelling() -> bool:
    """Whether the running task has been asked to stop (its cancellation is still pending)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@contextlib.contextmanager
def _signals(stop: Callable[[], None]):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, _on_signal, sig, stop)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _on_signal(sig: signal.Signals, stop: Callable[[], None]) -> None:
    log.info("signal_received", signal=sig.name)
    stop()

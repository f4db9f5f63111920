"""An allocation region held in memory: what the controller sees of a simulated container.

It implements `RegionHandle`; the simulated shim (`gpu.ShimGate`) fills its usage the way the
real shim fills the `state` file, and the controller writes rates into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy, ProcessUsage, RegionUsage


@dataclass
class ProcessCounters:
    """The cumulative counters of one process slot, per region device."""

    pid: int
    host_pid: int
    launches: list[int]
    tokens_spent: list[int]
    wait_ns: list[int]
    last_launch_ns: list[int]


@dataclass
class SimRegion:
    alloc_id: str
    device_uuids: tuple[str, ...]
    core_limits: tuple[float, ...]
    policies: tuple[CorePolicy, ...]
    priority: int = 0
    seq: int = 0
    memory_limits: tuple[int, ...] = ()
    processes: list[ProcessCounters] = field(default_factory=list)
    rates: list[tuple[int, int]] = field(default_factory=list)
    heartbeat_ns: int = 0
    rate_writes: int = 0
    balances: list[int] = field(default_factory=list)  # the bucket, shared by the processes
    last_refill_ns: list[int] = field(default_factory=list)
    closed: bool = False  # a simulated region is never collected unless a test says so

    def __post_init__(self) -> None:
        n = len(self.device_uuids)
        if not n or len(self.core_limits) != n or len(self.policies) != n:
            raise ValueError(
                f"region {self.alloc_id!r}: need one core limit and policy per device, got "
                f"{len(self.core_limits)} limits, {len(self.policies)} policies for {n} devices"
            )
        for limit in self.core_limits:
            if not 0 < limit <= 100:
                raise ValueError(f"region {self.alloc_id!r}: core limit {limit!r} not in (0, 100]")
        for policy in self.policies:
            if policy not in CORE_POLICIES:
                raise ValueError(
                    f"region {self.alloc_id!r}: policy {policy!r} not in {CORE_POLICIES}"
                )
        if not self.rates:
            self.rates = [(0, 0)] * n  # never configured: the shim does not throttle
        if not self.memory_limits:
            self.memory_limits = (0,) * n
        if not self.balances:
            self.balances = [0] * n
        if not self.last_refill_ns:
            self.last_refill_ns = [0] * n

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(f"{uuid}::0" for uuid in self.device_uuids)

    def memory_limit(self, dev: int) -> int:
        return self.memory_limits[dev]

    def core_limit(self, dev: int) -> float:
        return self.core_limits[dev]

    def policy(self, dev: int) -> CorePolicy:
        return self.policies[dev]

    def rate(self, dev: int) -> tuple[int, int]:
        return self.rates[dev]

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        if rate < 0 or burst < 0:
            raise ValueError(f"rate and burst must be >= 0, got {rate!r}, {burst!r}")
        self.rates[dev] = (rate, burst)
        self.rate_writes += 1

    def set_policy(self, policy: CorePolicy, priority: int) -> bool:
        """What the agent does for a pod's annotations (`Region.set_policy`)."""
        if policy not in CORE_POLICIES:
            raise ValueError(f"region {self.alloc_id!r}: policy {policy!r} not in {CORE_POLICIES}")
        policies = (policy,) * len(self.device_uuids)
        if (policies, priority) == (self.policies, self.priority):
            return False
        self.policies, self.priority = policies, priority
        return True

    def beat(self, now_ns: int) -> None:
        self.heartbeat_ns = now_ns

    def add_process(self, pid: int, host_pid: int) -> ProcessCounters:
        n = len(self.device_uuids)
        slot = ProcessCounters(pid, host_pid, [0] * n, [0] * n, [0] * n, [0] * n)
        self.processes.append(slot)
        return slot

    def counters(self) -> tuple[int, ...]:
        """Per device (tokens spent, launches, ns waited), as the shim keeps them in `state`."""
        out: list[int] = []
        for d in range(len(self.device_uuids)):
            out += (sum(p.tokens_spent[d] for p in self.processes),
                    sum(p.launches[d] for p in self.processes),
                    sum(p.wait_ns[d] for p in self.processes))
        return tuple(out)

    def usage(self) -> RegionUsage:
        n = len(self.device_uuids)
        procs = tuple(
            ProcessUsage(
                pid=p.pid,
                host_pid=p.host_pid,
                memory_used=(0,) * n,
                launches=tuple(p.launches),
                tokens_spent=tuple(p.tokens_spent),
                wait_ns=tuple(p.wait_ns),
                last_launch_ns=tuple(p.last_launch_ns),
            )
            for p in self.processes
        )
        spent = tuple(sum(p.tokens_spent[d] for p in self.processes) for d in range(n))
        return RegionUsage(
            processes=procs,
            memory_used=(0,) * n,
            tokens_spent=spent,
            bucket_balance=tuple(self.balances),
        )

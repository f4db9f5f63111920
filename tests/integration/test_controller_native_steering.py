"""The common path of each device's steering in C (`throttle/_steerc.c`), as the agent runs it:
built where the tests run, the controller's default, and every device steered exactly as the
Python reference (`ThrottleController._observe` and `_settle`) steers it.

Twin controllers, one steering in C and one in Python, are given the same input and compared
after every tick, field by field (every device's remembered state, cap and watches, the law's
states, the counted errors, the rates written, the pace): on random ticks with hostile
readings (claims past the bucket, totals that drop or jump past 2**53, rates tampered with or
never set, policies and priorities that change, limits that cannot be read, clocks that step
back, uses far above the target) and on simulated runs with honest and lying containers.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import types
from dataclasses import replace

import pytest

from vgpu_agent.simulation.gpu import SimBackend, SimGpu, SimHostEvidence, Workload
from vgpu_agent.simulation.imperfections import REAL
from vgpu_agent.simulation.region import SimRegion
from vgpu_agent.throttle import controller as steering
from vgpu_agent.throttle.control import UNLIMITED_RATE
from vgpu_agent.throttle.controller import ThrottleController

UUID = "GPU-twins"
POLICIES = ("strict", "strict", "work-conserving", "off")


def test_the_extension_is_built_and_steers_by_default():
    # `pip install -e .` compiles it; without it the agent steers in Python at about twice the
    # cost of a tick's glue, which the benchmarks would quietly measure
    assert steering.NATIVE_STEERING, "vgpu_agent/throttle/_steerc.c was not built"
    controller = ThrottleController(backend=None, regions=list)  # type: ignore[arg-type]
    assert controller.native_steering


def test_a_layout_it_was_not_built_for_is_refused():
    # a field moved in Observation, Decision or LoopState would be read at the wrong place
    # (refused before anything is bound: the values given here would otherwise stay)
    with pytest.raises(ValueError, match="not those this module was built for"):
        steering._steerc.bind(UNLIMITED_RATE, 100.0, 9.0, 9.0, 9.0, 9.0, 12, 3,
                              ("rate", "key"))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*53\]"):
        steering._steerc.bind(2**60, 100.0, 9.0, 9.0, 9.0, 9.0, 12, 3, ())
    with pytest.raises(ValueError, match="from 1 to 1000000, got 0 and 3"):
        steering._steerc.bind(UNLIMITED_RATE, 100.0, 9.0, 9.0, 9.0, 9.0, 0, 3, ())
    # a full GPU is 100 % in here, whatever Python's FULL_SHARE said
    with pytest.raises(ValueError, match=r"FULL_SHARE must be 100\.0, .* got 99\.0"):
        steering._steerc.bind(UNLIMITED_RATE, 99.0, 9.0, 9.0, 9.0, 9.0, 12, 3, ())


def test_a_steering_built_for_other_records_is_not_used_and_says_why(monkeypatch):
    # a stale build would read a moved field at its old place: the agent steers in Python and
    # logs this reason, rather than failing to start
    from vgpu_agent.throttle.control import Observation

    monkeypatch.setattr(Observation, "_fields", (*Observation._fields, "moved"))
    reason = steering.bind_steering(steering._steerc)
    assert reason is not None
    assert reason.startswith(
        "vgpu_agent.throttle._steerc was built from another version of the steering: ")
    assert "not those this module was built for" in reason
    monkeypatch.undo()
    assert steering.bind_steering(steering._steerc) is None  # and binds again as it was
    # a build whose bind takes other arguments is refused the same way, not raised at import
    older = types.SimpleNamespace(bind=lambda unlimited, full: None)
    reason = steering.bind_steering(older)
    assert reason is not None and "argument" in reason


def test_the_module_refuses_to_steer_before_it_is_bound():
    # the controller binds it at import; imported alone it has no UNLIMITED_RATE to write
    code = ("from vgpu_agent.throttle import _steerc\n"
            "try:\n    _steerc.observe([], print, {}, [], [], {}, set())\n"
            "except RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "_steerc.bind() was not called"


def test_entries_that_are_not_pairs_are_refused_by_name():
    with pytest.raises(TypeError, match="entries must hold"):
        steering._steerc.observe([("device",)], print, {}, [], [], {}, set())


def state_of(obj: object) -> object:
    """An object of the controller's (device, cap, watch, debt) as the values of its slots."""
    if obj is None or isinstance(obj, (int, float, str, tuple, list)):
        return obj
    slots: tuple[str, ...] = type(obj).__slots__  # type: ignore[attr-defined]
    return {name: state_of(getattr(obj, name)) for name in slots if name != "region"}


def held(pair: list[ThrottleController]) -> list[tuple[int, int]]:
    """How many references hold each object the steering made and left on a device, in both
    twins, where the two differ.

    The sanitizers see a reference dropped once too often only where C code or libc touches
    the freed object afterwards (a key compared in a dict: caught); an int the interpreter
    alone touches later is not (1,067 ticks' spending dropped one short went unseen). Made the
    same way, the twins' objects are held as often: a count one short or one over differs.
    Compared: what the C steering makes (the totals kept, the bucket and its level, the last
    decision kept, the spending, launches and waits observed), not what it only passes on (a
    key or a rate is also held by frames and logs the two paths do not share)."""
    def objects(controller: ThrottleController) -> list[object]:
        found: list[object] = []
        for _, device in sorted(controller._devices.items()):
            obs = device.last[0] if device.last else (None,) * 7
            found += (device.previous, device.bucket, *(device.bucket or (None,))[:1],
                      device.last, *obs[4:7])
        return [obj for obj in found if not (obj is None or isinstance(obj, bool) or (
            type(obj) is int and -5 <= obj <= 256))]  # (shared by the whole interpreter)

    mine, theirs = objects(pair[0]), objects(pair[1])
    counts = [(sys.getrefcount(a), sys.getrefcount(b)) for a, b in zip(mine, theirs, strict=True)
              if a is not b]
    return [(a, b) for a, b in counts if a != b]


def snapshot(controller: ThrottleController) -> str:
    """Everything a tick leaves behind, as text (repr tells floats apart to the last bit)."""
    return repr((
        {key: state_of(device) for key, device in sorted(controller._devices.items())},
        controller._states, sorted(controller.errors.items()), controller._changed,
        controller._lent,
    ))


class FakeRegion:
    """What the steering asks of a region: its limits (once) and its rate writes."""

    def __init__(self, alloc_id: str, limits: list[float | None]):
        self.alloc_id = alloc_id
        self.device_uuids = (UUID,) * len(limits)
        self.limits = limits
        self.closed = False
        self.rates = [(0, 0)] * len(limits)
        self.writes: list[tuple[int, int, int]] = []
        self.refuse_writes = False

    def core_limit(self, dev: int) -> float:
        limit = self.limits[dev]
        if limit is None:
            raise OSError("control unreadable")
        return limit

    def set_rate(self, dev: int, rate: int, burst: int) -> None:
        self.writes.append((dev, rate, burst))
        if self.refuse_writes:
            raise OSError("control read-only")
        self.rates[dev] = (rate, burst)


def twins() -> list[ThrottleController]:
    """Two controllers, the first steering in C, the second in Python."""
    pair = []
    for native in (True, False):
        controller = ThrottleController(backend=None, regions=list,  # type: ignore[arg-type]
                                        clock=lambda: 0)
        controller.native_steering = native
        pair.append(controller)
    return pair


def counting(controller: ThrottleController) -> dict[str, int]:
    """How often the controller's Python steering is called, per method, from here on."""
    calls = {"_observe": 0, "_settle": 0}
    for name in calls:
        method = getattr(controller, name)

        def counted(*args, name=name, method=method):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return method(*args)
        setattr(controller, name, counted)
    return calls


def hostile_run(seed: int, ticks: int) -> tuple[int, dict[str, int]]:
    """Twin controllers steered through `ticks` random ticks of one GPU: the number of device
    ticks compared (an AssertionError names the first that differed) and how many of them the
    C twin handed to Python, before and after the law."""
    rng = random.Random(seed)
    pair = twins()
    handed = counting(pair[0])
    n_regions = rng.randint(1, 9)
    specs = [[rng.choice([None, 100.0, 30.0, rng.uniform(1, 99)]) if rng.random() < 0.2
              else rng.uniform(5, 60) for _ in range(rng.choice([1, 1, 2]))]
             for _ in range(n_regions)]
    regions = [[FakeRegion(f"r{i}", list(limits)) for i, limits in enumerate(specs)]
               for _ in pair]
    policies = [[rng.choice(POLICIES) for _ in limits] for limits in specs]
    priorities = [rng.randint(0, 2) for _ in specs]
    totals = [[[0, 0, 0] for _ in limits] for limits in specs]
    now = rng.choice([rng.randint(0, 10**12), 2**53 + rng.randint(0, 10**15)])  # long uptimes
    compared = 0
    for tick in range(ticks):
        dt_s = rng.choice([0.1, 0.1, 0.1, 0.4, rng.uniform(0.001, 2.5)])
        now += int(dt_s * 1e9)
        readings = []
        for r, limits in enumerate(specs):
            if rng.random() < 0.03:
                priorities[r] = rng.randint(0, 3)
            counters: list[int] = []
            for d in range(len(limits)):
                if rng.random() < 0.03:
                    policies[r][d] = rng.choice((*POLICIES, "bogus"))
                rate = regions[0][r].rates[d][0] or 10**6
                total = totals[r][d]
                pick = rng.random()
                if total[0] > 2**53 and pick < 0.5:
                    total[0] = 0  # the shim reclaimed a dead process's slot
                elif pick < 0.02:
                    total[0] = rng.choice([0, total[0] // 2, 2**53 + rng.randint(0, 9), 2**64 - 1])
                elif pick < 0.15:  # past what its bucket let through
                    total[0] += int(rate * dt_s * rng.choice([3, 100, 10**4]))
                else:
                    total[0] += int(rate * dt_s * rng.uniform(0, 1.2))
                total[1] += rng.choice([0, 1, 5, 50])
                total[2] += rng.choice([0, 0, int(dt_s * 1e9 * rng.random())])
                counters += total
            if rng.random() < 0.02:
                counters = counters[: rng.randint(0, len(counters) - 1)]  # a header cut short
            read_from = now - rng.choice([0, 0, 10**6, 10**8, 5 * 10**9])  # stamps may step back
            readings.append((counters, read_from, read_from + rng.choice([0, 1000, 10**7])))
        # the same uses for both: per allocation, with the seconds and samples they describe
        util_pick = rng.random()
        utils = {f"r{r}": rng.choice([None, 0.0, rng.uniform(0, 100), rng.uniform(40, 100),
                                      rng.randint(0, 100)])
                 for r in range(n_regions)} if util_pick < 0.6 else None
        span = (rng.choice([1 / 6, 1.0]), rng.randint(1, 6))
        tamper = [(r, d, rng.choice([(0, 0), (2**63, 7), (rng.randint(1, 10**9), 0)]))
                  for r, limits in enumerate(specs) for d in range(len(limits))
                  if rng.random() < 0.02]
        refuse = rng.random() < 0.03
        for controller, own in zip(pair, regions, strict=True):
            for r, d, rates in tamper:
                own[r].rates[d] = rates  # written behind the agent's back
            entries = []
            for region, (counters, read_from, read_until), pols, priority in zip(
                    own, readings, policies, priorities, strict=True):
                region.refuse_writes = refuse
                flat_rates = tuple(v for pair_ in region.rates for v in pair_)
                reading = (tuple(counters), flat_rates, tuple(pols), priority, read_from,
                           read_until)
                for device in controller._devices_of(region):  # type: ignore[arg-type]
                    entries.append((device, reading))
            controller._now_ns = now
            controller._utilization = (  # type: ignore[method-assign]
                lambda *_, u=utils: None if u is None else (u, *span))  # type: ignore[misc]
            controller._changed = controller._lent = False
            try:
                controller._steer_gpu(UUID, entries, None, max(dt_s, 1e-3))
            except Exception as error:  # compared below, as the tick's failure would be
                controller.errors[f"raised {type(error).__name__}"] += 1
            compared += len(entries) if controller is pair[0] else 0
            del entries, reading  # (held here, they would hold the readings once more)
        assert snapshot(pair[0]) == snapshot(pair[1]), (seed, tick)
        assert held(pair) == [], (seed, tick)
        assert [r.writes for r in regions[0]] == [r.writes for r in regions[1]], (seed, tick)
    return compared, handed


def test_hostile_random_ticks_are_steered_alike():
    compared, observed, settled = 0, 0, 0
    for seed in range(16):
        ticks, handed = hostile_run(seed, 150)
        compared, observed = compared + ticks, observed + handed["_observe"]
        settled += handed["_settle"]
    # both paths taken, on many device ticks
    assert compared > 5000
    assert 0.05 * compared < observed < 0.8 * compared
    assert 0.05 * compared < settled < 0.8 * compared


@pytest.mark.parametrize("clock_ns", [0, 2**53 + 10**12, 2**62])
def test_what_c_declines_is_left_to_python_before_anything_changed(clock_ns):
    # a first sight and a tick's spending past 2**53 are handed over whole, and so is the tick
    # after it (that spending, one launch, was forgiven as a launch's debt, repaid in Python);
    # totals past 2**53 whose differences are not, and a monotonic clock past it (104 days of
    # uptime), are not
    pair = twins()
    handed = counting(pair[0])
    regions = [FakeRegion("a", [40.0]) for _ in pair]
    for controller, region in zip(pair, regions, strict=True):
        controller._utilization = lambda *a: None  # type: ignore[method-assign]
        region.rates = [(10**6, 10**5)]
    for n, spent in enumerate([100, 200_000, 300_000, 2**53 + 300_001, 2**53 + 400_000]):
        now = clock_ns + n * 10**8
        for controller, region in zip(pair, regions, strict=True):
            (device,) = controller._devices_of(region)  # type: ignore[arg-type]
            reading = ((spent, n, 0), tuple(region.rates[0]), ("strict",), 0, now, now)
            controller._now_ns = now
            controller._steer_gpu(UUID, [(device, reading)], None, 0.1)
        assert snapshot(pair[0]) == snapshot(pair[1])
    assert handed == {"_observe": 3, "_settle": 0}
    assert pair[0]._devices["a/0"].launch_debt.left > 0


def lying_pair(twin_native: bool, liar_work: Workload, period_s: float
               ) -> tuple[SimGpu, SimRegion, ThrottleController]:
    gpu = SimGpu(UUID, sample_period_s=period_s, imperfections=REAL)
    honest = SimRegion("honest", (UUID,), (60.0,), ("strict",))
    liar = SimRegion("liar", (UUID,), (40.0,), ("strict",))
    gpu.shim_process("honest", Workload(kernel_s=0.0002), honest)
    gpu.shim_process("liar", liar_work, liar)
    controller = ThrottleController(SimBackend([gpu]), lambda: [honest, liar],
                                    clock=lambda: gpu.now_ns, evidence=SimHostEvidence([gpu]))
    controller.native_steering = twin_native
    return gpu, liar, controller


@pytest.mark.slow
@pytest.mark.parametrize("game", ["honest", "claims x100", "exact allowance"])
async def test_simulated_runs_with_liars_are_steered_alike(game):
    # the x100 liar is caught and capped; the exact-allowance one (20 ms a second for 15 s,
    # then without pause, claiming what its bucket lets through) sets off the overuse watch
    work = Workload(kernel_s=0.0002, busy=(
        *((float(t), t + 0.02) for t in range(15)), (15.0, math.inf)))
    runs = [lying_pair(native, work, 0.2) for native in (True, False)]
    claimed = [0, 0]
    for tick in range(300):
        for n, (gpu, liar, controller) in enumerate(runs):
            gpu.advance(0.1)
            slot = liar.processes[0]
            spent = slot.tokens_spent[0]
            rate = liar.rates[0][0]
            if game == "claims x100":
                slot.tokens_spent[0] = spent * 100
            elif game == "exact allowance" and tick >= 2 and rate:
                claimed[n] += rate // 10
                slot.tokens_spent[0] = max(spent, claimed[n])
            await controller.tick()
            slot.tokens_spent[0] = spent
        assert snapshot(runs[0][2]) == snapshot(runs[1][2]), tick
        assert held([runs[0][2], runs[1][2]]) == [], tick
        assert runs[0][1].rates == runs[1][1].rates
        assert runs[0][2].interval_s == runs[1][2].interval_s
    errors = runs[0][2].error_counts
    wanted = {"honest": None, "claims x100": "tokens_overclaimed",
              "exact allowance": "use_over_target"}[game]
    assert (wanted in errors) if wanted else errors == {}


@pytest.mark.slow
@pytest.mark.parametrize("attribution", ["per-process", "time-sliced"])
async def test_simulated_noisy_runs_of_many_containers_are_steered_alike(attribution):
    from vgpu_agent.simulation.runner import ContainerSpec, ControlledRun, PlantSpec

    rng = random.Random(5)
    containers = tuple(
        ContainerSpec(f"c{i}", rng.choice([10.0, 15.0, 25.0]),
                      Workload(kernel_s=rng.choice([0.0002, 0.002]),
                               busy=((rng.uniform(0, 5), rng.uniform(8, 30)),)),
                      policy=rng.choice(POLICIES[:3]), priority=rng.randint(0, 1))
        for i in range(8))
    plant = PlantSpec(imperfections=replace(REAL, nvml_attribution=attribution))
    runs = [ControlledRun(containers, plant=plant, paced=True) for _ in range(2)]
    runs[1].controller.native_steering = False
    for second in range(30):
        for run in runs:
            await run.advance(1.0)
        assert snapshot(runs[0].controller) == snapshot(runs[1].controller), second
        assert held([runs[0].controller, runs[1].controller]) == [], second
        assert [r.rates for r in runs[0].regions.values()] == \
            [r.rates for r in runs[1].regions.values()]


async def test_a_worker_thread_that_lingers_holds_nothing_the_twins_compare(monkeypatch):
    # A pool's worker drops its call's arguments a while after the result is back (when the
    # OS schedules it again, later on a loaded machine): the twins' counts of references were
    # then one apart now and then. Every tick hops here, and every other worker lingers.
    import concurrent.futures.thread as pool_thread
    import itertools
    import time

    run = pool_thread._WorkItem.run
    calls = itertools.count()

    def lingering(self, *args):  # type: ignore[no-untyped-def]
        run(self, *args)
        if next(calls) % 2:
            time.sleep(0.02)  # the work item, and what it was called with, held meanwhile

    monkeypatch.setattr(pool_thread._WorkItem, "run", lingering)
    runs = [lying_pair(native, Workload(kernel_s=0.0002), 0.2) for native in (True, False)]
    for _, _, controller in runs:
        controller.inline_read_s = 0.0  # NVML read in a worker thread at every tick
    for tick in range(20):
        for gpu, _, controller in runs:
            gpu.advance(0.1)
            await controller.tick()
        assert held([runs[0][2], runs[1][2]]) == [], tick
    assert runs[0][2].hops == runs[1][2].hops == 20

"""Each GPU keeps its own tick: a GPU whose containers keep changing is steered every `tick_s`
while a calm one beside it slows down to its own pace, unread and unasked in between; a new
container, one gone and an idle one waking bring their own GPU's tick, not the node's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.clock import ManualClock
from tests.fakes.shimstate import DeviceSpec, make_region, put_totals
from vgpu_agent.gpu.model import ProcessSample
from vgpu_agent.shm.regions import Region, format_alloc_id
from vgpu_agent.throttle.control import Decision, LoopState
from vgpu_agent.throttle.controller import ThrottleController, on_grid

CALM, BUSY = (f"GPU-eeeeeeee-0000-0000-0000-00000000000{n}" for n in range(2))


def file_region(root: Path, seq: int, uuid: str, percent: float = 30.0) -> Region:
    ids = [f"{uuid}::{seq}"]
    alloc_id = format_alloc_id(seq, ids, 1)
    make_region(root, alloc_id, [DeviceSpec(uuid, 1 << 30, percent, "strict")], ids, seq=seq)
    return Region.open(root / alloc_id)


class Asked:
    """NVML with nothing to say, counting the calls per GPU."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def process_utilization(self, uuid: str, since_us: int) -> list[ProcessSample]:
        self.calls[uuid] = self.calls.get(uuid, 0) + 1
        return []


class Law:
    """Every container at its 30 % limit and the same rate, but those in `moving`, whose target
    jumps by 2 points at every call (a change each tick); counts the containers it saw."""

    def __init__(self) -> None:
        self.moving: set[str] = set()
        self.fixed: dict[str, tuple[float, bool]] = {}  # key -> (target, hungry)
        self.seen: dict[str, int] = {}
        self.calls = 0

    def __call__(self, observations, states, dt_s, params):  # type: ignore[no-untyped-def]
        self.calls += 1
        out = {}
        for o in observations:
            self.seen[o.key] = self.seen.get(o.key, 0) + 1
            moves = o.key in self.moving
            target, hungry = self.fixed.get(o.key, (30.0, False))
            if moves:
                target = 28.0 + 2.0 * (self.seen[o.key] % 2)
            out[o.key] = Decision(1_000_000, 20_000, target, hungry, 10.0, LoopState())
        return out


class Node:
    """A controller over file regions on two GPUs, ticked as `run` ticks it (paced, at the
    interval it asks for, never closer than `tick_s`) on a clock the test moves."""

    def __init__(self, regions: list[Region], **kwargs: object) -> None:
        self.regions, self.law, self.clock, self.nvml = regions, Law(), ManualClock(), Asked()
        self.controller = ThrottleController(
            self.nvml, lambda: [r for r in self.regions if not r.closed], clock=self.clock,
            law=self.law, proc_root="/nonexistent", **kwargs)  # type: ignore[arg-type]
        self.controller.inline_read_s = 10.0
        self.elapsed_s = 0.0

    async def run(self, seconds: float) -> list[float]:
        """Tick for `seconds`; the intervals between ticks."""
        intervals = []
        end = self.elapsed_s + seconds
        while self.elapsed_s < end - 1e-9:
            await self.controller.tick(paced=True)
            step = max(self.controller.interval_s, self.controller.tick_s)
            intervals.append(step)
            self.clock.ns += round(step * 1e9)
            self.elapsed_s += step
        return intervals

    def key(self, region: Region) -> str:
        return f"{region.alloc_id}/0"


@pytest.fixture
def two_gpus(tmp_path):
    calm, busy = file_region(tmp_path, 1, CALM), file_region(tmp_path, 2, BUSY)
    node = Node([calm, busy])
    node.law.moving.add(node.key(busy))
    yield node, calm, busy
    for region in node.regions:
        region.close()


async def test_a_calm_gpu_slows_down_beside_one_that_keeps_changing(two_gpus):
    node, calm, busy = two_gpus
    intervals = await node.run(30.0)
    # the node ticks at the changing GPU's pace ...
    assert max(intervals) == pytest.approx(0.1)
    ticks = len(intervals)
    assert node.law.seen[node.key(busy)] == ticks
    # ... while the calm GPU grew to the unlent tick: steered once in 2 s at the end, and
    # NVML asked for it as seldom
    seen = node.law.seen[node.key(calm)]
    assert seen < ticks / 5
    before = dict(node.law.seen), dict(node.nvml.calls)
    await node.run(10.0)
    assert node.law.seen[node.key(calm)] - before[0][node.key(calm)] == pytest.approx(5, abs=1)
    assert node.nvml.calls[CALM] - before[1][CALM] <= 6
    assert node.nvml.calls[BUSY] - before[1][BUSY] >= 50
    # the calm container still holds its rate, and its heartbeat is kept
    assert calm.rate(0) == (1_000_000, 20_000)
    assert calm.heartbeat_ns >= node.clock.ns - 2_100_000_000


@pytest.mark.parametrize("calm_from_s", [7.33, 12.05, 15.0])
async def test_gpus_that_settled_at_different_moments_share_their_ticks(two_gpus, calm_from_s):
    """Each GPU settled at the unlent tick is due on that interval's grid: the node ticks once
    in 2 s for both, not once for each, whenever each calmed down."""
    node, calm, busy = two_gpus
    await node.run(calm_from_s)
    node.law.moving.clear()  # the changing GPU calms down too, out of step with the other
    await node.run(40.0)
    paces = node.controller._paces
    assert paces[CALM].interval_s == paces[BUSY].interval_s == pytest.approx(2.0)
    assert paces[CALM].due_ns == paces[BUSY].due_ns
    assert paces[CALM].due_ns % 2_000_000_000 == 0
    seen = dict(node.law.seen)
    intervals = await node.run(10.0)
    assert intervals == pytest.approx([2.0] * 5)
    for region in (calm, busy):  # both steered at each of those ticks
        assert node.law.seen[node.key(region)] - seen[node.key(region)] == 5


def test_the_grid_brings_a_gpu_due_within_its_interval_and_a_share_window():
    """Off the grid, the next tick is the grid's next instant beyond the share window; on it,
    or up to the window late or early, one interval on."""
    second, window = 2_000_000_000, 50_000_000
    assert on_grid(10 * second, second, window) == 11 * second
    assert on_grid(10 * second + window - 1, second, window) == 11 * second  # late
    assert on_grid(10 * second - window, second, window) == 11 * second  # early, shared
    assert on_grid(10 * second - window - 1, second, window) == 10 * second
    for now in range(0, 3 * second, 7_777_777):
        due = on_grid(now, second, window)
        assert due % second == 0 and window < due - now <= second + window


async def test_without_pacing_every_gpu_is_steered_every_tick(two_gpus):
    node, calm, busy = two_gpus
    for _ in range(100):
        await node.controller.tick()
        node.clock.ns += 100_000_000
    assert node.law.seen[node.key(calm)] == node.law.seen[node.key(busy)] == 100


async def test_a_container_added_to_a_calm_gpu_brings_its_tick_back(tmp_path, two_gpus):
    node, calm, _ = two_gpus
    await node.run(30.0)
    pace = node.controller._paces[CALM]
    assert pace.interval_s == pytest.approx(2.0)
    newcomer = file_region(tmp_path, 3, CALM)
    node.regions.append(newcomer)
    before = node.law.seen[node.key(calm)]
    await node.run(0.1)  # the next tick, a changing GPU's tick after
    assert node.law.seen[node.key(newcomer)] == 1  # first sight
    assert node.law.seen[node.key(calm)] == before + 1  # steered with it, on the same GPU
    assert node.controller._paces[CALM].interval_s == pytest.approx(0.1)


async def test_a_container_gone_from_a_calm_gpu_brings_its_tick_back(tmp_path, two_gpus):
    node, calm, _ = two_gpus
    other = file_region(tmp_path, 3, CALM)
    node.regions.append(other)
    await node.run(30.0)
    assert node.controller._paces[CALM].interval_s == pytest.approx(2.0)
    before = node.law.seen[node.key(calm)]
    other.close()  # collected while its GPU was between ticks
    await node.run(0.1)
    assert node.controller._paces[CALM].interval_s == pytest.approx(0.1)
    await node.run(0.15)
    assert node.law.seen[node.key(calm)] >= before + 1  # steered again at the fast tick
    assert f"{other.alloc_id}/0" not in node.controller._devices


async def test_an_unreadable_region_on_a_due_gpu_keeps_that_gpu_unsure(two_gpus):
    """A region that cannot be read is dropped (a new baseline when it reads again), and the
    GPU it was read for keeps its tick at `max_tick_s`; the calm GPU is untouched."""
    node, _, busy = two_gpus
    await node.run(30.0)
    busy.counters = lambda: None  # type: ignore[method-assign,assignment,return-value]
    await node.run(5.0)
    assert node.controller._paces[BUSY].interval_s <= node.controller.max_tick_s
    assert node.controller._paces[CALM].interval_s == pytest.approx(2.0)
    assert node.controller.errors["region_corrupt"] >= 1


async def test_an_idle_container_on_a_calm_gpu_is_watched_while_another_gpu_ticks_fast(
        tmp_path, two_gpus):
    """A calm GPU lends an idle container's share to a borrower: it slows down to its own 2 s
    tick, and the idle container is looked at every `max_tick_s` meanwhile, though the node's
    tick is the changing GPU's 0.1 s; when it spends, its GPU is steered within `max_tick_s`."""
    node, calm, _ = two_gpus
    sleeper = file_region(tmp_path, 3, CALM)
    node.regions.append(sleeper)
    node.law.fixed[node.key(calm)] = (40.0, True)  # borrowing the sleeper's share
    node.law.fixed[node.key(sleeper)] = (20.0, False)
    # (just past the calm GPU's tick on its 2 s grid, at 30 s: the wake below comes 0.8 s
    # before its next one, so that only the watch between ticks serves it in time)
    await node.run(30.2)
    controller = node.controller
    assert controller._paces[CALM].interval_s == pytest.approx(2.0)
    assert [w[0].key for w in controller._watched] == [node.key(sleeper)]
    before = node.law.seen[node.key(sleeper)]
    await node.run(1.0)
    assert node.law.seen[node.key(sleeper)] - before <= 1  # asleep, only watched
    put_totals(sleeper.path, 0, 5_000_000, 50, 0)  # it wakes: launches and spends
    woke_at = node.elapsed_s
    seen = node.law.seen[node.key(sleeper)]
    while node.law.seen[node.key(sleeper)] == seen:
        await node.run(0.1)
    assert node.elapsed_s - woke_at <= controller.max_tick_s + 0.1 + 1e-9

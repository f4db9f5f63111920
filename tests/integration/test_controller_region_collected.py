"""A region collected (closed) while a controller tick reads it is skipped, without a traceback.

The collector runs on the event loop while the tick's worker thread reads `state` and NVML; the
backend here closes one region in the middle of that read, exactly where the collector can.
"""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from tests.integration.test_controller_region_files import UUID, Setup
from vgpu_agent.shm import layout
from vgpu_agent.shm.regions import CONTROL_FILE, STATE_FILE, Region, format_alloc_id
from vgpu_agent.simulation.gpu import SimBackend
from vgpu_agent.throttle.controller import ThrottleController


def second_region(root: Path) -> Region:
    alloc_id = format_alloc_id(2, (f"{UUID}::1",), 43)
    path = root / alloc_id
    path.mkdir()
    control = layout.Control(
        devices=(layout.ControlDevice(uuid=UUID, core_limit=300_000, policy=1),),
        device_ids=(f"{UUID}::1",),
        seq=2,
        created_ns=43,
    )
    (path / CONTROL_FILE).write_bytes(layout.encode_control(control))
    (path / STATE_FILE).write_bytes(layout.encode_state(1))
    return Region.open(path)


class ClosesMidRead(SimBackend):
    """NVML as the worker thread sees it; the first call closes `victim` as the collector would."""

    def __init__(self, gpus, victim: Region):  # type: ignore[no-untyped-def]
        super().__init__(gpus)
        self.victim = victim

    def process_utilization(self, uuid, since_us):  # type: ignore[no-untyped-def]
        self.victim.close()
        return super().process_utilization(uuid, since_us)


async def test_a_region_closed_during_the_read_is_skipped_quietly(tmp_path):
    setup = Setup(tmp_path)
    doomed = second_region(tmp_path)
    controller = ThrottleController(
        ClosesMidRead([setup.gpu], doomed),
        lambda: [r for r in (setup.region, doomed)],
        clock=lambda: setup.gpu.now_ns,
    )
    setup.controller = controller
    with capture_logs() as logs:
        await setup.run(1.0)
    assert doomed.closed
    assert dict(controller.errors) == {}
    assert not [e for e in logs if e.get("log_level") in ("error", "warning")]
    assert not [e for e in logs if "exc_info" in e]
    # the region that is still there kept being steered and beating
    assert setup.region.rate(0) != (0, 0)
    assert 0 <= setup.gpu.now_ns - setup.region.heartbeat_ns < controller.heartbeat_ns

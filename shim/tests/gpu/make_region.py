"""Write a one-device region (control + state) the way the agent does, for the GPU check.

    python3 make_region.py DIR UUID MEMORY_LIMIT CORE_LIMIT_PPM RATE BURST POLICY [FLAGS]

FLAGS: the control device's flag bits (1 = spill to managed memory), 0 when left out.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vgpu_agent.shm import layout


def write_region(path: Path, uuid: str, memory: int, core_ppm: int, rate: int, burst: int,
                 policy: int, flags: int = 0, seq: int = 1, device_id: str | None = None) -> None:
    """`control` and a fresh `state` for one device at `path`, as Allocate writes them."""
    path.mkdir(parents=True, exist_ok=True)
    device = layout.ControlDevice(uuid, memory, core_ppm, rate, burst, policy, flags)
    now = time.monotonic_ns()
    control = layout.Control(devices=(device,), device_ids=(device_id or f"{uuid}::0",), seq=seq,
                             created_ns=now, heartbeat_ns=now)
    (path / "control").write_bytes(layout.encode_control(control))
    (path / "state").write_bytes(layout.encode_state(1))


def main() -> None:
    directory, uuid, memory, core, rate, burst, policy = sys.argv[1:8]
    flags = int(sys.argv[8]) if len(sys.argv) > 8 else 0
    write_region(Path(directory), uuid, int(memory), int(core), int(rate), int(burst),
                 int(policy), flags)


if __name__ == "__main__":
    main()

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


def main() -> None:
    directory, uuid, memory, core, rate, burst, policy = sys.argv[1:8]
    flags = int(sys.argv[8]) if len(sys.argv) > 8 else 0
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    device = layout.ControlDevice(uuid, int(memory), int(core), int(rate), int(burst),
                                  int(policy), flags)
    now = time.monotonic_ns()
    control = layout.Control(devices=(device,), device_ids=(f"{uuid}::0",), seq=1,
                             created_ns=now, heartbeat_ns=now)
    (path / "control").write_bytes(layout.encode_control(control))
    (path / "state").write_bytes(layout.encode_state(1))


if __name__ == "__main__":
    main()

"""The shim's token-spending rule, as the simulator applies it at every launch.

The rule itself lives in `vgpu_agent.shm.layout` (the Python twin of `shim/src/bucket.h`); this
module only re-exports the parts the simulator needs, so the simulated containers are throttled
exactly the way real ones are.
"""

from __future__ import annotations

from vgpu_agent.shm.layout import (
    MAX_SLEEP_NS,
    MAX_WAIT_NS,
    NS_PER_S,
    admits,
    refill,
    spend,
    wait_ns_for,
)

__all__ = ["MAX_SLEEP_NS", "MAX_WAIT_NS", "NS_PER_S", "admits", "refill", "spend", "wait_ns_for"]

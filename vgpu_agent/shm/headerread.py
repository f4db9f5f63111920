"""The controller's lean read of a `state` header: one pread and `layout.state_counters`.

In C where `_statec.c` was built (`pip install .` through setup.py; optional): the same
refusals as the Python decoder, without a buffer, a list and a struct call per region (the
controller reads every region's header every tick). The tests hold the two to the same answers
on any bytes. Without the extension, or with one built for a layout it cannot hold, the Python
read runs; `NATIVE_READ` says which and `NOT_NATIVE_READ_REASON` why not.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from vgpu_agent import native
from vgpu_agent.shm import layout


def bind(module: Any) -> str | None:
    """Give the C read this layout's numbers: None where it holds them, else why it cannot (it
    was built for smaller headers; the layout in force, if any, is kept)."""
    try:
        module.bind(
            layout.STATE_MAGIC, layout.ABI_MAJOR,
            tuple(layout.STATE_OFFSETS[name] for name in
                  ("magic", "abi_major", "header_size", "device_count", "total_size")),
            layout.STATE_HEADER_SIZE, layout.STATE_OFFSETS["devices"], layout.STATE_DEVICE_SIZE,
            layout.STATE_DEVICE_OFFSETS["tokens_spent"], layout.PLAUSIBLE_COUNTER,
            layout.MAX_DEVICES,
        )
    except (TypeError, ValueError) as error:  # TypeError: a bind of another signature
        return f"vgpu_agent.shm._statec was built for another state layout: {error}"
    return None


# not built, or a stale build that cannot read this layout's headers: the Python read, and
# the controller says why
_statec, NOT_NATIVE_READ_REASON = native.load("vgpu_agent.shm._statec", bind)

NATIVE_READ = _statec is not None
_buffers = threading.local()


def python_counters_at(fd: int, device_count: int) -> tuple[int, ...] | None:
    """The header at offset 0 of `fd`, decoded; None when it cannot be read whole or is not
    a header for `device_count` devices (`layout.state_counters`)."""
    buffer: bytearray | None = getattr(_buffers, "header", None)
    if buffer is None:
        buffer = _buffers.header = bytearray(layout.STATE_HEADER_SIZE)
    try:
        size = os.preadv(fd, [buffer], 0)
    except OSError:
        return None
    return layout.state_counters(buffer, device_count) if size == len(buffer) else None


counters_at = python_counters_at if _statec is None else _statec.counters_at
# many regions' headers and rates in force in one call, each header between two monotonic
# stamps (`regions.readings_together`); None without the C read, or with a build from before
# it had one (each region then read in a call of its own: slower, and said once, below)
readings_many = None if _statec is None else getattr(_statec, "readings_many", None)
# ... and `Region.readings_together`'s loop over the regions (their locks, fields and checks)
# in the same call; None without it (the loop then runs in Python, the reference)
readings_of = None if readings_many is None else getattr(_statec, "readings_of", None)
NOT_BATCH_READ_REASON: str | None = None
if _statec is None:
    NOT_BATCH_READ_REASON = NOT_NATIVE_READ_REASON
elif readings_many is None:
    NOT_BATCH_READ_REASON = (
        "vgpu_agent.shm._statec was built before it had readings_many (rebuild it)")

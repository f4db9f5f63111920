"""A region's whole `state` read for the metrics' round: `Region._read_usage` in one call.

In C where `_usagec.c` was built (`pip install .` through setup.py; optional): the reads and
`layout.decode_state`, check for check and count for count, without the Python decoder's
struct calls and lists (the round reads every region before each scrape, and the decoder was
most of it). The tests hold the two decoders to the same answers on any bytes. Without the
extension, or with one built for a layout it cannot hold, `Region` reads in Python;
`NATIVE_USAGE` says which and `NOT_NATIVE_USAGE_REASON` why not.
"""

from __future__ import annotations

from typing import Any

from vgpu_agent import native
from vgpu_agent.shm import layout
from vgpu_agent.shm.api import ProcessUsage, RegionUsage


def bind(module: Any) -> str | None:
    """Give the C decoder this layout's numbers: None where it holds them, else why it cannot."""
    offsets = layout.STATE_OFFSETS
    if offsets["slots"] != layout.STATE_HEADER_SIZE:
        return ("vgpu_agent.shm._usagec was built for another state layout: it reads the "
                "slots right after the header")
    try:
        module.bind(
            layout.STATE_MAGIC, layout.ABI_MAJOR,
            tuple(offsets[name] for name in (
                "magic", "abi_major", "abi_minor", "header_size", "device_count", "total_size",
                "slot_count", "slot_high_water")),
            (layout.STATE_HEADER_SIZE, offsets["devices"], layout.STATE_DEVICE_SIZE,
             layout.SLOT_SIZE, layout.SLOT_OFFSETS["devices"], layout.PROC_DEVICE_SIZE,
             offsets["ext"], layout.STATE_EXT_DEVICE_SIZE),
            tuple(layout.STATE_DEVICE_OFFSETS[name] for name in (
                "balance", "memory_used", "tokens_spent", "launches", "wait_ns")),
            tuple(layout.SLOT_OFFSETS[name] for name in ("pid", "host_pid", "start_time")),
            tuple(layout.PROC_DEVICE_OFFSETS[name] for name in (
                "memory_used", "launches", "tokens_spent", "wait_ns", "last_launch_ns")),
            tuple(layout.STATE_EXT_DEVICE_OFFSETS[name] for name in (
                "memory_context", "memory_module", "memory_pool", "memory_spilled",
                "graphs_unpriced")),
            (layout.MAX_DEVICES, layout.MAX_PROCS, layout.STATE_SIZE_1_0, layout.STATE_SIZE,
             layout.PID_MAX, layout.PLAUSIBLE_BYTES, layout.PLAUSIBLE_COUNTER, layout.TOKEN_MAX),
        )
    except (TypeError, ValueError) as error:  # TypeError: a bind of another signature
        return f"vgpu_agent.shm._usagec was built for another state layout: {error}"
    return None


def usage_of(decoded: tuple | None) -> RegionUsage:  # type: ignore[type-arg]
    """The `RegionUsage` of the C decoder's plain values (None: a corrupt header)."""
    if decoded is None:
        return RegionUsage(corrupt=True)
    (processes, memory, tokens, skipped, balances, launches, waited, context, module, pool,
     spilled, unpriced, extension) = decoded
    return RegionUsage(
        processes=tuple(ProcessUsage(*process) for process in processes),
        memory_used=memory,
        tokens_spent=tokens,
        skipped_records=skipped,
        corrupt=False,
        bucket_balance=balances,
        launches=launches,
        wait_ns=waited,
        memory_context=context,
        memory_module=module,
        memory_pool=pool,
        memory_spilled=spilled,
        graphs_unpriced=unpriced,
        extension=extension,
    )


_usagec, NOT_NATIVE_USAGE_REASON = native.load("vgpu_agent.shm._usagec", bind)

NATIVE_USAGE = _usagec is not None
# usage_at(fd, device_count, slot_budget): the plain values of `Region._read_usage`'s result
usage_at = None if _usagec is None else _usagec.usage_at

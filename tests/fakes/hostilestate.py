"""`state` files as a hostile or broken container may leave them, for the decoders' agreement.

`scribbled_state` starts from a fresh `state` of either ABI minor, fills process slots, device
totals and the 1.1 extension mostly with plausible values, sometimes with the values every
bound of `layout.decode_state` is there for (a pid past PID_MAX, a slot being reclaimed, a
counter past PLAUSIBLE_COUNTER, a mark past the slots), scribbles a few random bytes over the
header and the first slots, and may cut the file short. Only the stdlib and `layout`: the
sanitizer tests' child processes import it too.
"""

from __future__ import annotations

import random
import struct

from vgpu_agent.shm import layout

PIDS = (0, 5, 77, 4_000_000, layout.PID_MAX - 1, layout.PID_MAX, layout.PID_RECLAIMING | 9,
        layout.PID_RECLAIMING, layout.PID_RECLAIMING | layout.PID_MAX, 1 << 40)
ODD_WORDS = (layout.PLAUSIBLE_BYTES, layout.PLAUSIBLE_BYTES + 1, layout.PLAUSIBLE_COUNTER,
             layout.PLAUSIBLE_COUNTER + 1, layout.TOKEN_MAX + 1, 1 << 63, (1 << 64) - 1)


def _word(rng: random.Random, odd: float) -> int:
    return rng.choice(ODD_WORDS) if rng.random() < odd else rng.randrange(1 << 40)


def scribbled_state(rng: random.Random, max_devices: int = 4, max_slots: int = 6,
                    count: int | None = None) -> bytes:
    """One `state` file's bytes (see the module), of `count` devices where given."""
    count = rng.randint(1, max_devices) if count is None else count
    minor = rng.choice((0, layout.ABI_MINOR))
    buf = bytearray(layout.encode_state(count, minor))
    slots = rng.randint(0, max_slots)
    mark = slots if rng.random() < 0.9 else rng.choice((slots + 1, 2_000, (1 << 64) - 1))
    struct.pack_into("<Q", buf, layout.STATE_OFFSETS["slot_high_water"], mark)
    for index in range(slots):
        base = layout.STATE_OFFSETS["slots"] + index * layout.SLOT_SIZE
        host_pid = rng.choice((0, 3, 123_456, layout.PID_MAX))
        struct.pack_into("<QQQ", buf, base, rng.choice(PIDS), host_pid, rng.randrange(1 << 40))
        for dev in range(count):
            at = base + layout.SLOT_OFFSETS["devices"] + dev * layout.PROC_DEVICE_SIZE
            for word in range(layout.PROC_DEVICE_SIZE // 8):
                struct.pack_into("<Q", buf, at + 8 * word, _word(rng, 0.03))
    for dev in range(count):
        at = layout.STATE_OFFSETS["devices"] + dev * layout.STATE_DEVICE_SIZE
        for word in range(6):
            struct.pack_into("<Q", buf, at + 8 * word, _word(rng, 0.08))
        if minor:
            at = layout.STATE_OFFSETS["ext"] + dev * layout.STATE_EXT_DEVICE_SIZE
            for word in range(5):
                struct.pack_into("<Q", buf, at + 8 * word, _word(rng, 0.08))
    for _ in range(rng.randint(0, 3)):
        buf[rng.randrange(layout.STATE_HEADER_SIZE + (max_slots + 1) * layout.SLOT_SIZE)] = \
            rng.randrange(256)
    if rng.random() < 0.6:
        return bytes(buf)
    cut = rng.choice((layout.STATE_HEADER_SIZE + 3 * layout.SLOT_SIZE,
                      layout.STATE_HEADER_SIZE + 7, layout.STATE_HEADER_SIZE,
                      layout.STATE_HEADER_SIZE - 1, 100, 0))
    return bytes(buf[:cut])


def extension_of(data: bytes) -> bytes:
    """The extension's words as a reader fetching them apart gets them (short where the file
    is)."""
    start = layout.STATE_OFFSETS["ext"]
    return data[start:start + layout.STATE_EXT_SIZE]

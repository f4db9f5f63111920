"""The region ABI in Python: constants, offsets, encoders, defensive decoders, the bucket rule.

A mirror of `shim/include/vgpu_shm.h` (the single source of truth; read its comment for the
meaning of every field). `tests/unit/test_shm_layout_abi.py` compiles a program printing every
`offsetof`/`sizeof` of the header and compares it with the tables here.

Pure: functions work on `bytes` or on writable buffers (`bytearray`, `mmap`, `memoryview`) handed
in by the caller; nothing here opens a file.

Writes to shared memory never read-modify-write: `store_u64` is one naturally aligned 64-bit store
(a `memoryview` cast to "Q" assigns through an 8-byte `memcpy`, which compiles to a single store on
x86-64 and arm64), and updates of several fields are framed by the generation counter (odd while
storing, even when stable).

The token-spending rule (`refill`, `admits`, `spend`, `wait_ns_for`, `launch_cost`) is the same
rule the shim applies in C (`shim/src/bucket.h`); `tests/unit/test_shm_layout_rule.py` runs both on
the same inputs. A GPU simulator uses these functions to model exactly what the shim does.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from vgpu_agent.shm.api import ProcessUsage, RegionUsage

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the region ABI is little-endian; this host is " + sys.byteorder)

CONTROL_MAGIC: Final = 0x314C52544E435056  # "VPCNTRL1"
STATE_MAGIC: Final = 0x3145544154535056  # "VPSTATE1"
ABI_MAJOR: Final = 1
ABI_MINOR: Final = 1

MAX_DEVICES: Final = 16
MAX_DEVICE_IDS: Final = 64
DEVICE_ID_LEN: Final = 64
UUID_LEN: Final = 96
MAX_PROCS: Final = 1024

POLICY_OFF: Final = 0
POLICY_STRICT: Final = 1
POLICY_WORK_CONSERVING: Final = 2
POLICIES: Final = (POLICY_OFF, POLICY_STRICT, POLICY_WORK_CONSERVING)
POLICY_NAMES: Final = {
    POLICY_OFF: "off",
    POLICY_STRICT: "strict",
    POLICY_WORK_CONSERVING: "work-conserving",
}

# control_device.flags (1.1): readers ignore bits they do not know.
CONTROL_FLAG_SPILL: Final = 1 << 0  # allocations the card cannot hold spill to managed memory
# control.flags (ABI 1.1): what the container may change about its own enforcement; all clear
# is the secure default and what a 1.0 control holds (shims read it as 0 when abi_minor < 1).
CONTROL_ALLOW_DISABLE: Final = 1 << 0  # VGPU_DISABLE=1 is honoured
CONTROL_ALLOW_REGION_DIR: Final = 1 << 1  # a VGPU_REGION_DIR other than the mounted one is honoured
CONTROL_FLAGS_KNOWN: Final = CONTROL_ALLOW_DISABLE | CONTROL_ALLOW_REGION_DIR

CORE_LIMIT_FULL: Final = 1_000_000  # core_limit unit: parts per million of SM time
DEFAULT_GRAPH_COST: Final = 1 << 20
MAX_SLEEP_NS: Final = 10_000_000
MAX_WAIT_NS: Final = 2_000_000_000
PID_RECLAIMING: Final = 1 << 63
KIND_UNIT: Final = 4096  # memory of the kinds context, module and pool is counted in these units

NS_PER_S: Final = 1_000_000_000
TOKEN_MAX: Final = 1 << 62  # rates, bursts and costs are clamped here (C and Python alike)
U64_MAX: Final = (1 << 64) - 1
I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1

# Bounds used when reading `state` (written by code we do not trust).
PLAUSIBLE_BYTES: Final = 1 << 50  # 1 PiB: no GPU comes near
PLAUSIBLE_COUNTER: Final = 1 << 62
PID_MAX: Final = 1 << 22  # the kernel's PID_MAX_LIMIT


class RegionFormatError(ValueError):
    """A region file or a value for it is not what the ABI allows."""


def _layout(fields: Sequence[tuple[str, str, int]]) -> tuple[dict[str, int], int]:
    """Offsets of (name, struct code, count) fields aligned naturally, as a C compiler does."""
    offsets: dict[str, int] = {}
    offset = 0
    biggest = 1
    for name, code, count in fields:
        size = struct.calcsize("<" + code)
        align = size if code != "s" else 1
        offset = (offset + align - 1) // align * align
        offsets[name] = offset
        offset += size * count
        biggest = max(biggest, align)
    total = (offset + biggest - 1) // biggest * biggest
    return offsets, total


CONTROL_DEVICE_FIELDS: Final = (
    ("uuid", "s", UUID_LEN),
    ("memory_limit", "Q", 1),
    ("core_limit", "Q", 1),
    ("rate", "Q", 1),
    ("burst", "Q", 1),
    ("policy", "Q", 1),
    ("flags", "Q", 1),
    ("graph_cost", "Q", 1),
    ("reserved", "Q", 5),
)
CONTROL_DEVICE_OFFSETS, CONTROL_DEVICE_SIZE = _layout(CONTROL_DEVICE_FIELDS)

CONTROL_HEADER_FIELDS: Final = (
    ("magic", "Q", 1),
    ("abi_major", "I", 1),
    ("abi_minor", "I", 1),
    ("header_size", "I", 1),
    ("device_count", "I", 1),
    ("total_size", "Q", 1),
    ("generation", "Q", 1),
    ("heartbeat_ns", "Q", 1),
    ("created_ns", "Q", 1),
    ("seq", "Q", 1),
    ("priority", "q", 1),
    ("device_id_count", "I", 1),
    ("reserved0", "I", 1),
    ("flags", "Q", 1),
    ("reserved", "Q", 5),
)
CONTROL_OFFSETS, CONTROL_HEADER_SIZE = _layout(CONTROL_HEADER_FIELDS)
CONTROL_OFFSETS["device_ids"] = CONTROL_HEADER_SIZE
CONTROL_OFFSETS["devices"] = CONTROL_HEADER_SIZE + MAX_DEVICE_IDS * DEVICE_ID_LEN
CONTROL_SIZE: Final = CONTROL_OFFSETS["devices"] + MAX_DEVICES * CONTROL_DEVICE_SIZE

STATE_DEVICE_FIELDS: Final = (
    ("balance", "q", 1),
    ("last_refill_ns", "Q", 1),
    ("memory_used", "Q", 1),
    ("tokens_spent", "Q", 1),
    ("launches", "Q", 1),
    ("wait_ns", "Q", 1),
    ("reserved", "Q", 2),
)
STATE_DEVICE_OFFSETS, STATE_DEVICE_SIZE = _layout(STATE_DEVICE_FIELDS)

PROC_DEVICE_FIELDS: Final = (
    ("memory_used", "Q", 1),
    ("launches", "Q", 1),
    ("tokens_spent", "Q", 1),
    ("wait_ns", "Q", 1),
    ("last_launch_ns", "Q", 1),
)
PROC_DEVICE_OFFSETS, PROC_DEVICE_SIZE = _layout(PROC_DEVICE_FIELDS)

SLOT_HEADER_FIELDS: Final = (
    ("pid", "Q", 1),
    ("host_pid", "Q", 1),
    ("start_time", "Q", 1),
    ("reserved", "Q", 1),
)
SLOT_OFFSETS, _SLOT_HEADER_SIZE = _layout(SLOT_HEADER_FIELDS)
SLOT_OFFSETS["devices"] = _SLOT_HEADER_SIZE
SLOT_SIZE: Final = _SLOT_HEADER_SIZE + MAX_DEVICES * PROC_DEVICE_SIZE

STATE_HEADER_FIELDS: Final = (
    ("magic", "Q", 1),
    ("abi_major", "I", 1),
    ("abi_minor", "I", 1),
    ("header_size", "I", 1),
    ("device_count", "I", 1),
    ("total_size", "Q", 1),
    ("slot_count", "I", 1),
    ("reserved0", "I", 1),
    ("slot_high_water", "Q", 1),
    ("reserved", "Q", 2),
)
STATE_OFFSETS, _STATE_PREFIX_SIZE = _layout(STATE_HEADER_FIELDS)
STATE_OFFSETS["devices"] = _STATE_PREFIX_SIZE
STATE_OFFSETS["slots"] = _STATE_PREFIX_SIZE + MAX_DEVICES * STATE_DEVICE_SIZE
STATE_HEADER_SIZE: Final = STATE_OFFSETS["slots"]

# 1.1 appends per-device words and per-slot memory by kind after the slots (see the header).
STATE_EXT_DEVICE_FIELDS: Final = (
    ("memory_context", "Q", 1),
    ("memory_module", "Q", 1),
    ("memory_pool", "Q", 1),
    ("memory_spilled", "Q", 1),
    ("graphs_unpriced", "Q", 1),
    ("ticket_next", "Q", 1),
    ("ticket_serving", "Q", 1),
    ("reserved", "Q", 9),
)
STATE_EXT_DEVICE_OFFSETS, STATE_EXT_DEVICE_SIZE = _layout(STATE_EXT_DEVICE_FIELDS)

PROC_KINDS_FIELDS: Final = (
    ("context", "I", 1),
    ("module", "I", 1),
    ("pool", "I", 1),
    ("spilled", "I", 1),
)
PROC_KINDS_OFFSETS, PROC_KINDS_SIZE = _layout(PROC_KINDS_FIELDS)

STATE_SIZE_1_0: Final = STATE_HEADER_SIZE + MAX_PROCS * SLOT_SIZE  # a `state` of minor 0
STATE_OFFSETS["ext"] = STATE_SIZE_1_0
STATE_OFFSETS["slot_kinds"] = STATE_SIZE_1_0 + MAX_DEVICES * STATE_EXT_DEVICE_SIZE
STATE_EXT_SIZE: Final = MAX_DEVICES * STATE_EXT_DEVICE_SIZE  # the per-device words only
STATE_SIZE: Final = STATE_OFFSETS["slot_kinds"] + MAX_PROCS * MAX_DEVICES * PROC_KINDS_SIZE

_PREFIX = struct.Struct("<QIIIIQ")  # magic, major, minor, header_size, device_count, total_size


# ------------------------------------------------------------------ control


@dataclass(frozen=True)
class ControlDevice:
    """One device entry of `control`; core_limit in parts per million (CORE_LIMIT_FULL = 100%)."""

    uuid: str
    memory_limit: int = 0  # bytes, 0 = no limit
    core_limit: int = CORE_LIMIT_FULL
    rate: int = 0  # tokens per second
    burst: int = 0  # tokens
    policy: int = POLICY_OFF
    flags: int = 0
    graph_cost: int = 0  # 0 = DEFAULT_GRAPH_COST


@dataclass(frozen=True)
class Control:
    """The decoded contents of a `control` file."""

    devices: tuple[ControlDevice, ...]
    device_ids: tuple[str, ...] = ()
    priority: int = 0
    seq: int = 0
    created_ns: int = 0
    heartbeat_ns: int = 0
    generation: int = 0
    abi_minor: int = ABI_MINOR
    flags: int = 0  # CONTROL_ALLOW_* (1.1)


def control_device_offset(dev: int, field: str) -> int:
    """Byte offset of `field` of device entry `dev` in `control`."""
    if not 0 <= dev < MAX_DEVICES:
        raise RegionFormatError(f"device index {dev} out of range: allowed 0..{MAX_DEVICES - 1}")
    if field not in CONTROL_DEVICE_OFFSETS:
        raise RegionFormatError(
            f"unknown control device field {field!r}: allowed {sorted(CONTROL_DEVICE_OFFSETS)}"
        )
    return CONTROL_OFFSETS["devices"] + dev * CONTROL_DEVICE_SIZE + CONTROL_DEVICE_OFFSETS[field]


def _check_u64(name: str, value: int, upper: int = U64_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise RegionFormatError(f"{name}={value!r} is not allowed: an integer in 0..{upper}")
    return value


def _encode_text(name: str, text: str, size: int) -> bytes:
    data = text.encode("ascii", errors="strict") if text.isascii() else b""
    if not data and text:
        raise RegionFormatError(f"{name}={text!r} is not allowed: ASCII text only")
    if len(data) >= size or b"\0" in data:
        raise RegionFormatError(
            f"{name}={text!r} is not allowed: at most {size - 1} characters, no NUL"
        )
    return data


def _validate_device(i: int, d: ControlDevice) -> None:
    if not d.uuid:
        raise RegionFormatError(f"devices[{i}].uuid is empty: a GPU UUID is required")
    _encode_text(f"devices[{i}].uuid", d.uuid, UUID_LEN)
    _check_u64(f"devices[{i}].memory_limit", d.memory_limit)
    _check_u64(f"devices[{i}].core_limit", d.core_limit, CORE_LIMIT_FULL)
    _check_u64(f"devices[{i}].rate", d.rate, TOKEN_MAX)
    _check_u64(f"devices[{i}].burst", d.burst, TOKEN_MAX)
    _check_u64(f"devices[{i}].graph_cost", d.graph_cost, TOKEN_MAX)
    _check_u64(f"devices[{i}].flags", d.flags)
    if d.policy not in POLICIES:
        raise RegionFormatError(
            f"devices[{i}].policy={d.policy!r} is not allowed: one of {POLICIES}"
        )


def encode_control(control: Control) -> bytes:
    """The full bytes of a `control` file (CONTROL_SIZE long) for `control`."""
    if not 1 <= len(control.devices) <= MAX_DEVICES:
        raise RegionFormatError(f"{len(control.devices)} devices: allowed 1..{MAX_DEVICES}")
    if len(control.device_ids) > MAX_DEVICE_IDS:
        raise RegionFormatError(
            f"{len(control.device_ids)} device IDs: allowed 0..{MAX_DEVICE_IDS}"
        )
    if not isinstance(control.priority, int) or not I64_MIN <= control.priority <= I64_MAX:
        raise RegionFormatError(
            f"priority={control.priority!r} is not allowed: a signed 64-bit integer"
        )
    for name in ("seq", "created_ns", "heartbeat_ns", "generation", "flags"):
        _check_u64(name, getattr(control, name))
    if control.flags & ~CONTROL_FLAGS_KNOWN:
        raise RegionFormatError(
            f"flags={control.flags:#x} is not allowed: only bits of {CONTROL_FLAGS_KNOWN:#x}"
        )
    if control.generation % 2:
        raise RegionFormatError(
            f"generation={control.generation} is odd: a stored file is stable (even)"
        )
    buf = bytearray(CONTROL_SIZE)
    _PREFIX.pack_into(
        buf,
        0,
        CONTROL_MAGIC,
        ABI_MAJOR,
        control.abi_minor,
        CONTROL_HEADER_SIZE,
        len(control.devices),
        CONTROL_SIZE,
    )
    o = CONTROL_OFFSETS
    struct.pack_into(
        "<QQQQq",
        buf,
        o["generation"],
        control.generation,
        control.heartbeat_ns,
        control.created_ns,
        control.seq,
        control.priority,
    )
    struct.pack_into("<I", buf, o["device_id_count"], len(control.device_ids))
    struct.pack_into("<Q", buf, o["flags"], control.flags)
    for i, device_id in enumerate(control.device_ids):
        data = _encode_text(f"device_ids[{i}]", device_id, DEVICE_ID_LEN)
        start = o["device_ids"] + i * DEVICE_ID_LEN
        buf[start : start + len(data)] = data
    for i, d in enumerate(control.devices):
        _validate_device(i, d)
        base = o["devices"] + i * CONTROL_DEVICE_SIZE
        struct.pack_into(
            f"<{UUID_LEN}s7Q",
            buf,
            base,
            d.uuid.encode("ascii"),
            d.memory_limit,
            d.core_limit,
            d.rate,
            d.burst,
            d.policy,
            d.flags,
            d.graph_cost,
        )
    return bytes(buf)


def _check_prefix(
    buf: bytes | bytearray | memoryview, magic: int, what: str, size: int, header_size: int
) -> tuple[int, int]:
    """Validate magic/major/sizes; return (abi_minor, device_count)."""
    if len(buf) < size:
        raise RegionFormatError(f"{what} file is {len(buf)} bytes: at least {size} expected")
    got_magic, major, minor, hsize, count, total = _PREFIX.unpack_from(buf, 0)
    if got_magic != magic:
        raise RegionFormatError(f"{what} magic {got_magic:#x}: expected {magic:#x}")
    if major != ABI_MAJOR:
        raise RegionFormatError(f"{what} ABI major {major}: this reader understands {ABI_MAJOR}")
    if hsize != header_size or total != size:
        raise RegionFormatError(
            f"{what} header/total size {hsize}/{total}: expected {header_size}/{size}"
        )
    if count > MAX_DEVICES:
        raise RegionFormatError(f"{what} device count {count}: allowed 0..{MAX_DEVICES}")
    return minor, count


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", errors="replace")


def decode_control(buf: bytes | bytearray | memoryview) -> Control:
    """Decode a `control` file; RegionFormatError names what is wrong with it."""
    minor, count = _check_prefix(buf, CONTROL_MAGIC, "control", CONTROL_SIZE, CONTROL_HEADER_SIZE)
    o = CONTROL_OFFSETS
    generation, heartbeat, created, seq, priority = struct.unpack_from(
        "<QQQQq", buf, o["generation"]
    )
    (id_count,) = struct.unpack_from("<I", buf, o["device_id_count"])
    if id_count > MAX_DEVICE_IDS:
        raise RegionFormatError(f"control device ID count {id_count}: allowed 0..{MAX_DEVICE_IDS}")
    ids = tuple(
        _text(
            bytes(
                buf[o["device_ids"] + i * DEVICE_ID_LEN : o["device_ids"] + (i + 1) * DEVICE_ID_LEN]
            )
        )
        for i in range(id_count)
    )
    devices = []
    for i in range(count):
        base = o["devices"] + i * CONTROL_DEVICE_SIZE
        raw_uuid, mem, core, rate, burst, policy, flags, graph = struct.unpack_from(
            f"<{UUID_LEN}s7Q", buf, base
        )
        devices.append(ControlDevice(_text(raw_uuid), mem, core, rate, burst, policy, flags, graph))
    # a 1.0 file's word was reserved: whatever it holds means nothing (all clear)
    (flags,) = struct.unpack_from("<Q", buf, o["flags"]) if minor >= 1 else (0,)
    return Control(
        tuple(devices), ids, priority, seq, created, heartbeat, generation, minor, flags
    )


def store_u64(buf: bytearray | memoryview, offset: int, value: int) -> None:
    """One aligned 64-bit store of `value` at `offset` of a writable buffer (e.g. an mmap)."""
    if offset % 8:
        raise RegionFormatError(f"offset {offset} is not 8-byte aligned")
    _check_u64(f"value at offset {offset}", value)
    view = memoryview(buf).cast("B")
    view[offset : offset + 8].cast("Q")[0] = value


def load_u64(buf: bytes | bytearray | memoryview, offset: int) -> int:
    """One aligned 64-bit load at `offset`."""
    if offset % 8:
        raise RegionFormatError(f"offset {offset} is not 8-byte aligned")
    return int(memoryview(buf).cast("B")[offset : offset + 8].cast("Q")[0])


def update_control(buf: bytearray | memoryview, stores: Mapping[int, int]) -> int:
    """Store {offset: value} framed by the generation (odd while storing); return the new one.

    A generation left odd by a writer that died mid-update is closed by this update.
    """
    gen_offset = CONTROL_OFFSETS["generation"]
    generation = load_u64(buf, gen_offset)
    opening = generation if generation % 2 else generation + 1
    store_u64(buf, gen_offset, opening & U64_MAX)
    for offset, value in stores.items():
        store_u64(buf, offset, value)
    closing = (opening + 1) & U64_MAX
    store_u64(buf, gen_offset, closing)
    return closing


def set_rate(buf: bytearray | memoryview, dev: int, rate: int, burst: int) -> int:
    """Store a device's refill rate and burst (tokens/s, tokens); return the new generation."""
    _check_u64("rate", rate, TOKEN_MAX)
    _check_u64("burst", burst, TOKEN_MAX)
    return update_control(
        buf, {control_device_offset(dev, "rate"): rate, control_device_offset(dev, "burst"): burst}
    )


def set_policy(
    buf: bytearray | memoryview, policies: Sequence[int], priority: int
) -> int:
    """Store every device's policy (POLICY_*) and the header priority in one generation-framed
    update; return the new generation. `policies[d]` is device d's."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not (
        I64_MIN <= priority <= I64_MAX
    ):
        raise RegionFormatError(f"priority={priority!r} is not allowed: a signed 64-bit integer")
    stores = {CONTROL_OFFSETS["priority"]: priority & U64_MAX}  # two's complement, as int64_t
    for dev, policy in enumerate(policies):
        if policy not in POLICIES:
            raise RegionFormatError(
                f"devices[{dev}].policy={policy!r} is not allowed: one of {POLICIES}"
            )
        stores[control_device_offset(dev, "policy")] = policy
    return update_control(buf, stores)


def set_heartbeat(buf: bytearray | memoryview, now_ns: int) -> None:
    """Refresh the agent heartbeat (one store; not framed by the generation)."""
    store_u64(buf, CONTROL_OFFSETS["heartbeat_ns"], now_ns)


# ------------------------------------------------------------------ state


def encode_state(device_count: int, abi_minor: int = ABI_MINOR) -> bytes:
    """The bytes of a fresh `state` file: header filled in, everything else zero.

    `abi_minor=0` gives the smaller file an agent of ABI 1.0 created (for compatibility tests).
    """
    if not 1 <= device_count <= MAX_DEVICES:
        raise RegionFormatError(f"device_count={device_count}: allowed 1..{MAX_DEVICES}")
    if abi_minor not in (0, ABI_MINOR):
        raise RegionFormatError(f"abi_minor={abi_minor}: allowed 0 or {ABI_MINOR}")
    size = STATE_SIZE if abi_minor else STATE_SIZE_1_0
    buf = bytearray(size)
    _PREFIX.pack_into(
        buf, 0, STATE_MAGIC, ABI_MAJOR, abi_minor, STATE_HEADER_SIZE, device_count, size
    )
    struct.pack_into("<I", buf, STATE_OFFSETS["slot_count"], MAX_PROCS)
    return bytes(buf)


_STATE_DEVICE = struct.Struct("<qQQQQQ")
_SLOTS_AND_MARK = struct.Struct("<I4xQ")  # slot_count, reserved0, slot_high_water
_PROC_DEVICE_WORDS = PROC_DEVICE_SIZE // 8
_SLOT_WORDS = SLOT_SIZE // 8
# a slot's pid, host_pid, start_time, reserved and the counters of its first n devices
_SLOT_FORMATS = tuple(
    struct.Struct(f"<4Q{n * _PROC_DEVICE_WORDS}Q") for n in range(MAX_DEVICES + 1)
)


_EXT_WORDS = struct.Struct("<5Q")  # memory_context, _module, _pool, _spilled, graphs_unpriced


def state_size_is_known(minor: int, total: int) -> bool:
    """Whether a `state` header's (abi_minor, total_size) is one this reader accepts."""
    return total == STATE_SIZE_1_0 if minor == 0 else total >= STATE_SIZE


def state_has_extension(header: bytes | bytearray | memoryview) -> bool:
    """Whether a `state` header says the file carries the 1.1 extension (then read it)."""
    if len(header) < _PREFIX.size:
        return False
    _, _, minor, _, _, total = _PREFIX.unpack_from(header, 0)
    return bool(minor >= 1 and total >= STATE_SIZE)


def _plausible_u64(value: int, bound: int) -> bool:
    return 0 <= value <= bound


def state_slots_to_read(header: bytes | bytearray | memoryview) -> int:
    """How many slots a reader of this `state` header needs: its high-water mark, clamped.

    For a reader that fetches the header first and then only the slots that were ever used
    (`decode_state(..., slots_read=n)` then decodes them). Never raises: a header too short to
    hold the mark gives 0, and `decode_state` reports such a file as corrupt.
    """
    if len(header) < STATE_OFFSETS["slot_high_water"] + 8:
        return 0
    slot_count, mark = _SLOTS_AND_MARK.unpack_from(header, STATE_OFFSETS["slot_count"])
    return int(min(mark, slot_count, MAX_PROCS))


def _used_slot_indexes(buf: bytes | bytearray | memoryview, slots: int) -> list[int]:
    """Indexes of the first `slots` slots whose pid is not 0, from one strided view of the pids.

    Walking every slot in Python costs about a microsecond each; a region that once ran hundreds
    of processes and runs a few now would pay that at every read.
    """
    if slots == 0:
        return []
    base = STATE_OFFSETS["slots"]
    with (
        memoryview(buf) as whole,
        whole.cast("B") as raw,
        raw[base : base + slots * SLOT_SIZE] as region,
        region.cast("Q") as words,
        words[::_SLOT_WORDS] as pid_words,
    ):
        pids = pid_words.tolist()
    return [index for index, pid in enumerate(pids) if pid]


def decode_state(
    buf: bytes | bytearray | memoryview,
    device_count: int | None = None,
    slots_read: int | None = None,
    extension: bytes | bytearray | memoryview | None = None,
) -> RegionUsage:
    """Read a `state` file written by code we do not trust; never raises, never invents values.

    An unreadable header gives `RegionUsage(corrupt=True)`. Within a readable file every value is
    bounds-checked: a slot with a nonsense pid or counter is skipped whole, a nonsense device total
    is replaced by the sum of the valid slots, and each is counted in `skipped_records`.
    `device_count`, when given (from `control`), must match the file's.

    Only slots below the file's `slot_high_water` are read: no slot above it was ever claimed. A
    mark above `slot_count` (or MAX_PROCS) is clamped there and counted. `slots_read`, when given,
    says that `buf` holds the header and only the first `slots_read` slots (a reader that fetched
    the slots below the mark it saw a moment earlier): slots past those are not read, and not
    counted either, however far the mark has moved since. Without it `buf` is the whole file.

    The 1.1 extension (memory by kind, unpriced graphs) is read from `extension` when given (the
    STATE_EXT_SIZE bytes at STATE_OFFSETS["ext"], for a reader that fetched them apart), else from
    a whole `buf`. A file of minor 0 has none: those values read as zero.
    """
    if slots_read is not None and not 0 <= slots_read <= MAX_PROCS:
        raise ValueError(f"slots_read={slots_read!r} is not allowed: 0..{MAX_PROCS}")
    if len(buf) < STATE_HEADER_SIZE:
        return RegionUsage(corrupt=True)
    magic, major, minor, header_size, count, total = _PREFIX.unpack_from(buf, 0)
    if magic != STATE_MAGIC or major != ABI_MAJOR or header_size != STATE_HEADER_SIZE:
        return RegionUsage(corrupt=True)
    if count > MAX_DEVICES:
        return RegionUsage(corrupt=True)
    if device_count is not None and count != device_count:
        return RegionUsage(corrupt=True)
    skipped = 0
    slot_count, mark = _SLOTS_AND_MARK.unpack_from(buf, STATE_OFFSETS["slot_count"])
    if mark > min(slot_count, MAX_PROCS):
        skipped += 1  # a mark past the last slot is damage: read the slots there are
        mark = min(slot_count, MAX_PROCS)
    held = (len(buf) - STATE_HEADER_SIZE) // SLOT_SIZE
    if slots_read is None:
        if slot_count > min(MAX_PROCS, held) or not state_size_is_known(minor, total):
            skipped += 1  # slots claimed beyond the file (or beyond the ABI) are not read
        wanted = mark
    else:
        wanted = min(mark, slots_read)
        if slot_count > MAX_PROCS or not state_size_is_known(minor, total) or held < wanted:
            skipped += 1  # the file is shorter than its own header says
    to_read = min(wanted, held)

    processes: list[ProcessUsage] = []
    slot_mem = [0] * count
    slot_tokens = [0] * count
    slot_format = _SLOT_FORMATS[count]
    base = STATE_OFFSETS["slots"]
    for index in _used_slot_indexes(buf, to_read):
        values = slot_format.unpack_from(buf, base + index * SLOT_SIZE)
        pid, host_pid = values[0], values[1]
        if pid & PID_RECLAIMING:
            # being reclaimed right now by the process named in the low bits: not in use
            if not 0 < pid & ~PID_RECLAIMING < PID_MAX:
                skipped += 1
            continue
        counters = values[4:]
        memories = counters[0::_PROC_DEVICE_WORDS]
        if (
            not 0 < pid < PID_MAX
            or not 0 <= host_pid < PID_MAX
            or (memories and max(memories) > PLAUSIBLE_BYTES)
            or (counters and max(counters) > PLAUSIBLE_COUNTER)
        ):
            skipped += 1
            continue
        slot_spent = counters[2::_PROC_DEVICE_WORDS]
        processes.append(
            ProcessUsage(
                pid=pid,
                host_pid=host_pid,
                memory_used=memories,
                launches=counters[1::_PROC_DEVICE_WORDS],
                tokens_spent=slot_spent,
                wait_ns=counters[3::_PROC_DEVICE_WORDS],
                last_launch_ns=counters[4::_PROC_DEVICE_WORDS],
                start_time=values[2],
            )
        )
        for d in range(count):
            slot_mem[d] += memories[d]
            slot_tokens[d] += slot_spent[d]

    memory: list[int] = []
    tokens: list[int] = []
    balances: list[int] = []
    launch_totals: list[int] = []
    wait_totals: list[int] = []
    for d in range(count):
        balance, _, mem, spent, launches, waited = _STATE_DEVICE.unpack_from(
            buf, STATE_OFFSETS["devices"] + d * STATE_DEVICE_SIZE
        )
        if not _plausible_u64(mem, PLAUSIBLE_BYTES):
            skipped += 1
            mem = slot_mem[d]
        if not _plausible_u64(spent, PLAUSIBLE_COUNTER):
            skipped += 1
            spent = slot_tokens[d]
        if not -TOKEN_MAX <= balance <= TOKEN_MAX:
            skipped += 1
            balance = 0
        # Totals the law relies on, so that it never needs the slots a container may fill:
        # nonsense is read as nothing (counted), which only starves the liar's own view.
        if not _plausible_u64(launches, PLAUSIBLE_COUNTER):
            skipped += 1
            launches = 0
        if not _plausible_u64(waited, PLAUSIBLE_COUNTER):
            skipped += 1
            waited = 0
        memory.append(mem)
        tokens.append(spent)
        balances.append(balance)
        launch_totals.append(launches)
        wait_totals.append(waited)
    kinds, unpriced, bad = _decode_extension(buf, minor, total, count, slots_read, extension)
    return RegionUsage(
        processes=tuple(processes),
        memory_used=tuple(memory),
        tokens_spent=tuple(tokens),
        skipped_records=skipped + bad,
        corrupt=False,
        bucket_balance=tuple(balances),
        launches=tuple(launch_totals),
        wait_ns=tuple(wait_totals),
        memory_context=kinds[0],
        memory_module=kinds[1],
        memory_pool=kinds[2],
        memory_spilled=kinds[3],
        graphs_unpriced=unpriced,
        extension=minor >= 1 and total >= STATE_SIZE,
    )


def _decode_extension(
    buf: bytes | bytearray | memoryview,
    minor: int,
    total: int,
    count: int,
    slots_read: int | None,
    extension: bytes | bytearray | memoryview | None,
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], int]:
    """((context, module, pool, spilled) per device, graphs_unpriced per device, skipped)."""
    zeros = (0,) * count
    if minor < 1 or total < STATE_SIZE:
        return (zeros, zeros, zeros, zeros), zeros, 0
    if extension is not None:
        source, base = extension, 0
    elif slots_read is None:
        source, base = buf, STATE_OFFSETS["ext"]
    else:
        return (zeros, zeros, zeros, zeros), zeros, 0  # the caller did not fetch it
    if len(source) < base + count * STATE_EXT_DEVICE_SIZE:
        return (zeros, zeros, zeros, zeros), zeros, 1  # shorter than the header says
    context: list[int] = []
    module: list[int] = []
    pool: list[int] = []
    spilled: list[int] = []
    unpriced: list[int] = []
    skipped = 0
    for d in range(count):
        ctx, mod, pl, spl, graphs = _EXT_WORDS.unpack_from(
            source, base + d * STATE_EXT_DEVICE_SIZE
        )
        values = []
        for value in (ctx, mod, pl, spl):
            if not _plausible_u64(value, PLAUSIBLE_BYTES):
                skipped += 1
                value = 0
            values.append(value)
        if not _plausible_u64(graphs, PLAUSIBLE_COUNTER):
            skipped += 1
            graphs = 0
        context.append(values[0])
        module.append(values[1])
        pool.append(values[2])
        spilled.append(values[3])
        unpriced.append(graphs)
    kinds = (tuple(context), tuple(module), tuple(pool), tuple(spilled))
    return kinds, tuple(unpriced), skipped


def _counter_formats() -> tuple[struct.Struct, ...]:
    """Per device count, the struct that unpacks (spent, launches, waited) of every device and
    skips the rest: the three are consecutive words of a device's record."""
    first = STATE_DEVICE_OFFSETS["tokens_spent"]
    assert (STATE_DEVICE_OFFSETS["launches"], STATE_DEVICE_OFFSETS["wait_ns"]) == \
        (first + 8, first + 16)
    device = f"{first}x3Q{STATE_DEVICE_SIZE - first - 24}x"
    return tuple(struct.Struct("<" + device * n) for n in range(MAX_DEVICES + 1))


_COUNTER_FORMATS = _counter_formats()


def state_counters(
    header: bytes | bytearray | memoryview, device_count: int
) -> tuple[int, ...] | None:
    """What the throttle controller needs of `state` each tick, from the header alone.

    Per device (the shim keeps these totals in the header, summed over its processes):
    cumulative tokens spent, launches and ns waited for tokens, flattened as
    (spent0, launches0, waited0, spent1, ...). No slot is looked at. None when the header is
    not a `state` header of this major version for `device_count` devices, or holds a count
    no shim could have reached. A header larger than this agent knows (a later minor version
    adding fields) is accepted: the device totals stay where major 1 put them.
    """
    if len(header) < STATE_HEADER_SIZE or not 1 <= device_count <= MAX_DEVICES:
        return None
    magic, major, _, header_size, count, total = _PREFIX.unpack_from(header, 0)
    if (magic != STATE_MAGIC or major != ABI_MAJOR or count != device_count
            or header_size < STATE_HEADER_SIZE or total < header_size):
        return None
    counters: tuple[int, ...] = _COUNTER_FORMATS[count].unpack_from(
        header, STATE_OFFSETS["devices"])
    return None if max(counters) > PLAUSIBLE_COUNTER else counters


# ------------------------------------------------------------------ the token-spending rule


def launch_cost(grid: Sequence[int], block: Sequence[int]) -> int:
    """Tokens a kernel launch costs: blocks x threads per block, clamped to TOKEN_MAX."""
    cost = 1
    for dim in (*grid, *block):
        cost *= max(0, dim)
    return min(cost, TOKEN_MAX)


def is_unlimited(policy: int, core_limit: int, rate: int, burst: int) -> bool:
    """True when the shim spends no tokens for the device (see the header)."""
    return policy == POLICY_OFF or core_limit >= CORE_LIMIT_FULL or (rate == 0 and burst == 0)


def refill(balance: int, last_ns: int, now_ns: int, rate: int, burst: int) -> tuple[int, int]:
    """Lazy refill of a bucket at `now_ns`: the new (balance, last_refill_ns)."""
    rate = min(max(rate, 0), TOKEN_MAX)
    burst = min(max(burst, 0), TOKEN_MAX)
    if rate == 0:
        # paused: the time is not credited later, and a lowered burst still caps the balance
        return min(balance, burst), max(last_ns, now_ns)
    if now_ns <= last_ns:
        return min(balance, burst), last_ns
    add = (now_ns - last_ns) * rate // NS_PER_S
    if balance + add >= burst:
        return burst, now_ns
    return balance + add, last_ns + add * NS_PER_S // rate


def admits(balance: int, cost: int, burst: int) -> bool:
    """Whether a launch of `cost` may run now: the balance covers min(cost, burst)."""
    return balance >= min(cost, min(max(burst, 0), TOKEN_MAX))


def spend(balance: int, cost: int) -> int:
    """The balance after an admitted launch (a debt when the cost exceeded the burst).

    Floored at -TOKEN_MAX: only launches admitted after MAX_WAIT_NS can push a debt that far.
    """
    return max(balance - min(cost, TOKEN_MAX), -TOKEN_MAX)


def wait_ns_for(balance: int, cost: int, rate: int, burst: int | None = None) -> int:
    """How long a launch waits on a bucket nobody else spends from, capped at MAX_WAIT_NS.

    Without `burst` the launch needs its whole cost; with it, min(cost, burst) as the shim does.
    """
    need = min(cost, TOKEN_MAX) if burst is None else min(cost, min(max(burst, 0), TOKEN_MAX))
    if balance >= need:
        return 0
    rate = min(max(rate, 0), TOKEN_MAX)
    if rate == 0:
        return MAX_WAIT_NS
    return min(-(-(need - balance) * NS_PER_S // rate), MAX_WAIT_NS)

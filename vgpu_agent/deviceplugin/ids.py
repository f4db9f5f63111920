"""Device IDs advertised to the kubelet: `<GPU-UUID>::<n>` for slice n of a physical GPU.

The only place that formats or parses them. The `::` form is the NVIDIA plugin's replica form,
which dcgm-exporter maps back to the physical GPU.
"""

from __future__ import annotations

import re
from typing import NamedTuple

SEPARATOR = "::"
MAX_ID_LENGTH = 63  # the kubelet rejects longer device IDs
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_SLICE = re.compile(r"0|[1-9][0-9]{0,5}")


class SliceId(NamedTuple):
    uuid: str
    number: int

    def __str__(self) -> str:
        return format_device_id(self.uuid, self.number)


SHOWN_LENGTH = 80  # how much of a bad ID an error repeats: IDs come from outside, any size


def shown(device_id: str) -> str:
    """`device_id` as errors and logs show it: quoted, escaped and cut to a readable length."""
    if len(device_id) <= SHOWN_LENGTH:
        return repr(device_id)
    return f"{device_id[:SHOWN_LENGTH]!r}... ({len(device_id)} characters)"


class DeviceIdError(ValueError):
    """A device ID that is not `<GPU-UUID>::<n>`."""

    def __init__(self, device_id: str, reason: str):
        super().__init__(
            f"device ID {shown(device_id)} {reason}; expected <GPU-UUID>::<slice number>"
        )
        self.device_id = device_id


def format_device_id(uuid: str, index: int) -> str:
    if not _UUID.fullmatch(uuid):
        raise ValueError(f"GPU UUID {uuid!r} must be letters, digits and '-'")
    if index < 0:
        raise ValueError(f"slice number {index} must be >= 0")
    device_id = f"{uuid}{SEPARATOR}{index}"
    if len(device_id) > MAX_ID_LENGTH:
        raise ValueError(f"device ID {device_id!r} is longer than {MAX_ID_LENGTH} characters")
    return device_id


def parse_device_id(device_id: str) -> SliceId:
    if len(device_id) > MAX_ID_LENGTH:
        raise DeviceIdError(device_id, f"is longer than {MAX_ID_LENGTH} characters")
    uuid, sep, index = device_id.rpartition(SEPARATOR)
    if not sep:
        raise DeviceIdError(device_id, f"has no {SEPARATOR!r}")
    # fullmatch: `$` would also match before a trailing newline
    if not _UUID.fullmatch(uuid):
        raise DeviceIdError(device_id, "has a malformed GPU UUID")
    if not _SLICE.fullmatch(index):
        raise DeviceIdError(device_id, "has a malformed slice number")
    return SliceId(uuid, int(index))

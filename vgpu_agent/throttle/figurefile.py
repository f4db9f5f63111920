"""What each container's tokens bought while it was alone on a time-sliced GPU, kept in a file in
the agent's state directory so that a restart of the agent does not forget it.

Those figures (`timesliced.TimeSlicedSplit`) are what keeps containers that share a GPU counted
busy beyond their work from being charged the whole of it, and they can only be learned while a
container has the GPU to itself. Containers running on through an agent restart (a DaemonSet
update) may never be alone again: without the figures, strict ones sharing a GPU starved
(simulated: 29 % of a 30 % limit to 4 %). A turn alone (`throttle/soloturn.py`) now measures one
of them again, but pauses its neighbours to do so; the file spares them that.

The file is the agent's own (not under any container's region directory). It is JSON with a
version, replaced atomically (temp file + rename), not fsync'd: after a power loss the containers
are gone too. One that is missing is no figures; one that does not parse, has another version or
holds a value out of range is logged and ignored (the next save replaces it): a figure can always
be learned again, and a wrong one must not bound anybody.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from vgpu_agent.jsondoc import versioned

log = structlog.get_logger(__name__)

VERSION = 1
FILE_NAME = "throttle-figures.json"
MAX_BYTES = 1 << 20  # far beyond 8 GPUs x hundreds of containers; a bigger file is not ours
MAX_NAME = 256  # characters of a GPU uuid or an allocation id

# GPU uuid -> alloc_id -> (use per token/s while alone, its spending then, tokens/s)
Figures = dict[str, dict[str, tuple[float, float]]]


class FigureFileError(Exception):
    """The file cannot be used; the message names it and why."""


def encode(figures: Mapping[str, Mapping[str, tuple[float, float]]]) -> bytes:
    gpus = {uuid: {alloc_id: [figure, rate] for alloc_id, (figure, rate) in sorted(held.items())}
            for uuid, held in sorted(figures.items()) if held}
    return json.dumps({"version": VERSION, "gpus": gpus}, sort_keys=True).encode()


def decode(data: bytes, where: str) -> Figures:
    if len(data) > MAX_BYTES:
        raise FigureFileError(f"{where}: {len(data)} bytes, at most {MAX_BYTES} allowed")
    gpus = versioned(data, where, VERSION, FigureFileError).get("gpus")
    if not isinstance(gpus, dict):
        raise FigureFileError(f"{where}: gpus is {type(gpus).__name__}, not an object")
    out: Figures = {}
    for uuid, held in gpus.items():
        _name(uuid, "GPU uuid", where)
        if not isinstance(held, dict):
            raise FigureFileError(f"{where}: GPU {uuid}: {held!r} is not an object")
        out[uuid] = {_name(alloc_id, "allocation id", where): _pair(pair, f"{uuid}/{alloc_id}",
                                                                     where)
                     for alloc_id, pair in held.items()}
    return out


def _name(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise FigureFileError(f"{where}: {what} {value!r} must be 1-{MAX_NAME} characters")
    return value


def _pair(value: Any, which: str, where: str) -> tuple[float, float]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in value)):
        raise FigureFileError(f"{where}: {which}: {value!r} must be [figure, rate], both finite "
                              f"and > 0")
    return float(value[0]), float(value[1])


class FigureFile:
    """The file; `load` once at start, `save` whenever the figures changed."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def load(self) -> Figures:
        """The figures in the file; none where it is missing or unusable (logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as err:
            log.warning("throttle_figures_unreadable", path=str(self.path), error=repr(err),
                        effect="figures are learned again where containers are alone")
            return {}
        try:
            return decode(data, str(self.path))
        except FigureFileError as err:
            log.warning("throttle_figures_unusable", path=str(self.path), error=str(err),
                        effect="figures are learned again where containers are alone; the "
                               "next save replaces the file")
            return {}

    def save(self, figures: Mapping[str, Mapping[str, tuple[float, float]]]) -> None:
        """Replace the file with `figures`. Raises OSError."""
        temp = self.path.with_name(f".{self.path.name}.tmp")
        temp.write_bytes(encode(figures))
        os.replace(temp, self.path)

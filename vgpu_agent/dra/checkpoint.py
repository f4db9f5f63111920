"""The prepared claims, kept in a file beside the DRA socket so an agent restart remembers them.

The kubelet calls NodePrepareResources again for claims it already prepared (after its own or the
agent's restart) and expects the same answer; it calls NodeUnprepareResources for claims prepared
by an earlier agent process. Both need to know what was prepared: which region, which CDI spec,
which devices were reported, and what each claim consumes of each GPU (to refuse a new claim
that would overfill one).

The file is JSON with a checksum over its claims, replaced atomically (temp file + rename) after
every change (not fsync'd, like the regions: after a power loss the containers are gone too,
and the kubelet prepares its claims again). A file that does not parse, has the wrong version or
a wrong checksum is moved aside (`.corrupt-<ns>`) and the agent starts with no prepared claims:
their regions are then collected like any region nobody holds, and Unprepare of them succeeds
with nothing to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from vgpu_agent.dra.grant import ClaimRef
from vgpu_agent.jsondoc import versioned

log = structlog.get_logger(__name__)

VERSION = 1


@dataclass(frozen=True)
class ReportedDevice:
    """One device as NodePrepareResources reported it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    share_id: str | None
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedClaim:
    claim: ClaimRef
    alloc_id: str | None  # its region; None when nothing is limited (admin access)
    spec_file: str | None  # its CDI spec's name in the CDI directory
    devices: tuple[ReportedDevice, ...]
    consumed: Mapping[str, tuple[int, int]]  # GPU uuid -> (memory bytes, core percent)


class CheckpointError(Exception):
    """The file cannot be used; the message names it and why."""


def encode(claims: Mapping[str, PreparedClaim]) -> bytes:
    body = {uid: _claim_json(c) for uid, c in sorted(claims.items())}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    doc = {"version": VERSION, "checksum": _digest(text), "claims": body}
    return json.dumps(doc, sort_keys=True).encode()


def decode(data: bytes, where: str) -> dict[str, PreparedClaim]:
    doc = versioned(data, where, VERSION, CheckpointError)
    body = doc.get("claims")
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if doc.get("checksum") != _digest(text):
        raise CheckpointError(f"{where}: checksum does not match its claims (edited or torn)")
    if not isinstance(body, dict):
        raise CheckpointError(f"{where}: claims is not an object")
    out: dict[str, PreparedClaim] = {}
    for uid, raw in body.items():
        try:
            out[uid] = _claim_from(raw)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: claim {uid}: {err!r}") from None
        if out[uid].claim.uid != uid:
            raise CheckpointError(f"{where}: claim {uid} holds uid {out[uid].claim.uid}")
    return out


class Checkpoint:
    """The file and the claims in it; `save()` after each change."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.claims: dict[str, PreparedClaim] = {}

    def load(self) -> dict[str, PreparedClaim]:
        """Read the file; a missing file is no claims, a corrupt one is moved aside."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.claims = {}
            return self.claims
        try:
            self.claims = decode(data, str(self.path))
        except CheckpointError as err:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.time_ns()}")
            with contextlib.suppress(OSError):
                os.rename(self.path, aside)
            log.error(
                "dra_checkpoint_corrupt",
                path=str(self.path),
                error=str(err),
                moved_to=str(aside),
                effect="prepared claims are forgotten; their regions are collected when unheld",
            )
            self.claims = {}
        return self.claims

    def save(self) -> None:
        """Replace the file with the current claims. Raises OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        temp.write_bytes(encode(self.claims))
        os.replace(temp, self.path)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _claim_json(c: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": c.claim.namespace,
        "name": c.claim.name,
        "uid": c.claim.uid,
        "allocId": c.alloc_id,
        "specFile": c.spec_file,
        "devices": [
            {
                "requests": list(d.requests),
                "pool": d.pool,
                "device": d.device,
                "shareID": d.share_id,
                "cdiDeviceIDs": list(d.cdi_ids),
            }
            for d in c.devices
        ],
        "consumed": {uuid: list(v) for uuid, v in sorted(c.consumed.items())},
    }


def _claim_from(raw: Any) -> PreparedClaim:
    def text(value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value

    def optional(value: Any) -> str | None:
        return None if value is None else text(value)

    devices = tuple(
        ReportedDevice(
            tuple(text(r) for r in d["requests"]),
            text(d["pool"]),
            text(d["device"]),
            optional(d.get("shareID")),
            tuple(text(i) for i in d["cdiDeviceIDs"]),
        )
        for d in raw["devices"]
    )
    consumed = {}
    for uuid, pair in raw["consumed"].items():
        memory, cores = pair
        if not isinstance(memory, int) or not isinstance(cores, int):
            raise TypeError(f"consumed {uuid}: {pair!r}")
        consumed[text(uuid)] = (memory, cores)
    return PreparedClaim(
        ClaimRef(text(raw["namespace"]), text(raw["name"]), text(raw["uid"])),
        optional(raw.get("allocId")),
        optional(raw.get("specFile")),
        devices,
        consumed,
    )

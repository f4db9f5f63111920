"""CDI spec files, one per prepared claim: what the container runtime adds to the containers.

A claim's spec has one CDI device, `<driver>/claim=<claim uid>`, whose container edits are the
claim's region (mounts and variables, the shim) and the limits as variables. The physical GPU
itself comes from the NVIDIA container toolkit's own CDI device (`nvidia.com/gpu=<uuid>`), which
the kubelet is given alongside ours: the toolkit knows the driver's files, we know the limits.

Files are JSON (`<driver>-claim_<uid>.json` in the CDI directory) written to a temporary name
that CDI ignores and renamed into place, so a runtime never reads half a spec.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CDI_VERSION = "0.6.0"
CLASS = "claim"
MOUNT_OPTIONS_RO = ["ro", "nosuid", "nodev", "bind"]
MOUNT_OPTIONS_RW = ["rw", "nosuid", "nodev", "bind"]
_TEMP_SUFFIX = ".tmp"


def kind(driver: str) -> str:
    return f"{driver}/{CLASS}"


def device_id(driver: str, claim_uid: str) -> str:
    """The fully qualified CDI name of a claim's device."""
    return f"{kind(driver)}={claim_uid}"


def claim_uid_of(cdi_name: str, driver: str) -> str | None:
    """The claim UID in one of our CDI names (from PodResources), None for anyone else's."""
    prefix = kind(driver) + "="
    if not cdi_name.startswith(prefix):
        return None
    uid = cdi_name[len(prefix) :]
    return uid if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]*", uid) else None


def spec_name(driver: str, claim_uid: str) -> str:
    return f"{driver}-{CLASS}_{claim_uid}.json"


def claim_spec(
    driver: str,
    claim_uid: str,
    envs: Mapping[str, str],
    mounts: Iterable[tuple[str, str, bool]],  # container path, host path, read-only
) -> dict[str, Any]:
    """The spec document of one claim (pure)."""
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(envs.items())]}
    mount_list = [
        {
            "hostPath": host,
            "containerPath": inside,
            "options": MOUNT_OPTIONS_RO if read_only else MOUNT_OPTIONS_RW,
        }
        for inside, host, read_only in mounts
    ]
    if mount_list:
        edits["mounts"] = mount_list
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": [{"name": claim_uid, "containerEdits": edits}],
    }


def write_spec(cdi_dir: str | os.PathLike[str], name: str, spec: Mapping[str, Any]) -> Path:
    """Write a spec atomically (temp file, then rename). Raises OSError."""
    directory = Path(cdi_dir)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    final = directory / name
    temp = directory / f".{name}{_TEMP_SUFFIX}"
    data = json.dumps(spec, indent=2, sort_keys=True).encode()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    try:
        os.replace(temp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return final


def remove_spec(cdi_dir: str | os.PathLike[str], name: str) -> bool:
    """Delete a spec; False if it was not there. Raises OSError for other failures."""
    try:
        os.unlink(Path(cdi_dir) / name)
    except FileNotFoundError:
        return False
    return True


def our_specs(cdi_dir: str | os.PathLike[str], driver: str) -> dict[str, str]:
    """Claim UID -> file name of every spec of ours (and leftover temp files) in the directory."""
    prefix = f"{driver}-{CLASS}_"
    found: dict[str, str] = {}
    try:
        names = os.listdir(cdi_dir)
    except FileNotFoundError:
        return found
    for name in names:
        bare = name.removeprefix(".").removesuffix(_TEMP_SUFFIX)
        if bare.startswith(prefix) and bare.endswith(".json"):
            found.setdefault(bare[len(prefix) : -len(".json")], name)
    return found

"""Node labels this agent owns, in the style GPU feature discovery users know. Pure.

Every key lives under `LABEL_PREFIX`; the patch built here touches no other key, and removes the
keys of that prefix the agent no longer sets (a GPU model that is gone, an old label name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from vgpu_agent.gpu.model import MIB, GpuInfo

LABEL_PREFIX = "vgpu.io/"
PRODUCT = LABEL_PREFIX + "gpu.product"
MEMORY = LABEL_PREFIX + "gpu.memory"
COUNT = LABEL_PREFIX + "gpu.count"
REPLICAS = LABEL_PREFIX + "gpu.replicas"
COMPUTE_MAJOR = LABEL_PREFIX + "gpu.compute.major"
COMPUTE_MINOR = LABEL_PREFIX + "gpu.compute.minor"
AGENT_VERSION = LABEL_PREFIX + "agent.version"

_MAX_VALUE = 63
_INVALID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def label_value(text: str) -> str:
    """Make `text` a valid label value: runs of other characters become '-', at most 63 chars,
    starting and ending with a letter or digit ('' when nothing is left)."""
    value = _INVALID_CHARS.sub("-", text.strip())[:_MAX_VALUE]
    return _EDGE.sub("", value)


def node_labels(gpus: Sequence[GpuInfo], split_count: int, version: str) -> dict[str, str]:
    """The labels this agent wants on its node.

    A node with mixed GPU models is labelled with the product of its lowest-index GPU and the
    smallest memory, so a selector on memory never promises more than every GPU has.
    """
    if split_count < 1:
        raise ValueError(f"split_count must be at least 1, got {split_count}")
    labels = {
        COUNT: str(len(gpus)),
        REPLICAS: str(split_count),
        AGENT_VERSION: label_value(version),
    }
    if gpus:
        first = min(gpus, key=lambda g: g.index)
        labels[PRODUCT] = label_value(first.name)
        labels[MEMORY] = str(min(g.memory_total for g in gpus) // MIB)
        if first.compute_capability != (0, 0):
            labels[COMPUTE_MAJOR] = str(first.compute_capability[0])
            labels[COMPUTE_MINOR] = str(first.compute_capability[1])
    return {key: value for key, value in labels.items() if value}


def labels_patch(current: Mapping[str, str], desired: Mapping[str, str]) -> dict[str, str | None]:
    """The label changes that turn `current` into `desired` for this agent's keys only.

    A value of None deletes the key (merge-patch semantics). Keys outside `LABEL_PREFIX` are never
    named, so other owners' labels are left as they are. Empty when nothing needs to change.
    """
    foreign = [key for key in desired if not key.startswith(LABEL_PREFIX)]
    if foreign:
        raise ValueError(f"labels {sorted(foreign)} are outside this agent's prefix {LABEL_PREFIX}")
    patch: dict[str, str | None] = {
        key: value for key, value in desired.items() if current.get(key) != value
    }
    for key in current:
        if key.startswith(LABEL_PREFIX) and key not in desired:
            patch[key] = None
    return patch

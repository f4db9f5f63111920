"""Which priorities a tenant may take for itself on this node. Pure.

One rule for a pod's `vgpu.io/priority` annotation (`throttle/podpolicy.py`) and for the
`priority` a DRA claim sets in its own configuration (`dra/grant.py`): at most the node's
`pod_priority_max`, and above the default only in `pod_priority_namespaces`. Each caller words
its own answer, since a refused annotation falls back to the default and a refused claim fails.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum


class Overreach(Enum):
    ABOVE_MOST = "above the node's most"
    OUTSIDE_NAMESPACES = "above the default outside the namespaces allowed"


def overreach(value: int, namespace: str, most: int, namespaces: Collection[str],
              default: int = 0) -> Overreach | None:
    """How `value`, asked for by a tenant in `namespace`, breaks the node's rule; None if not."""
    if value > most:
        return Overreach.ABOVE_MOST
    if value > default and namespace not in namespaces:
        return Overreach.OUTSIDE_NAMESPACES
    return None

"""A versioned JSON document, as the agent's own files keep it (pure: bytes in, object out)."""

from __future__ import annotations

import json
from typing import Any


def versioned(data: bytes, where: str, version: int,
              error: type[Exception]) -> dict[str, Any]:
    """The JSON object in `data`, which must say `"version": version`; `error` with a message
    naming `where` and what is wrong otherwise."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise error(f"{where}: not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("version") != version:
        found = doc.get("version") if isinstance(doc, dict) else None
        raise error(f"{where}: version {found!r}, this agent reads {version}")
    return doc

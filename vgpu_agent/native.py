"""The optional C extensions, each loaded where it was built and fits its Python beside it.

`setup.py` builds them where a C compiler is found. Where one was not built, was built but does
not load (the loader's own error is kept), or was built for another layout or law than the
Python beside it (its `bind` refuses the numbers it is given), its Python reference runs
instead, and the reason is kept so that the agent can say why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load(name: str, bind: Callable[[Any], str | None] | None = None) -> tuple[Any, str | None]:
    """(the module, None) where the extension `name` (a dotted module name) was built and
    `bind`, where given, accepts it; (None, why not) otherwise."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == name:
            return None, f"{name} was not built (no C compiler at install)"
        # built, but its shared object does not load here (another Python, a missing symbol,
        # a file cut short): what the loader said is the reason
        return None, f"{name} was built but does not load: {error}"
    refused = bind(module) if bind is not None else None
    if refused is not None:
        return None, refused
    return module, None

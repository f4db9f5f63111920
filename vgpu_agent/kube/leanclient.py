"""kubernetes_asyncio without importing its whole generated catalogue up front.

`import kubernetes_asyncio` imports every API group and every model class the generator wrote
(some 840 modules): about 30 MB of the agent's memory and a third of a second of CPU, for a
client of which the agent uses the configuration loaders, `ApiClient`, in DRA mode one or two
`*Api` classes and a model or two (its calls read plain JSON, see `apiclient.call_json`; the
core API's few calls it makes itself, `coreapi.CoreApi`).

`install()` registers the package, `kubernetes_asyncio.client`, its `api` and its `models` as
empty packages whose attributes are imported on first use: `client.CoreV1Api` imports
`client/api/core_v1_api.py`, `client.V1DeleteOptions` (or `models.V1DeleteOptions`, as the
client's own deserializer asks) imports `client/models/v1_delete_options.py`, and
`kubernetes_asyncio.watch` and the rest are imported as the submodules they are.
`kubernetes_asyncio.config` is registered bare too: its `incluster_config` is imported alone
(all an agent in a cluster loads), and the package's own `__init__` (which imports the
kubeconfig loader with yaml: 1.05 MB of an agent with its adapters imported) runs, into the same
module, on the first use of any other of its names (`config.load_kube_config`). Everything
else of the library is its own code, unchanged.

It is installed only when nothing has imported kubernetes_asyncio yet and every module it
relies on is where this version of the library keeps it; otherwise the library is imported
whole, as usual. Called from `vgpu_agent.kube` (its package `__init__`), so that every
adapter importing the client through `vgpu_agent.kube` gets the lean one.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
import types
from typing import Any

PACKAGE = "kubernetes_asyncio"
CLIENT = f"{PACKAGE}.client"
CONFIG = f"{PACKAGE}.config"
# what `client.<name>` is, for the names that are neither an `*Api` class nor a model
_CLIENT_MODULES = {
    "ApiClient": "api_client",
    "Configuration": "configuration",
    "ApiException": "exceptions",
    "ApiValueError": "exceptions",
    "ApiTypeError": "exceptions",
    "ApiKeyError": "exceptions",
    "ApiAttributeError": "exceptions",
    "OpenApiException": "exceptions",
}
_SUBMODULES = frozenset({"api_client", "configuration", "exceptions", "rest", "api", "models"})
# the modules the agent's adapters import: all must be there for the lean client to be used
REQUIRED = (
    f"{CLIENT}.api_client",
    f"{CLIENT}.configuration",
    f"{CLIENT}.exceptions",
    f"{CLIENT}.rest",
    f"{CLIENT}.models.v1_delete_options",
    f"{PACKAGE}.config",
    f"{PACKAGE}.config.incluster_config",
    f"{PACKAGE}.config.kube_config",
)


def module_name(class_name: str) -> str:
    """The generator's file name for a class: `V1DeleteOptions` -> `v1_delete_options`."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", class_name)
    name = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name)
    return name.replace("-", "_").lower()


def install() -> bool:
    """Register the lean packages; False (and nothing changed) where the library is imported
    already, or is not laid out as expected."""
    if PACKAGE in sys.modules:
        return False
    bare: dict[str, types.ModuleType] = {}
    for name in (PACKAGE, CLIENT, f"{CLIENT}.api", f"{CLIENT}.models", CONFIG):
        parent = name.rpartition(".")[0]
        module = _bare_package(name, bare[parent].__path__ if parent else None)
        if module is None:
            return False
        bare[name] = module
    if not all(_exists(name, bare) for name in REQUIRED):
        return False
    for name, module in bare.items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(bare[parent], child, module)
    top, client, models = bare[PACKAGE], bare[CLIENT], bare[f"{CLIENT}.models"]
    top.__getattr__ = _submodule_getter(PACKAGE)  # type: ignore[method-assign]
    client.__getattr__ = _client_getter(client)  # type: ignore[method-assign]
    models.__getattr__ = _model_getter(models)  # type: ignore[method-assign]
    bare[CONFIG].__getattr__ = _init_on_use(bare[CONFIG])  # type: ignore[method-assign]
    return True


def is_lean() -> bool:
    """Whether the kubernetes_asyncio in this process is the lean one."""
    client = sys.modules.get(CLIENT)
    return client is not None and "__getattr__" in vars(client)


def _bare_package(name: str, path: Any) -> types.ModuleType | None:
    """The package's module object with its `__init__` not run, found on `path` (the parent's
    search path; None for a top-level package) without importing the parent."""
    child = name.rpartition(".")[2]
    try:
        spec = importlib.machinery.PathFinder.find_spec(child, None if path is None else list(path))
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or spec.submodule_search_locations is None:
        return None
    named = importlib.util.spec_from_file_location(
        name, spec.origin, submodule_search_locations=list(spec.submodule_search_locations)
    )
    return None if named is None else importlib.util.module_from_spec(named)


def _exists(name: str, bare: dict[str, types.ModuleType]) -> bool:
    """Whether module `name` is there, looked up on the bare packages' paths."""
    parent, _, child = name.rpartition(".")
    while parent not in bare:  # e.g. kubernetes_asyncio.config.incluster_config
        parent, _, middle = parent.rpartition(".")
        child = f"{middle}.{child}"
    path = list(bare[parent].__path__)
    for part in child.split("."):
        found = importlib.machinery.PathFinder.find_spec(part, path)
        if found is None:
            return False
        path = list(found.submodule_search_locations or [])
    return True


def _submodule_getter(package: str) -> Any:
    def getter(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return getter


def _client_getter(client: types.ModuleType) -> Any:
    def getter(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _SUBMODULES:
            value: Any = importlib.import_module(f"{CLIENT}.{name}")
        elif name in _CLIENT_MODULES:
            value = getattr(importlib.import_module(f"{CLIENT}.{_CLIENT_MODULES[name]}"), name)
        elif name.endswith("Api"):
            value = _class_from(f"{CLIENT}.api", name)
        else:
            value = getattr(sys.modules[f"{CLIENT}.models"], name)
        setattr(client, name, value)
        return value

    return getter


def _init_on_use(package: types.ModuleType) -> Any:
    """A bare package's `__getattr__` that runs the package's own `__init__` into it on the first
    name it lacks (once), and then answers from what that defined."""
    ran = False

    def getter(name: str) -> Any:
        nonlocal ran
        if name.startswith("__") or ran:
            raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")
        ran = True
        spec = package.__spec__
        if spec is None or spec.loader is None:  # made by `_bare_package`, which gives both
            raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")
        spec.loader.exec_module(package)
        try:
            return vars(package)[name]
        except KeyError:
            raise AttributeError(
                f"module {package.__name__!r} has no attribute {name!r}") from None

    return getter


def _model_getter(models: types.ModuleType) -> Any:
    def getter(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _class_from(f"{CLIENT}.models", name)
        setattr(models, name, value)
        return value

    return getter


def _class_from(package: str, name: str) -> Any:
    try:
        module = importlib.import_module(f"{package}.{module_name(name)}")
        return getattr(module, name)
    except (ModuleNotFoundError, AttributeError):
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

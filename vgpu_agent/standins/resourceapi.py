"""The `resource.k8s.io/v1` part of the fake API server: ResourceSlice, ResourceClaim, DeviceClass.

What it does like the real server:
- stores objects with the cluster-wide increasing `metadata.resourceVersion`, a `uid`,
  `creationTimestamp` and `metadata.generation` (1 on create, +1 on every change of `spec`, never
  on a status or metadata-only change); a write that changes nothing bumps nothing and sends no
  watch event;
- create (POST, with `generateName`), get, list, replace (PUT), patch (strategic, merge and JSON
  patch, as `kubernetes_asyncio` sends them), delete (with `preconditions`), delete-collection and
  watch, at the real paths; ResourceClaim has a `status` subresource (the main resource ignores
  status changes, `/status` ignores spec changes; status is dropped on create);
- a stale `metadata.resourceVersion` on PUT, a merge patch or a delete precondition is a 409
  Conflict; an unknown name is a 404; an existing name on create is a 409 AlreadyExists;
- list and watch honour `labelSelector` (`=`, `==`, `!=`, `in`, `notin`, exists, `!`exists) and
  the field selectors each kind supports (ResourceSlice: `metadata.name`, `spec.nodeName`,
  `spec.driver`); any other field is a 400, as on the real server;
- validates what the scheduler and the kubelet rely on (422 Invalid with the field path): DNS
  names, exactly one node selection of a slice, at most 128 devices (64 when any has taints),
  unique DNS-label device names, one value per attribute, at most 32 attributes and capacities,
  quantities, request policies, taint effects; `spec.driver`, `spec.nodeName`, `spec.pool.name`
  of a slice and the whole `spec` of a claim are immutable;
- stores quantities in canonical form (`1024Mi` is read back as `1Gi`) and stamps `timeAdded`
  on device taints written without one (so a writer that leaves it out changes the slice);
- watch streams `ADDED`/`MODIFIED`/`DELETED` lines from a resourceVersion (or the current objects
  first when none is given), sends `DELETED` when a change makes an object stop matching the
  selectors, answers a compacted resourceVersion with an `ERROR` event carrying a 410 Status, and
  ends at `timeoutSeconds`.

What is simplified: strategic merge patch is applied as a JSON merge patch, which is exact here
because every list in these kinds is atomic (`devices`, `taints`, `results`, `config`); no
managedFields, no finalizers, no admission; bookmarks are not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import json
import random
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vgpu_agent.dra.quantity import QuantityError, canonical, parse

GROUP = "resource.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
PREFIX = f"/apis/{GROUP}/{VERSION}"

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$"
)
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the real server's alphabet for generateName
_TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")


class ApiError(Exception):
    """A request the real server would refuse: answered as a `Status` with this code."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def _spec_get(*path: str) -> Callable[[dict[str, Any]], str]:
    def get(obj: dict[str, Any]) -> str:
        value: Any = obj
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return "" if value is None else str(value)

    return get


@dataclass(frozen=True)
class Kind:
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool
    fields: dict[str, Callable[[dict[str, Any]], str]]


_META_FIELDS = {
    "metadata.name": _spec_get("metadata", "name"),
    "metadata.namespace": _spec_get("metadata", "namespace"),
}
KINDS = {
    "resourceslices": Kind(
        "resourceslices",
        "ResourceSlice",
        namespaced=False,
        status_subresource=False,
        fields={
            **_META_FIELDS,
            "spec.nodeName": _spec_get("spec", "nodeName"),
            "spec.driver": _spec_get("spec", "driver"),
        },
    ),
    "resourceclaims": Kind(
        "resourceclaims", "ResourceClaim", namespaced=True, status_subresource=True,
        fields=dict(_META_FIELDS),
    ),
    "deviceclasses": Kind(
        "deviceclasses", "DeviceClass", namespaced=False, status_subresource=False,
        fields=dict(_META_FIELDS),
    ),
}


# --- selectors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    """A parsed label or field selector: a conjunction of (key, op, values)."""

    terms: tuple[tuple[str, str, frozenset[str]], ...] = ()

    def matches(self, values: Callable[[str], str | None]) -> bool:
        for key, op, wanted in self.terms:
            value = values(key)
            if op == "in" and value not in wanted:
                return False
            if op == "notin" and value in wanted:
                return False
            if op == "exists" and value is None:
                return False
            if op == "!exists" and value is not None:
                return False
        return True


def _split_terms(text: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(text: str | None) -> Selector:
    if not text:
        return Selector()
    terms = []
    for term in _split_terms(text):
        set_match = re.match(r"^([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)$", term)
        if set_match:
            values = frozenset(v.strip() for v in set_match[3].split(",") if v.strip())
            terms.append((set_match[1], set_match[2], values))
            continue
        eq = re.match(r"^([^\s!=()]+)\s*(==|=|!=)\s*([^\s!=()]*)$", term)
        if eq:
            op = "notin" if eq[2] == "!=" else "in"
            terms.append((eq[1], op, frozenset([eq[3]])))
            continue
        if re.match(r"^![^\s!=()]+$", term):
            terms.append((term[1:], "!exists", frozenset()))
            continue
        if re.match(r"^[^\s!=()]+$", term):
            terms.append((term, "exists", frozenset()))
            continue
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return Selector(tuple(terms))


def parse_field_selector(text: str | None, kind: Kind) -> Selector:
    if not text:
        return Selector()
    terms = []
    for term in _split_terms(text):
        match = re.match(r"^([^!=]+)(==|=|!=)(.*)$", term)
        if not match:
            raise ApiError(400, "BadRequest", f"invalid selector: {term!r}")
        key = match[1].strip()
        if key not in kind.fields:
            raise ApiError(
                400,
                "BadRequest",
                f'"{key}" is not a known field selector: only '
                + ", ".join(f'"{f}"' for f in kind.fields),
            )
        op = "notin" if match[2] == "!=" else "in"
        terms.append((key, op, frozenset([match[3].strip()])))
    return Selector(tuple(terms))


# --- validation --------------------------------------------------------------------------------


def _qualified_name(name: str) -> bool:
    prefix, _, last = name.rpartition("/")
    if prefix and (len(prefix) > 63 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return bool(_C_IDENTIFIER.match(last))


def _label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return (not prefix or bool(_DNS_SUBDOMAIN.match(prefix))) and bool(_LABEL_NAME.match(name))


def _quantity(value: Any, where: str, problems: list[str]) -> Any:
    try:
        return parse(value)
    except QuantityError as exc:
        problems.append(f"{where}: Invalid value: {value!r}: {exc}")
        return None


def _validate_meta(obj: dict[str, Any], problems: list[str]) -> None:
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if not _DNS_SUBDOMAIN.match(name):
        problems.append(f"metadata.name: Invalid value: {name!r}: must be a DNS subdomain")
    for key, value in (meta.get("labels") or {}).items():
        if not _label_key(key) or not isinstance(value, str) or not _LABEL_VALUE.match(value):
            problems.append(f"metadata.labels: Invalid value: {key!r}={value!r}")


def _validate_device(device: Any, where: str, problems: list[str]) -> None:
    if not isinstance(device, dict):
        problems.append(f"{where}: Invalid value: a device is an object")
        return
    name = device.get("name", "")
    if not isinstance(name, str) or not _DNS_LABEL.match(name):
        problems.append(f"{where}.name: Invalid value: {name!r}: must be a DNS label")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > 32:
        problems.append(f"{where}: Too many: attributes and capacities together must be <= 32")
    for key, value in attributes.items():
        if not _qualified_name(key):
            problems.append(f"{where}.attributes[{key}]: Invalid value: not a qualified name")
        kinds = [k for k in ("int", "bool", "string", "version") if k in (value or {})]
        if len(kinds) != 1:
            problems.append(
                f"{where}.attributes[{key}]: Invalid value: exactly one of int, bool, string, "
                f"version must be set, got {kinds}"
            )
            continue
        inner = value[kinds[0]]
        if kinds[0] == "int" and (not isinstance(inner, int) or isinstance(inner, bool)):
            problems.append(f"{where}.attributes[{key}].int: Invalid value: {inner!r}")
        if kinds[0] == "bool" and not isinstance(inner, bool):
            problems.append(f"{where}.attributes[{key}].bool: Invalid value: {inner!r}")
        if kinds[0] == "string" and (not isinstance(inner, str) or len(inner) > 64):
            problems.append(
                f"{where}.attributes[{key}].string: Invalid value: {inner!r}: at most 64 chars"
            )
        if kinds[0] == "version" and (
            not isinstance(inner, str) or len(inner) > 64 or not _SEMVER.match(inner)
        ):
            problems.append(
                f"{where}.attributes[{key}].version: Invalid value: {inner!r}: must be semver"
            )
    for key, value in capacity.items():
        at = f"{where}.capacity[{key}]"
        if not _qualified_name(key):
            problems.append(f"{at}: Invalid value: not a qualified name")
        if not isinstance(value, dict) or "value" not in value:
            problems.append(f"{at}.value: Required value")
            continue
        total = _quantity(value["value"], f"{at}.value", problems)
        policy = value.get("requestPolicy")
        if policy is None or total is None:
            continue
        _validate_policy(policy, total, at + ".requestPolicy", problems)
    taints = device.get("taints") or []
    if len(taints) > 16:
        problems.append(f"{where}.taints: Too many: {len(taints)}: must have at most 16")
    for i, taint in enumerate(taints):
        if not _label_key(taint.get("key", "")):
            problems.append(f"{where}.taints[{i}].key: Invalid value: {taint.get('key')!r}")
        if not _LABEL_VALUE.match(str(taint.get("value", ""))):
            problems.append(f"{where}.taints[{i}].value: Invalid value: {taint.get('value')!r}")
        if taint.get("effect") not in _TAINT_EFFECTS:
            problems.append(
                f"{where}.taints[{i}].effect: Unsupported value: {taint.get('effect')!r}: "
                f"supported values: {', '.join(_TAINT_EFFECTS)}"
            )


def _validate_policy(policy: Any, total: Any, at: str, problems: list[str]) -> None:
    default = policy.get("default")
    default_value = _quantity(default, at + ".default", problems) if default is not None else None
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range is not None and valid_values is not None:
        problems.append(f"{at}: Invalid value: validRange and validValues are exclusive")
    if valid_values is not None:
        values = [_quantity(v, f"{at}.validValues", problems) for v in valid_values]
        if default_value is None or default_value not in values:
            problems.append(f"{at}.default: Invalid value: must be one of validValues")
        if values != sorted(v for v in values if v is not None) or len(values) > 10:
            problems.append(f"{at}.validValues: Invalid value: at most 10, ascending")
    if valid_range is not None:
        if "min" not in valid_range:
            problems.append(f"{at}.validRange.min: Required value")
            return
        low = _quantity(valid_range["min"], f"{at}.validRange.min", problems)
        high = (
            _quantity(valid_range["max"], f"{at}.validRange.max", problems)
            if "max" in valid_range
            else None
        )
        step = (
            _quantity(valid_range["step"], f"{at}.validRange.step", problems)
            if "step" in valid_range
            else None
        )
        if low is None:
            return
        if low < 0 or low > total:
            problems.append(f"{at}.validRange.min: Invalid value: must be in [0, capacity]")
        if high is not None and (high > total or high < low):
            problems.append(f"{at}.validRange.max: Invalid value: must be in [min, capacity]")
        if step is not None:
            if step <= 0 or low + step > total:
                problems.append(f"{at}.validRange.step: Invalid value: min + step > capacity")
            elif high is not None and high % step:
                problems.append(f"{at}.validRange.max: Invalid value: not a multiple of step")
            elif default_value is not None and default_value % step:
                problems.append(f"{at}.default: Invalid value: not a multiple of step")
        if default_value is not None and (
            default_value < low or (high is not None and default_value > high)
        ):
            problems.append(f"{at}.default: Invalid value: outside validRange")


def _validate_slice(obj: dict[str, Any], problems: list[str]) -> None:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        problems.append("spec: Required value")
        return
    driver = spec.get("driver", "")
    if not isinstance(driver, str) or len(driver) > 63 or not _DNS_SUBDOMAIN.match(driver):
        problems.append(f"spec.driver: Invalid value: {driver!r}: must be a DNS subdomain")
    pool = spec.get("pool") or {}
    pool_name = pool.get("name", "")
    if not pool_name or len(pool_name) > 253 or not all(
        _DNS_SUBDOMAIN.match(part) for part in str(pool_name).split("/")
    ):
        problems.append(f"spec.pool.name: Invalid value: {pool_name!r}")
    generation = pool.get("generation", 0)
    if not isinstance(generation, int) or generation < 0:
        problems.append(f"spec.pool.generation: Invalid value: {generation!r}: must be >= 0")
    count = pool.get("resourceSliceCount")
    if not isinstance(count, int) or count < 1:
        problems.append(f"spec.pool.resourceSliceCount: Invalid value: {count!r}: must be > 0")
    chosen = [
        key
        for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(key) not in (None, False, "")
    ]
    if len(chosen) != 1:
        problems.append(
            "spec: Invalid value: exactly one of nodeName, nodeSelector, allNodes, "
            f"perDeviceNodeSelection is required, got {chosen}"
        )
    devices = spec.get("devices") or []
    limit = 64 if any(d.get("taints") for d in devices if isinstance(d, dict)) else 128
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit}")
    names = set()
    for i, device in enumerate(devices):
        _validate_device(device, f"spec.devices[{i}]", problems)
        name = device.get("name") if isinstance(device, dict) else None
        if name in names:
            problems.append(f"spec.devices[{i}].name: Duplicate value: {name!r}")
        names.add(name)


def _validate_claim(obj: dict[str, Any], problems: list[str]) -> None:
    requests = ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []
    names = set()
    for i, request in enumerate(requests):
        at = f"spec.devices.requests[{i}]"
        name = request.get("name", "")
        if not _DNS_LABEL.match(name):
            problems.append(f"{at}.name: Invalid value: {name!r}: must be a DNS label")
        if name in names:
            problems.append(f"{at}.name: Duplicate value: {name!r}")
        names.add(name)
        if ("exactly" in request) == ("firstAvailable" in request):
            problems.append(f"{at}: Invalid value: exactly one of exactly, firstAvailable")
            continue
        exactly = request.get("exactly")
        if exactly is None:
            continue
        if not exactly.get("deviceClassName"):
            problems.append(f"{at}.exactly.deviceClassName: Required value")
        mode = exactly.get("allocationMode", "ExactCount")
        if mode not in ("ExactCount", "All"):
            problems.append(f"{at}.exactly.allocationMode: Unsupported value: {mode!r}")
        count = exactly.get("count", 1)
        if mode == "ExactCount" and (not isinstance(count, int) or count < 1):
            problems.append(f"{at}.exactly.count: Invalid value: {count!r}: must be > 0")
        for key, value in ((exactly.get("capacity") or {}).get("requests") or {}).items():
            _quantity(value, f"{at}.exactly.capacity.requests[{key}]", problems)
    results = (
        ((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}
    ).get("results") or []
    for i, result in enumerate(results):
        at = f"status.allocation.devices.results[{i}]"
        for key in ("request", "driver", "pool", "device"):
            if not result.get(key):
                problems.append(f"{at}.{key}: Required value")
        for key, value in (result.get("consumedCapacity") or {}).items():
            _quantity(value, f"{at}.consumedCapacity[{key}]", problems)


def _validate_class(obj: dict[str, Any], problems: list[str]) -> None:
    spec = obj.get("spec") or {}
    for i, selector in enumerate(spec.get("selectors") or []):
        if not isinstance((selector.get("cel") or {}).get("expression"), str):
            problems.append(f"spec.selectors[{i}].cel.expression: Required value")
    name = spec.get("extendedResourceName")
    if name is not None and ("/" not in name or name.startswith("kubernetes.io/")):
        problems.append(f"spec.extendedResourceName: Invalid value: {name!r}")


_VALIDATE = {
    "resourceslices": _validate_slice,
    "resourceclaims": _validate_claim,
    "deviceclasses": _validate_class,
}
_IMMUTABLE = {
    "resourceslices": (("spec", "driver"), ("spec", "nodeName"), ("spec", "pool", "name")),
    "resourceclaims": (("spec",),),
    "deviceclasses": (),
}


def _canonical_quantities(obj: Any, parent: str = "") -> Any:
    """Rewrite quantity fields the way the server stores them."""
    if isinstance(obj, list):
        return [_canonical_quantities(item) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        in_map = parent in ("capacity", "consumedCapacity", "requests")
        if (in_map or key in _QUANTITY_KEYS) and isinstance(value, str | int):
            out[key] = _canonical_or_same(value)
        elif key == "validValues" and isinstance(value, list):
            out[key] = [_canonical_or_same(v) for v in value]
        else:
            out[key] = _canonical_quantities(value, key)
    return out


_QUANTITY_KEYS = ("value", "default", "min", "max", "step")


def _canonical_or_same(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    try:
        return canonical(value)
    except QuantityError:
        return value  # validation names it


def _stamp_taints(obj: dict[str, Any]) -> None:
    """Device taints get `timeAdded` on create or update where the writer left it out."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for device in (obj.get("spec") or {}).get("devices") or []:
        for taint in (device.get("taints") if isinstance(device, dict) else None) or []:
            if isinstance(taint, dict) and not taint.get("timeAdded"):
                taint["timeAdded"] = now


def _dig(obj: Any, path: Iterable[str]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del parent[index]
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            elif kind == "test":
                if parent[index] != op["value"]:
                    raise ValueError(f"test failed at {op['path']}")
            else:
                raise ValueError(f"unsupported op {kind!r}")
            continue
        if kind == "add":
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        elif kind == "replace":
            if last not in parent:
                raise KeyError(op["path"])
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "test":
            if parent.get(last) != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        else:
            raise ValueError(f"unsupported op {kind!r}")
    return doc


# --- the store ---------------------------------------------------------------------------------


@dataclass
class WatchEvent:
    rv: int
    plural: str
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class _Watcher:
    plural: str
    namespace: str | None
    labels: Selector
    fields: Selector
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


Key = tuple[str, str]  # (namespace or "", name)


@dataclass
class ResourceStore:
    """Objects of the three kinds; every change goes through here (requests and test helpers)."""

    next_rv: Callable[[], str]
    current_rv: Callable[[], int]
    objects: dict[str, dict[Key, dict[str, Any]]] = field(
        default_factory=lambda: {plural: {} for plural in KINDS}
    )
    history: list[WatchEvent] = field(default_factory=list)
    compacted_rv: int = 0  # watches from a resourceVersion below this get 410 Gone
    watchers: list[_Watcher] = field(default_factory=list)

    # --- what tests use -----------------------------------------------------------------

    def items(self, plural: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for o in self.objects[plural].values()]

    def slices(self, node: str | None = None, driver: str | None = None) -> list[dict[str, Any]]:
        """The stored ResourceSlices, optionally of one node and driver, sorted by name."""
        found = [
            s
            for s in self.items("resourceslices")
            if (node is None or s["spec"].get("nodeName") == node)
            and (driver is None or s["spec"].get("driver") == driver)
        ]
        return sorted(found, key=lambda s: s["metadata"]["name"])

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(self._stored(plural, namespace, name))

    def edit(
        self,
        plural: str,
        name: str,
        change: Callable[[dict[str, Any]], None],
        namespace: str = "",
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Change an object as another writer would (through the update path)."""
        obj = self.get(plural, name, namespace)
        change(obj)
        return self.update(plural, namespace, name, obj, subresource)

    def compact(self) -> None:
        """Forget the change history (watches from an older resourceVersion now get 410)."""
        self.history.clear()
        self.compacted_rv = self.current_rv() + 1

    def close_watches(self) -> None:
        """End every open watch stream, as an API server restart does."""
        for watcher in self.watchers:
            watcher.queue.put_nowait(None)

    # --- operations ---------------------------------------------------------------------

    def _stored(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects[plural].get((namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{plural}.{GROUP} "{name}" not found')
        return obj

    def create(self, plural: str, namespace: str, body: Any) -> dict[str, Any]:
        kind = KINDS[plural]
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", f"{kind.kind} body must be a JSON object")
        self._check_type(kind, body)
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = API_VERSION, kind.kind
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise ApiError(
                400, "BadRequest", "resourceVersion should not be set on objects to be created"
            )
        if kind.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choices(_GENERATE_CHARS, k=5)
            )
        if kind.status_subresource:
            obj.pop("status", None)
        problems: list[str] = []
        _validate_meta(obj, problems)
        _VALIDATE[plural](obj, problems)
        if problems:
            raise ApiError(422, "Invalid", f'{kind.kind}.{GROUP} "{meta.get("name")}" is '
                           f"invalid: " + "; ".join(problems))
        key = (namespace if kind.namespaced else "", meta["name"])
        if key in self.objects[plural]:
            raise ApiError(
                409, "AlreadyExists", f'{plural}.{GROUP} "{meta["name"]}" already exists'
            )
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self.next_rv(),
            generation=1,
            creationTimestamp=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        obj = _canonical_quantities(obj)
        _stamp_taints(obj)
        self.objects[plural][key] = obj
        self._emit(plural, "ADDED", obj, None)
        return copy.deepcopy(obj)

    def update(
        self, plural: str, namespace: str, name: str, body: Any, subresource: str | None
    ) -> dict[str, Any]:
        kind = KINDS[plural]
        current = self._stored(plural, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", f"{kind.kind} body must be a JSON object")
        self._check_type(kind, body)
        meta = body.get("metadata") or {}
        if meta.get("name", name) != name:
            raise ApiError(
                400, "BadRequest", "the name of the object does not match the name on the URL"
            )
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and wanted_rv != current["metadata"]["resourceVersion"]:
            raise self._conflict(plural, name)
        if meta.get("uid") and meta["uid"] != current["metadata"]["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {current['metadata']['uid']}",
            )
        updated = copy.deepcopy(current)
        if subresource == "status":
            updated["status"] = copy.deepcopy(body.get("status"))
            if updated["status"] is None:
                updated.pop("status")
        else:
            for key in ("labels", "annotations", "ownerReferences", "finalizers"):
                if key in meta:
                    updated["metadata"][key] = copy.deepcopy(meta[key])
                else:
                    updated["metadata"].pop(key, None)
            if "spec" in body:
                updated["spec"] = copy.deepcopy(body["spec"])
            else:
                updated.pop("spec", None)
            if not kind.status_subresource:
                for key in set(body) - {"apiVersion", "kind", "metadata", "spec"}:
                    updated[key] = copy.deepcopy(body[key])
        updated = _canonical_quantities(updated)
        _stamp_taints(updated)
        for path in _IMMUTABLE[plural]:
            if _dig(updated, path) != _dig(current, path):
                raise ApiError(
                    422,
                    "Invalid",
                    f'{kind.kind}.{GROUP} "{name}" is invalid: {".".join(path)}: Invalid '
                    "value: field is immutable",
                )
        problems: list[str] = []
        _validate_meta(updated, problems)
        _VALIDATE[plural](updated, problems)
        if problems:
            raise ApiError(
                422, "Invalid", f'{kind.kind}.{GROUP} "{name}" is invalid: ' + "; ".join(problems)
            )
        if updated == current:
            return copy.deepcopy(current)  # a no-op write changes nothing, not even the RV
        if updated.get("spec") != current.get("spec"):
            updated["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        updated["metadata"]["resourceVersion"] = self.next_rv()
        self.objects[plural][(namespace, name)] = updated
        self._emit(plural, "MODIFIED", updated, current)
        return copy.deepcopy(updated)

    def patch(
        self,
        plural: str,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None,
    ) -> dict[str, Any]:
        current = self._stored(plural, namespace, name)
        if content_type in (STRATEGIC, MERGE):
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", f"{content_type} body must be a JSON object")
            wanted_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted_rv is not None and wanted_rv != current["metadata"]["resourceVersion"]:
                raise self._conflict(plural, name)
            updated = merge_patch(current, patch)
        elif content_type == JSON_PATCH:
            if not isinstance(patch, list):
                raise ApiError(400, "BadRequest", "json-patch body must be a JSON array")
            try:
                updated = json_patch(current, patch)
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise ApiError(422, "Invalid", f"json patch failed: {exc}") from exc
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                f"include: {JSON_PATCH}, {MERGE}, {STRATEGIC}; got {content_type!r}",
            )
        if (updated.get("metadata") or {}).get("uid", current["metadata"]["uid"]) != current[
            "metadata"
        ]["uid"]:
            raise ApiError(422, "Invalid", "metadata.uid: Invalid value: field is immutable")
        updated.setdefault("metadata", {})["resourceVersion"] = current["metadata"][
            "resourceVersion"
        ]
        return self.update(plural, namespace, name, updated, subresource)

    def delete(
        self, plural: str, namespace: str, name: str, options: Any = None
    ) -> dict[str, Any]:
        current = self._stored(plural, namespace, name)
        pre = (options or {}).get("preconditions") or {} if isinstance(options, dict) else {}
        if pre.get("resourceVersion") and pre["resourceVersion"] != current["metadata"][
            "resourceVersion"
        ]:
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                f"{current['metadata']['resourceVersion']}",
            )
        if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: "
                f"{current['metadata']['uid']}",
            )
        del self.objects[plural][(namespace, name)]
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = self.next_rv()
        self._emit(plural, "DELETED", gone, current)
        return gone

    def list_objects(
        self, plural: str, namespace: str | None, labels: Selector, fields: Selector
    ) -> dict[str, Any]:
        kind = KINDS[plural]
        items = []
        for obj in self.objects[plural].values():
            if self._matches(kind, obj, namespace, labels, fields):
                item = copy.deepcopy(obj)
                item.pop("apiVersion", None)  # list items carry no type, as on the real server
                item.pop("kind", None)
                items.append(item)
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return {
            "apiVersion": API_VERSION,
            "kind": kind.kind + "List",
            "metadata": {"resourceVersion": str(self.current_rv())},
            "items": items,
        }

    def delete_collection(
        self, plural: str, namespace: str | None, labels: Selector, fields: Selector
    ) -> dict[str, Any]:
        kind = KINDS[plural]
        doomed = [
            obj
            for obj in self.objects[plural].values()
            if self._matches(kind, obj, namespace, labels, fields)
        ]
        gone = [
            self.delete(plural, o["metadata"].get("namespace", ""), o["metadata"]["name"])
            for o in doomed
        ]
        return {
            "apiVersion": API_VERSION,
            "kind": kind.kind + "List",
            "metadata": {"resourceVersion": str(self.current_rv())},
            "items": gone,
        }

    # --- watch --------------------------------------------------------------------------

    def open_watch(
        self,
        plural: str,
        namespace: str | None,
        labels: Selector,
        fields: Selector,
        resource_version: str | None,
    ) -> tuple[_Watcher, list[dict[str, Any]]]:
        """Register a watcher and return the events it must see first (no await in between, so
        nothing is missed)."""
        kind = KINDS[plural]
        watcher = _Watcher(plural, namespace, labels, fields)
        backlog: list[dict[str, Any]] = []
        if resource_version in (None, "", "0"):
            for obj in self.objects[plural].values():
                if self._matches(kind, obj, namespace, labels, fields):
                    backlog.append({"type": "ADDED", "object": copy.deepcopy(obj)})
        else:
            try:
                since = int(resource_version)
            except ValueError as exc:
                raise ApiError(
                    400, "BadRequest", f"invalid resourceVersion {resource_version!r}"
                ) from exc
            if since < self.compacted_rv - 1:
                gone = ApiError(
                    410, "Expired", f"too old resource version: {since} ({self.compacted_rv})"
                )
                return watcher, [{"type": "ERROR", "object": gone.status()}]
            for event in self.history:
                if event.rv > since and event.plural == plural:
                    line = self._event_for(watcher, event)
                    if line is not None:
                        backlog.append(line)
        self.watchers.append(watcher)
        return watcher, backlog

    def close_watch(self, watcher: _Watcher) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def _event_for(self, watcher: _Watcher, event: WatchEvent) -> dict[str, Any] | None:
        kind = KINDS[event.plural]
        now = self._matches(kind, event.obj, watcher.namespace, watcher.labels, watcher.fields)
        before = event.old is not None and self._matches(
            kind, event.old, watcher.namespace, watcher.labels, watcher.fields
        )
        if event.type == "DELETED":
            return {"type": "DELETED", "object": copy.deepcopy(event.obj)} if before else None
        if now and not before:
            return {"type": "ADDED", "object": copy.deepcopy(event.obj)}
        if now:
            return {"type": "MODIFIED", "object": copy.deepcopy(event.obj)}
        if before:  # changed so that it no longer matches: the watcher sees it go
            return {"type": "DELETED", "object": copy.deepcopy(event.obj)}
        return None

    def _emit(
        self, plural: str, kind: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        event = WatchEvent(int(obj["metadata"]["resourceVersion"]), plural, kind, obj, old)
        self.history.append(event)
        for watcher in self.watchers:
            if watcher.plural == plural:
                line = self._event_for(watcher, event)
                if line is not None:
                    watcher.queue.put_nowait(line)

    # --- helpers ------------------------------------------------------------------------

    @staticmethod
    def _check_type(kind: Kind, body: dict[str, Any]) -> None:
        if body.get("apiVersion", API_VERSION) != API_VERSION or body.get(
            "kind", kind.kind
        ) != kind.kind:
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({body.get('apiVersion')}) or kind "
                f"({body.get('kind')}) does not match the expected {API_VERSION} {kind.kind}",
            )

    @staticmethod
    def _matches(
        kind: Kind,
        obj: dict[str, Any],
        namespace: str | None,
        labels: Selector,
        fields: Selector,
    ) -> bool:
        meta = obj.get("metadata") or {}
        if namespace is not None and meta.get("namespace", "") != namespace:
            return False
        obj_labels = meta.get("labels") or {}
        return labels.matches(obj_labels.get) and fields.matches(
            lambda key: kind.fields[key](obj)
        )

    @staticmethod
    def _conflict(plural: str, name: str) -> ApiError:
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {plural}.{GROUP} "{name}": the object has been '
            "modified; please apply your changes to the latest version and try again",
        )


# --- HTTP --------------------------------------------------------------------------------------


def add_routes(
    app: web.Application, store: ResourceStore, body_of: Callable[[web.Request], Any]
) -> None:
    """Serve the store at the real paths of `resource.k8s.io/v1`."""

    def answer(fn: Callable[[], dict[str, Any]], created: bool = False) -> web.Response:
        try:
            return web.json_response(fn(), status=201 if created else 200)
        except ApiError as exc:
            return web.json_response(exc.status(), status=exc.code)

    def where(request: web.Request) -> tuple[str, str, str]:
        plural = request.match_info["plural"]
        if plural not in KINDS:
            raise web.HTTPNotFound(text=f"the server could not find the resource {plural!r}")
        namespaced = "ns" in request.match_info
        listing_all = (
            KINDS[plural].namespaced
            and request.method == "GET"
            and "name" not in request.match_info
        )
        if namespaced != KINDS[plural].namespaced and not listing_all:
            raise web.HTTPNotFound(text=f"{plural} is not served at {request.path}")
        return plural, request.match_info.get("ns", ""), request.match_info.get("name", "")

    async def collection(request: web.Request) -> web.StreamResponse:
        plural, namespace, _ = where(request)
        scope = namespace if "ns" in request.match_info else None
        if request.method == "POST":
            return answer(lambda: store.create(plural, namespace, body_of(request)), True)
        try:
            labels = parse_label_selector(request.query.get("labelSelector"))
            fields = parse_field_selector(request.query.get("fieldSelector"), KINDS[plural])
        except ApiError as exc:
            return web.json_response(exc.status(), status=exc.code)
        if request.method == "DELETE":
            return answer(lambda: store.delete_collection(plural, scope, labels, fields))
        # the server parses booleans like Go's strconv.ParseBool; the client sends "True"
        if request.query.get("watch") in ("1", "t", "T", "true", "TRUE", "True"):
            return await _watch(request, store, plural, scope, labels, fields)
        return answer(lambda: store.list_objects(plural, scope, labels, fields))

    async def item(request: web.Request) -> web.StreamResponse:
        plural, namespace, name = where(request)
        sub = request.match_info.get("sub")
        if sub is not None and (sub != "status" or not KINDS[plural].status_subresource):
            return web.json_response(
                ApiError(404, "NotFound", f"no subresource {sub!r} on {plural}").status(),
                status=404,
            )
        if request.method == "GET":
            return answer(lambda: store.get(plural, name, namespace))
        if request.method == "PUT":
            return answer(lambda: store.update(plural, namespace, name, body_of(request), sub))
        if request.method == "PATCH":
            return answer(
                lambda: store.patch(
                    plural, namespace, name, request.content_type, body_of(request), sub
                )
            )
        return answer(lambda: store.delete(plural, namespace, name, body_of(request)))

    for base in (PREFIX, PREFIX + "/namespaces/{ns}"):
        app.router.add_route("*", base + "/{plural}", collection)
        app.router.add_route("*", base + "/{plural}/{name}", item)
        app.router.add_route("*", base + "/{plural}/{name}/{sub}", item)


async def _watch(
    request: web.Request,
    store: ResourceStore,
    plural: str,
    namespace: str | None,
    labels: Selector,
    fields: Selector,
) -> web.StreamResponse:
    try:
        watcher, backlog = store.open_watch(
            plural, namespace, labels, fields, request.query.get("resourceVersion")
        )
    except ApiError as exc:
        return web.json_response(exc.status(), status=exc.code)
    loop = asyncio.get_running_loop()
    timeout = request.query.get("timeoutSeconds")
    deadline = loop.time() + float(timeout) if timeout else None
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    try:
        await response.prepare(request)
        for line in backlog:
            await response.write(json.dumps(line).encode() + b"\n")
        if backlog and backlog[-1]["type"] == "ERROR":
            return response
        while True:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            try:
                next_line: dict[str, Any] | None = await asyncio.wait_for(
                    watcher.queue.get(), left
                )
            except TimeoutError:
                break
            if next_line is None:
                break
            await response.write(json.dumps(next_line).encode() + b"\n")
    except (ConnectionResetError, asyncio.CancelledError):
        store.close_watch(watcher)
        raise
    finally:
        store.close_watch(watcher)
    with contextlib.suppress(ConnectionError):  # the client went away first
        await response.write_eof()
    return response

"""A test allocator: does what kube-scheduler's DRA plugin does with structured parameters, so
tests can allocate claims from the ResourceSlices a driver published.

Rules followed (structured parameters, consumable capacity, device taints, prioritized list):
- pools: only the slices of a pool's highest `pool.generation` count; a pool with fewer slices at
  that generation than `resourceSliceCount` is incomplete and not used;
- node-local slices (`spec.nodeName`) only; all devices of one claim come from one node, written
  as `status.allocation.nodeSelector` (a `metadata.name In [node]` field term);
- a request (`exactly`, or the first `firstAvailable` subrequest that fits, recorded as
  `main/sub`) takes devices matching its DeviceClass's selectors and its own, distinct devices
  within one request, `count` of them (`ExactCount`, default 1) or every match (`All`);
- capacity: a requested amount is rounded up to the device's `requestPolicy` (`validValues`: the
  smallest valid value >= it; `validRange`: at least `min`, then up to `min + k*step`, never over
  `max`); a capacity not requested consumes the policy's `default`, or the whole capacity without
  a policy; a device lacking a requested capacity, or whose policy cannot fit the amount, is not
  eligible;
- sharing: a device with `allowMultipleAllocations` takes several allocations while, for every
  capacity, the sum consumed by all claims (this one included) stays <= its value; each such
  result carries `consumedCapacity` (every capacity, zeros included) and a fresh `shareID`; a
  device without it is allocated at most once in the cluster;
- taints: a device with a `NoSchedule` or `NoExecute` taint is not allocated unless the request
  tolerates it (key, operator `Equal`/`Exists`, value, effect; an empty effect matches all); the
  tolerations are copied into the result; effect `None` never blocks;
- config: the class's `config` (source `FromClass`, for the requests using the class) then the
  claim's (`FromClaim`), as the scheduler orders them.

Selectors are CEL in the real API; this allocator understands only these forms, joined by `&&`,
and refuses any other expression with `UnsupportedSelector` (never silently matching):
    device.driver == "gpu.vgpu.io"                      (and !=)
    device.attributes["gpu.vgpu.io"].productName == "A100"   (string, int or bool literal; !=)
    device.attributes["gpu.vgpu.io"]["index"] == 0
    device.capacity["gpu.vgpu.io"].memory.compareTo(quantity("10Gi")) >= 0   (>=, >, <=, <, ==)
    true
A selector naming an attribute or capacity the device lacks is a CEL runtime error, which fails
the allocation (as in the scheduler) rather than skipping the device.

Not done: `constraints` (matchAttribute), `adminAccess`, partitionable devices (counters),
`allNodes`/`nodeSelector` slices, binding conditions, scoring (the first fit wins, devices in
pool and name order).
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vgpu_agent.dra.quantity import Format, format_quantity, parse, parse_with_format

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


class AllocationError(Exception):
    """The claim cannot be allocated: the message says which request and why."""


class UnsupportedSelector(AllocationError):
    """A CEL expression outside the subset this allocator understands."""


# --- devices -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    driver: str
    pool: str
    node: str
    device: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.device["name"])

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    def attribute(self, domain: str, name: str) -> Any:
        attributes = self.device.get("attributes") or {}
        value = attributes.get(f"{domain}/{name}")
        if value is None and domain == self.driver:
            value = attributes.get(name)
        if value is None:
            raise AllocationError(
                f"CEL runtime error: device {self.name!r} has no attribute {domain}/{name}"
            )
        return next(iter(value.values()))

    def capacity(self, name: str) -> dict[str, Any] | None:
        """The capacity entry for a request key (`memory` or `gpu.vgpu.io/memory`)."""
        capacity = self.device.get("capacity") or {}
        if name in capacity:
            entry: dict[str, Any] = capacity[name]
            return entry
        domain, _, short = name.rpartition("/")
        if domain == self.driver and short in capacity:
            entry = capacity[short]
            return entry
        return None


def usable_devices(slices: Iterable[dict[str, Any]]) -> list[Candidate]:
    """Devices of complete pools at their newest generation, in pool and device name order."""
    pools: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for slice_ in slices:
        spec = slice_["spec"]
        pools.setdefault((spec["driver"], spec["pool"]["name"]), []).append(slice_)
    found = []
    for (driver, pool), members in sorted(pools.items()):
        newest = max(m["spec"]["pool"]["generation"] for m in members)
        current = [m for m in members if m["spec"]["pool"]["generation"] == newest]
        if len(current) < current[0]["spec"]["pool"]["resourceSliceCount"]:
            continue  # incomplete pool: the scheduler waits for the rest
        for member in current:
            node = member["spec"].get("nodeName")
            if not node:
                continue
            for device in member["spec"].get("devices") or []:
                found.append(Candidate(driver, pool, node, device))
    return sorted(found, key=lambda c: (c.driver, c.pool, c.name))


# --- selectors ---------------------------------------------------------------------------------

_LITERAL = r'("(?:[^"\\]|\\.)*"|-?\d+|true|false)'
_NAME = r'(?:\.([A-Za-z_][A-Za-z0-9_]*)|\["([^"]+)"\])'
_DRIVER = re.compile(r'^device\.driver\s*(==|!=)\s*"([^"]*)"$')
_ATTRIBUTE = re.compile(rf'^device\.attributes\["([^"]+)"\]{_NAME}\s*(==|!=)\s*{_LITERAL}$')
_CAPACITY = re.compile(
    rf'^device\.capacity\["([^"]+)"\]{_NAME}\.compareTo\(quantity\("([^"]+)"\)\)'
    r"\s*(>=|>|<=|<|==)\s*0$"
)


def _literal(text: str) -> Any:
    if text.startswith('"'):
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if text in ("true", "false"):
        return text == "true"
    return int(text)


def _split_and(expression: str) -> list[str]:
    parts, current, quoted = [], "", False
    i = 0
    while i < len(expression):
        char = expression[i]
        if char == '"' and (i == 0 or expression[i - 1] != "\\"):
            quoted = not quoted
        if not quoted and expression.startswith("&&", i):
            parts.append(current)
            current = ""
            i += 2
            continue
        current += char
        i += 1
    parts.append(current)
    return [p.strip() for p in parts]


def compile_selector(expression: str) -> Callable[[Candidate], bool]:
    """Turn a supported CEL expression into a predicate; UnsupportedSelector otherwise."""
    checks: list[Callable[[Candidate], bool]] = []
    for atom in _split_and(expression.strip()):
        while atom.startswith("(") and atom.endswith(")"):
            atom = atom[1:-1].strip()
        if atom == "true":
            continue
        if match := _DRIVER.match(atom):
            op, driver = match[1], match[2]

            def driver_check(c: Candidate, op: str = op, d: str = driver) -> bool:
                return (c.driver == d) == (op == "==")

            checks.append(driver_check)
            continue
        if match := _ATTRIBUTE.match(atom):
            domain, name, op, value = match[1], match[2] or match[3], match[4], _literal(match[5])

            def attribute_check(
                c: Candidate, domain: str = domain, name: str = name, op: str = op, v: Any = value
            ) -> bool:
                got = c.attribute(domain, name)
                equal = type(got) is type(v) and got == v
                return equal == (op == "==")

            checks.append(attribute_check)
            continue
        if match := _CAPACITY.match(atom):
            domain, name, amount, op = match[1], match[2] or match[3], parse(match[4]), match[5]

            def capacity_check(
                c: Candidate, domain: str = domain, name: str = name, op: str = op,
                amount: Fraction = amount,
            ) -> bool:
                entry = c.capacity(f"{domain}/{name}")
                if entry is None:
                    raise AllocationError(
                        f"CEL runtime error: device {c.name!r} has no capacity {domain}/{name}"
                    )
                have = parse(entry["value"])
                return {
                    ">=": have >= amount, ">": have > amount, "<=": have <= amount,
                    "<": have < amount, "==": have == amount,
                }[op]

            checks.append(capacity_check)
            continue
        raise UnsupportedSelector(
            f"selector {expression!r}: the test allocator does not understand {atom!r} "
            "(supported: device.driver ==/!=, device.attributes[...] ==/!= literal, "
            "device.capacity[...].compareTo(quantity(...)) <op> 0, joined by &&)"
        )
    return lambda candidate: all(check(candidate) for check in checks)


# --- capacity ----------------------------------------------------------------------------------


def consumed_amount(entry: dict[str, Any], requested: str | int | None) -> Fraction | None:
    """What a request consumes of one capacity, or None when the policy cannot fit it."""
    total = parse(entry["value"])
    policy = entry.get("requestPolicy")
    if requested is None:
        if policy is not None and policy.get("default") is not None:
            return parse(policy["default"])
        return total
    amount = parse(requested)
    if policy is not None and policy.get("validValues"):
        fits = [v for v in (parse(x) for x in policy["validValues"]) if v >= amount]
        amount_or_none = min(fits) if fits else None
        if amount_or_none is None:
            return None
        amount = amount_or_none
    elif policy is not None and policy.get("validRange"):
        valid = policy["validRange"]
        low = parse(valid["min"])
        if amount < low:
            amount = low
        if valid.get("step") is not None:
            step = parse(valid["step"])
            steps = -(-(amount - low) // step)  # ceil
            amount = low + steps * step
        if valid.get("max") is not None and amount > parse(valid["max"]):
            return None
    if amount > total:
        return None
    return amount


def _quantity_format(entry: dict[str, Any], requested: str | int | None) -> Format:
    source = requested
    if source is None:
        source = (entry.get("requestPolicy") or {}).get("default") or entry["value"]
    return parse_with_format(source)[1]


# --- taints ------------------------------------------------------------------------------------


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    operator = toleration.get("operator", "Equal")
    if operator == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get(
        "value", ""
    )


def blocking_taints(device: dict[str, Any], tolerations: list[dict[str, Any]]) -> list[str]:
    return [
        f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
        for t in device.get("taints") or []
        if t.get("effect") in BLOCKING_EFFECTS and not any(tolerates(x, t) for x in tolerations)
    ]


# --- the allocation ----------------------------------------------------------------------------


@dataclass
class _Usage:
    """What existing allocations already took: per device, per capacity name."""

    consumed: dict[tuple[str, str, str], dict[str, Fraction]] = field(default_factory=dict)
    exclusive: set[tuple[str, str, str]] = field(default_factory=set)
    taken: set[tuple[str, str, str]] = field(default_factory=set)

    def copy(self) -> _Usage:
        return _Usage(copy.deepcopy(self.consumed), set(self.exclusive), set(self.taken))


def _existing_usage(claims: Iterable[dict[str, Any]], skip_uid: str | None) -> _Usage:
    usage = _Usage()
    for claim in claims:
        if claim["metadata"].get("uid") == skip_uid:
            continue
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (result["driver"], result["pool"], result["device"])
            usage.taken.add(key)
            if result.get("consumedCapacity") is None:
                usage.exclusive.add(key)
                continue
            per = usage.consumed.setdefault(key, {})
            for name, amount in result["consumedCapacity"].items():
                per[name] = per.get(name, Fraction(0)) + parse(amount)
    return usage


@dataclass(frozen=True)
class _Request:
    name: str  # as written in results: "main" or "main/sub"
    class_name: str
    spec: dict[str, Any]


class Allocator:
    """Allocates one claim against the given slices, classes and already allocated claims."""

    def __init__(
        self,
        slices: Iterable[dict[str, Any]],
        device_classes: Iterable[dict[str, Any]],
        claims: Iterable[dict[str, Any]] = (),
        share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ):
        self.devices = usable_devices(slices)
        self.classes = {c["metadata"]["name"]: c for c in device_classes}
        self.claims = list(claims)
        self._share_id = share_id

    def allocate(self, claim: dict[str, Any], node: str | None = None) -> dict[str, Any]:
        """The `status.allocation` the scheduler would write, or AllocationError saying why."""
        spec = claim.get("spec") or {}
        devices_spec = spec.get("devices") or {}
        if devices_spec.get("constraints"):
            raise AllocationError("claim constraints are not supported by the test allocator")
        usage = _existing_usage(self.claims, claim["metadata"].get("uid"))
        nodes = sorted({c.node for c in self.devices}) if node is None else [node]
        reasons = []
        for candidate_node in nodes:
            try:
                results, used_classes = self._on_node(
                    devices_spec.get("requests") or [], candidate_node, usage.copy()
                )
            except UnsupportedSelector:
                raise
            except AllocationError as exc:
                reasons.append(f"node {candidate_node}: {exc}")
                continue
            return {
                "devices": {
                    "results": results,
                    "config": self._config(devices_spec, used_classes),
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In",
                                 "values": [candidate_node]}
                            ]
                        }
                    ]
                },
            }
        name = f"{claim['metadata'].get('namespace', '')}/{claim['metadata'].get('name')}"
        raise AllocationError(
            f"cannot allocate claim {name}: " + ("; ".join(reasons) or "no node has devices")
        )

    def _on_node(
        self, requests: list[dict[str, Any]], node: str, usage: _Usage
    ) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
        results: list[dict[str, Any]] = []
        used_classes: dict[str, list[str]] = {}
        for request in requests:
            if "exactly" in request:
                options = [_Request(request["name"], "", request["exactly"])]
            else:
                options = [
                    _Request(f"{request['name']}/{sub['name']}", "", sub)
                    for sub in request.get("firstAvailable") or []
                ]
            problems = []
            for option in options:
                option = _Request(option.name, option.spec.get("deviceClassName", ""), option.spec)
                trial = usage.copy()
                try:
                    chosen = self._pick(option, node, trial)
                except UnsupportedSelector:
                    raise
                except AllocationError as exc:
                    problems.append(str(exc))
                    continue
                results.extend(chosen)
                usage.consumed, usage.exclusive, usage.taken = (
                    trial.consumed, trial.exclusive, trial.taken
                )
                used_classes.setdefault(option.class_name, []).append(option.name)
                break
            else:
                raise AllocationError("; ".join(problems))
        return results, used_classes

    def _pick(self, request: _Request, node: str, usage: _Usage) -> list[dict[str, Any]]:
        spec = request.spec
        if spec.get("adminAccess"):
            raise AllocationError("adminAccess is not supported by the test allocator")
        device_class = self.classes.get(request.class_name)
        if device_class is None:
            raise AllocationError(
                f"request {request.name}: device class {request.class_name!r} does not exist"
            )
        selectors = [
            compile_selector(s["cel"]["expression"])
            for s in (device_class.get("spec") or {}).get("selectors") or []
        ] + [compile_selector(s["cel"]["expression"]) for s in spec.get("selectors") or []]
        wanted = (spec.get("capacity") or {}).get("requests") or {}
        tolerations = spec.get("tolerations") or []
        mode = spec.get("allocationMode", "ExactCount")
        count = spec.get("count", 1)
        chosen: list[dict[str, Any]] = []
        skipped: list[str] = []
        for candidate in self.devices:
            if candidate.node != node or not all(s(candidate) for s in selectors):
                continue
            if mode == "ExactCount" and len(chosen) == count:
                break
            why = self._take(candidate, request.name, wanted, tolerations, usage, chosen)
            if why:
                skipped.append(f"{candidate.name}: {why}")
        if (mode == "ExactCount" and len(chosen) < count) or not chosen:
            detail = "; ".join(skipped) or "no device matches the class and selectors"
            raise AllocationError(
                f"request {request.name}: {len(chosen)} of "
                f"{count if mode == 'ExactCount' else 'all'} devices ({detail})"
            )
        if mode == "All" and skipped:
            raise AllocationError(
                f"request {request.name}: allocationMode All but not every device fits "
                f"({'; '.join(skipped)})"
            )
        return chosen

    def _take(
        self,
        candidate: Candidate,
        request: str,
        wanted: dict[str, Any],
        tolerations: list[dict[str, Any]],
        usage: _Usage,
        chosen: list[dict[str, Any]],
    ) -> str:
        """Add the candidate to `chosen` and `usage` if it fits; otherwise say why not."""
        key = candidate.key
        if any((r["driver"], r["pool"], r["device"]) == key for r in chosen):
            return "already used by this request"
        taints = blocking_taints(candidate.device, tolerations)
        if taints:
            return f"tainted {', '.join(taints)}"
        shared = bool(candidate.device.get("allowMultipleAllocations"))
        if key in usage.exclusive or (not shared and key in usage.taken):
            return "already allocated"
        for name in wanted:
            if candidate.capacity(name) is None:
                return f"has no capacity {name}"
        result: dict[str, Any] = {
            "request": request,
            "driver": candidate.driver,
            "pool": candidate.pool,
            "device": candidate.name,
        }
        if tolerations:
            result["tolerations"] = copy.deepcopy(tolerations)
        if shared:
            consumed: dict[str, str] = {}
            used = usage.consumed.get(key, {})
            for name, entry in (candidate.device.get("capacity") or {}).items():
                asked = wanted.get(name, wanted.get(f"{candidate.driver}/{name}"))
                amount = consumed_amount(entry, asked)
                if amount is None:
                    return f"capacity {name}: {asked} does not fit its request policy"
                if used.get(name, Fraction(0)) + amount > parse(entry["value"]):
                    return (
                        f"capacity {name}: "
                        f"{format_quantity(amount, _quantity_format(entry, asked))}"
                        f" more would exceed {entry['value']} "
                        f"({format_quantity(used.get(name, Fraction(0)))} in use)"
                    )
                consumed[name] = format_quantity(amount, _quantity_format(entry, asked))
            per = usage.consumed.setdefault(key, {})
            for name, amount_text in consumed.items():
                per[name] = per.get(name, Fraction(0)) + parse(amount_text)
            result["consumedCapacity"] = consumed
            result["shareID"] = self._share_id()
        else:
            for name, asked in wanted.items():
                entry = candidate.capacity(name)
                assert entry is not None
                if parse(asked) > parse(entry["value"]):
                    return f"capacity {name}: {asked} is more than {entry['value']}"
            usage.exclusive.add(key)
        usage.taken.add(key)
        chosen.append(result)
        return ""

    def _config(
        self, devices_spec: dict[str, Any], used_classes: dict[str, list[str]]
    ) -> list[dict[str, Any]]:
        config = []
        for class_name, requests in used_classes.items():
            for entry in (self.classes[class_name].get("spec") or {}).get("config") or []:
                if "opaque" in entry:
                    config.append(
                        {"source": "FromClass", "requests": list(requests),
                         "opaque": copy.deepcopy(entry["opaque"])}
                    )
        for entry in devices_spec.get("config") or []:
            if "opaque" in entry:
                item: dict[str, Any] = {"source": "FromClaim",
                                        "opaque": copy.deepcopy(entry["opaque"])}
                if entry.get("requests"):
                    item["requests"] = list(entry["requests"])
                config.append(item)
        return config


def allocate_in(
    store: Any,
    namespace: str,
    name: str,
    node: str | None = None,
    share_id: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """Allocate a stored claim from the stored slices and classes and write its status, as the
    scheduler does (a claim already allocated is left as it is). Returns the stored claim."""
    claim = store.get("resourceclaims", name, namespace)
    if (claim.get("status") or {}).get("allocation"):
        return dict(claim)
    allocator = Allocator(
        store.items("resourceslices"),
        store.items("deviceclasses"),
        store.items("resourceclaims"),
        **({"share_id": share_id} if share_id else {}),
    )
    allocation = allocator.allocate(claim, node)
    claim.setdefault("status", {})["allocation"] = allocation
    updated: dict[str, Any] = store.update("resourceclaims", namespace, name, claim, "status")
    return updated

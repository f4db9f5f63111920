"""A pod's compute policy and priority, chosen by its annotations within the node's rules. Pure.

The annotations, read from the Pod object (the cluster decides who may write them; nothing inside
the container can change them):

    vgpu.io/core-policy               strict | work-conserving | off
    vgpu.io/priority                  an integer in PRIORITY_MIN..PRIORITY_MAX, larger first
    vgpu.io/core-policy.<container>   the same, for one container only (wins over the pod's)
    vgpu.io/priority.<container>

The node's rules (`PodPolicyRules`, from the agent's configuration) say which policies a pod may
choose, the highest priority a pod may take, and which namespaces may take priorities above the
node default. An annotation that is malformed or outside the rules is refused: the node default
applies to that field, and the refusal names the annotation and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from vgpu_agent.priorityrule import Overreach, overreach
from vgpu_agent.shm.api import CORE_POLICIES, CorePolicy

POLICY_ANNOTATION = "vgpu.io/core-policy"
PRIORITY_ANNOTATION = "vgpu.io/priority"
PRIORITY_MIN = -100
PRIORITY_MAX = 100
DEFAULT_PRIORITY = 0
# Pods may take these by default: `off` would let one pod escape throttling altogether.
DEFAULT_POD_POLICIES: tuple[CorePolicy, ...] = ("strict", "work-conserving")

Source = Literal["default", "pod"]
SOURCE_DEFAULT: Source = "default"
SOURCE_POD: Source = "pod"

_INTEGER = re.compile(r"^[+-]?[0-9]{1,6}$")
_SHOWN = 64  # characters of a refused value kept for messages (an annotation may be 256 KiB)


def _shown(raw: object) -> str:
    text = raw if isinstance(raw, str) else str(raw)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


@dataclass(frozen=True)
class PodPolicyRules:
    """What the node allows pods to choose, and what applies when they choose nothing."""

    default_policy: CorePolicy = "strict"
    allowed_policies: frozenset[CorePolicy] = frozenset(DEFAULT_POD_POLICIES)
    priority_max: int = PRIORITY_MAX
    # namespaces whose pods may take priorities above the default; empty: none may
    priority_namespaces: frozenset[str] = frozenset()
    default_priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        if self.default_policy not in CORE_POLICIES:
            raise ValueError(
                f"default policy {self.default_policy!r} is not allowed: one of {CORE_POLICIES}"
            )
        unknown = sorted(set(self.allowed_policies) - set(CORE_POLICIES))
        if unknown:
            raise ValueError(f"pod policies {unknown} are not allowed: a subset of {CORE_POLICIES}")
        for name in ("priority_max", "default_priority"):
            value = getattr(self, name)
            if not PRIORITY_MIN <= value <= PRIORITY_MAX:
                raise ValueError(
                    f"{name}={value!r} is not allowed: {PRIORITY_MIN}..{PRIORITY_MAX}"
                )


@dataclass(frozen=True)
class Refusal:
    """One annotation the node did not accept."""

    annotation: str
    value: str
    allowed: str  # what would have been accepted
    applied: str  # what applies instead

    @property
    def message(self) -> str:
        return (
            f"annotation {self.annotation}={self.value!r} refused: {self.allowed}; "
            f"the node default {self.applied} applies"
        )


@dataclass(frozen=True)
class PodPolicy:
    """What applies to one container, and whether the pod chose any of it."""

    policy: CorePolicy
    priority: int
    source: Source
    refusals: tuple[Refusal, ...] = ()


def node_default(rules: PodPolicyRules) -> PodPolicy:
    return PodPolicy(rules.default_policy, rules.default_priority, SOURCE_DEFAULT)


def _pick(annotations: Mapping[str, object], base: str, container: str) -> tuple[str, object]:
    """The most specific annotation present: per container, else per pod ('' when neither)."""
    specific = f"{base}.{container}"
    if specific in annotations:
        return specific, annotations[specific]
    if base in annotations:
        return base, annotations[base]
    return "", None


def _policy(
    key: str, raw: object, rules: PodPolicyRules
) -> tuple[CorePolicy | None, Refusal | None]:
    applied = f"policy {rules.default_policy!r}"
    allowed = sorted(rules.allowed_policies)
    if not isinstance(raw, str) or raw not in CORE_POLICIES:
        return None, Refusal(key, _shown(raw), f"allowed values are {', '.join(allowed)}", applied)
    if raw not in rules.allowed_policies:
        what = ", ".join(allowed) if allowed else "none (pods may not choose a policy here)"
        return None, Refusal(key, raw, f"this node lets pods choose {what}", applied)
    return raw, None


def _priority(
    key: str, raw: object, namespace: str, rules: PodPolicyRules
) -> tuple[int | None, Refusal | None]:
    applied = f"priority {rules.default_priority}"
    text = _shown(raw)
    if not isinstance(raw, str) or not _INTEGER.match(raw):
        return None, Refusal(
            key, text, f"an integer in {PRIORITY_MIN}..{PRIORITY_MAX} is expected", applied
        )
    value = int(raw, 10)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        return None, Refusal(
            key, text, f"priorities range over {PRIORITY_MIN}..{PRIORITY_MAX}", applied
        )
    broken = overreach(value, namespace, rules.priority_max, rules.priority_namespaces,
                       rules.default_priority)
    if broken is Overreach.ABOVE_MOST:
        return None, Refusal(
            key, text, f"this node lets pods take priorities up to {rules.priority_max}", applied
        )
    if broken is Overreach.OUTSIDE_NAMESPACES:
        where = ", ".join(sorted(rules.priority_namespaces)) or "no namespace"
        return None, Refusal(
            key,
            text,
            f"priorities above {rules.default_priority} are allowed only in {where} "
            f"(not {namespace!r})",
            applied,
        )
    return value, None


def resolve(
    annotations: Mapping[str, object], namespace: str, container: str, rules: PodPolicyRules
) -> PodPolicy:
    """The policy and priority of `container` of a pod in `namespace` with `annotations`.

    Each field is judged on its own: a refused priority leaves an accepted policy in force.
    The source is "pod" when at least one accepted annotation decided a value.
    """
    policy, priority = rules.default_policy, rules.default_priority
    refusals: list[Refusal] = []
    chosen = False
    key, raw = _pick(annotations, POLICY_ANNOTATION, container)
    if key:
        picked, refused = _policy(key, raw, rules)
        if picked is not None:
            policy, chosen = picked, True
        if refused is not None:
            refusals.append(refused)
    key, raw = _pick(annotations, PRIORITY_ANNOTATION, container)
    if key:
        number, refused = _priority(key, raw, namespace, rules)
        if number is not None:
            priority, chosen = number, True
        if refused is not None:
            refusals.append(refused)
    return PodPolicy(policy, priority, SOURCE_POD if chosen else SOURCE_DEFAULT, tuple(refusals))


def relevant(annotations: Mapping[str, object]) -> dict[str, str]:
    """The annotations this module reads (the rest of a pod's annotations is not kept)."""
    return {
        key: value if isinstance(value, str) else str(value)
        for key, value in annotations.items()
        if key.startswith((POLICY_ANNOTATION, PRIORITY_ANNOTATION))
    }


@dataclass(frozen=True)
class PodInfo:
    """What is kept of a Pod object: who it is and the annotations read here."""

    uid: str
    namespace: str
    name: str
    annotations: Mapping[str, str]

"""A lean text encoder for the agent's own gauge, counter and info families.

prometheus_client's encoders validate and escape every label of every sample again; with a
thousand samples per scrape that is about 20 ms of CPU, most of the scrape. Here the families a
scrape builds are `Family` objects: (label set, value) points without per-sample objects, whose
label sets are `Labels` carrying their escaped text. `LabelSets` keeps those label sets from one
scrape to the next, so a container's labels are escaped once while it exists, not once per
series per scrape; a sample line is then its name, the kept text and the formatted value. The
output is the same exposition; tests parse both with prometheus_client's own parsers and compare.

Both formats are written: Prometheus text 0.0.4 and OpenMetrics 1.0 (without the final
`# EOF`, which the caller appends after whatever else it adds). Sample lines are the same in
both; only the HELP/TYPE lines differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import lru_cache
from typing import Any, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

_LABEL_ESCAPES = str.maketrans({"\\": r"\\", "\n": r"\n", '"': r"\""})
_TEXT_HELP_ESCAPES = str.maketrans({"\\": r"\\", "\n": r"\n"})
_KINDS = ("gauge", "counter", "info")
_Group = TypeVar("_Group")


def format_value(value: float) -> str:
    kind = type(value)
    if kind is int:
        return str(value)
    if isinstance(value, int) and kind is not bool:  # an int subclass (IntEnum)
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def label_text(names: Sequence[str], values: Sequence[object]) -> str:
    """`{name="value",...}` with the values escaped; "" for no labels."""
    inner = ",".join(
        f'{k}="{str(v).translate(_LABEL_ESCAPES)}"' for k, v in zip(names, values, strict=True)
    )
    return "{" + inner + "}" if inner else ""


class Labels(dict[str, str]):
    """One label set with its exposition text rendered once. Shared by every family of one
    entity and, through `LabelSets`, from scrape to scrape: never modify one."""

    __slots__ = ("text",)

    def __init__(self, names: Sequence[str], values: Sequence[str]):
        super().__init__(zip(names, values, strict=True))
        self.text = label_text(names, values)


class LabelSets:
    """The label sets of recent scrapes, by (names, values), and groups of them by a key of
    the caller's.

    `get` returns the set kept from the previous scrape when there is one; `rotate`, at the start
    of each scrape, forgets the sets the previous scrape did not use, so a container that is gone
    takes its entry with it and the memory stays that of two scrapes. Each entry is a pure
    function of its key, so two renders sharing the object (they may run in two threads) can
    only make each other compute an entry again, never see a wrong one.
    """

    def __init__(self) -> None:
        # (names, values) -> Labels, and a group's key -> what its builder made
        self._kept: dict[Hashable, Any] = {}
        self._used: dict[Hashable, Any] = {}
        self.built = 0  # label sets rendered, cumulative (tests, benchmarks)

    def __len__(self) -> int:
        return len(self._used)

    def __contains__(self, key: object) -> bool:
        """Whether `(names, values)`, or a group's key, is held (used in this scrape or the one
        before)."""
        return key in self._used or key in self._kept

    def new(self, names: Sequence[str], values: Sequence[str]) -> Labels:
        """A label set rendered anew (`get`'s, or one a group's builder holds)."""
        self.built += 1
        return Labels(names, values)

    def get(self, names: tuple[str, ...], values: tuple[str, ...]) -> Labels:
        return self.group((names, values), self.new, names, values)

    def group(self, key: Hashable, build: Callable[..., _Group], *args: object) -> _Group:
        """What `build(*args)` returns, kept as a set is (`get` is a group of one set): several
        sets of one entity found with one lookup. `key` must determine everything `build` makes
        (it is the memo's only check) and must not be a (names, values) pair of tuples."""
        found = self._used.get(key)
        if found is None:
            found = self._kept.get(key)
            if found is None:
                found = build(*args)
            self._used[key] = found
        return found  # type: ignore[no-any-return]

    def rotate(self) -> None:
        self._kept, self._used = self._used, {}


class Family:
    """A gauge or counter family as a scrape builds it: `(labels, value)` points.

    `metric()` gives prometheus_client's form of the same family (the reference the lean
    encoder is tested against, and what anything taking `collect()` expects)."""

    __slots__ = ("documentation", "label_names", "name", "points", "sample_name", "type")

    def __init__(self, kind: str, name: str, documentation: str, label_names: Sequence[str]):
        if kind not in ("gauge", "counter"):
            raise ValueError(f"family {name} has type {kind!r}: a Family is a gauge or counter")
        self.type = kind
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(label_names)
        self.sample_name = name + "_total" if kind == "counter" else name
        self.points: list[tuple[Labels, float]] = []

    def metric(self) -> Metric:
        cls = CounterMetricFamily if self.type == "counter" else GaugeMetricFamily
        metric = cls(self.name, self.documentation, labels=list(self.label_names))
        metric.samples = [Sample(self.sample_name, dict(labels), value)
                          for labels, value in self.points]
        return metric


@lru_cache(maxsize=1024)
def _header(name: str, kind: str, documentation: str, openmetrics: bool) -> str:
    """The HELP and TYPE lines of one family (the agent's names and docs are constants)."""
    if openmetrics:
        meta_name, meta_type = name, kind
        help_text = documentation.translate(_LABEL_ESCAPES)
    else:
        suffix = {"counter": "_total", "info": "_info"}.get(kind, "")
        meta_name = name + suffix
        meta_type = "gauge" if kind == "info" else kind
        help_text = documentation.translate(_TEXT_HELP_ESCAPES)
    return f"# HELP {meta_name} {help_text}\n# TYPE {meta_name} {meta_type}"


def encode(families: Iterable[Metric | Family], openmetrics: bool = False) -> bytes:
    """`Family` objects and prometheus_client families of type gauge, counter or info;
    any other type raises ValueError."""
    lines: list[str] = []
    append = lines.append
    # prometheus_client families: keyed by the label dict's identity (families of one entity
    # share one dict), and every dict stays alive in `families` while this runs
    texts: dict[int, str] = {}
    for family in families:
        kind = family.type
        if kind not in _KINDS:
            raise ValueError(
                f"family {family.name} has type {kind!r}: this encoder writes gauge, counter, info"
            )
        append(_header(family.name, kind, family.documentation, openmetrics))
        if isinstance(family, Family):
            name = family.sample_name
            # most values are ints: formatted without format_value's checks
            lines += [
                f"{name}{labels.text} {value if type(value) is int else format_value(value)}"
                for labels, value in family.points
            ]
            continue
        for sample in family.samples:
            text = texts.get(id(sample.labels))
            if text is None:
                given = sample.labels
                text = texts[id(given)] = (
                    given.text if isinstance(given, Labels)
                    else label_text(tuple(given), tuple(given.values()))
                )
            append(f"{sample.name}{text} {format_value(sample.value)}")
    if not lines:
        return b""
    return ("\n".join(lines) + "\n").encode("utf-8")

"""Read a Prometheus exposition back into samples, for assertions in the metrics tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

SampleKey = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[SampleKey, float]:
    """{(sample name, frozenset of label pairs): value}; raises on a malformed exposition or a
    sample that appears twice (which Prometheus would reject)."""
    out: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            if key in out:
                raise AssertionError(f"duplicate sample {sample.name} {sample.labels}")
            out[key] = sample.value
    return out


def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of `name` as (labels, value), sorted by labels."""
    found = [(dict(labels), value) for (n, labels), value in samples(text).items() if n == name]
    return sorted(found, key=lambda item: sorted(item[0].items()))


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of `name` whose labels include `labels`; None if absent."""
    matches = [v for lab, v in series(text, name) if labels.items() <= lab.items()]
    if len(matches) > 1:
        raise AssertionError(f"{len(matches)} samples of {name} match {labels}")
    return matches[0] if matches else None


def names(text: str) -> set[str]:
    return {name for name, _ in samples(text)}

"""The lean encoder writes what prometheus_client's encoders write, in both formats."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from vgpu_agent.metrics.exposition import Family, LabelSets, encode, format_value


class View:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _parsed(text: str, openmetrics: bool) -> list[tuple[str, str, str, list[tuple[str, tuple, float]]]]:
    parse = om_parse if openmetrics else text_parse
    out = []
    for family in parse(text):
        samples = [
            # Prometheus keeps float64 values: compare what it would store
            (s.name, tuple(sorted(s.labels.items())),
             "nan" if math.isnan(s.value) else float(s.value))
            for s in family.samples
        ]
        out.append((family.name, family.type, family.documentation, samples))
    return out


def _families(values: list[tuple[str, float]], doc: str) -> list[Metric]:
    gauge = GaugeMetricFamily("vgpu_test_gauge", doc, labels=["namespace", "pod"])
    counter = CounterMetricFamily("vgpu_test_events", doc, labels=["pod"])
    for n, (label, value) in enumerate(values):
        gauge.add_metric([label, str(n)], value)
        counter.add_metric([f"{label}-{n}"], abs(value) if not math.isnan(value) else 0)
    info = InfoMetricFamily("vgpu_test_build", doc, labels=["node"])
    info.add_metric(["n\\1"], {"version": '1."0"'})
    return [gauge, counter, info]


label_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
numbers = st.one_of(
    st.integers(min_value=0, max_value=2**62),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(label_text, numbers), max_size=6, unique_by=lambda t: t[0]), label_text)
def test_same_exposition_as_prometheus_client(values: list[tuple[str, float]], doc: str) -> None:
    families = _families(values, doc)
    ours = encode(families, openmetrics=False).decode()
    theirs = text_latest(View(families)).decode()
    assert _parsed(ours, False) == _parsed(theirs, False)
    ours_om = encode(families, openmetrics=True).decode() + "# EOF\n"
    theirs_om = om_latest(View(families)).decode()
    assert _parsed(ours_om, True) == _parsed(theirs_om, True)


def test_counter_and_info_names_in_each_format() -> None:
    counter = CounterMetricFamily("vgpu_x", "Things.", labels=["k"])
    counter.add_metric(["a"], 3)
    text = encode([counter]).decode()
    assert text == '# HELP vgpu_x_total Things.\n# TYPE vgpu_x_total counter\nvgpu_x_total{k="a"} 3\n'
    om = encode([counter], openmetrics=True).decode()
    assert om == '# HELP vgpu_x Things.\n# TYPE vgpu_x counter\nvgpu_x_total{k="a"} 3\n'


def test_other_types_are_refused_by_name() -> None:
    histogram = HistogramMetricFamily("vgpu_h", "h", buckets=[("+Inf", 1)], sum_value=1)
    with pytest.raises(ValueError, match="vgpu_h has type 'histogram'"):
        encode([histogram])


@pytest.mark.parametrize(
    ("value", "text"),
    [(3, "3"), (2.0, "2"), (0.25, "0.25"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"),
     (float("nan"), "NaN"), (1e20, "1e+20"), (True, "1")],
)
def test_values(value: float, text: str) -> None:
    assert format_value(value) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(label_text, numbers), max_size=6, unique_by=lambda t: t[0]), label_text)
def test_lean_families_write_what_their_prometheus_form_writes(
    values: list[tuple[str, float]], doc: str
) -> None:
    sets = LabelSets()
    gauge = Family("gauge", "vgpu_test_gauge", doc, ("namespace", "pod"))
    counter = Family("counter", "vgpu_test_events", doc, ("pod",))
    for n, (label, value) in enumerate(values):
        gauge.points.append((sets.get(gauge.label_names, (label, str(n))), value))
        counter.points.append(
            (sets.get(counter.label_names, (f"{label}-{n}",)),
             abs(value) if not math.isnan(value) else 0)
        )
    lean = [gauge, counter]
    reference = [family.metric() for family in lean]
    assert _parsed(encode(lean).decode(), False) == _parsed(
        text_latest(View(reference)).decode(), False)
    ours_om = encode(lean, openmetrics=True).decode() + "# EOF\n"
    assert _parsed(ours_om, True) == _parsed(om_latest(View(reference)).decode(), True)


def test_a_lean_family_is_a_gauge_or_a_counter() -> None:
    with pytest.raises(ValueError, match="vgpu_i has type 'info'"):
        Family("info", "vgpu_i", "i", ())

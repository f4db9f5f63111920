"""Kubernetes quantities: exact parsing and the API server's canonical form."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vgpu_agent.dra.quantity import QuantityError, canonical, format_quantity, parse, same


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10Gi", 10 * 1024**3),
        ("1Mi", 1024**2),
        ("100", 100),
        (30, 30),
        ("500m", Fraction(1, 2)),
        ("1.5", Fraction(3, 2)),
        ("1e3", 1000),
        ("2k", 2000),
        ("-1Ki", -1024),
        (".5Gi", 512 * 1024**2),
    ],
)
def test_parse_is_exact(text: str | int, value: int | Fraction) -> None:
    assert parse(text) == value


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("1024Mi", "1Gi"),
        ("0.5Gi", "512Mi"),
        ("1536Mi", "1536Mi"),
        ("1000Mi", "1000Mi"),
        ("100000", "100k"),
        ("85899345920", "85899345920"),
        ("1000m", "1"),
        ("1.5", "1500m"),
        ("512", "512"),
        ("0", "0"),
        ("0Mi", "0"),
        ("100Ki", "100Ki"),
        ("1e3", "1e3"),
    ],
)
def test_canonical_form_matches_the_api_server(text: str, form: str) -> None:
    assert canonical(text) == form
    assert parse(form) == parse(text)


def test_formatting_bytes_in_binary_units() -> None:
    assert format_quantity(80 * 1024**3, "BinarySI") == "80Gi"
    assert format_quantity(1023, "BinarySI") == "1023"
    assert format_quantity(Fraction(1, 3)) == "333333334n"  # rounded up to nano units


@pytest.mark.parametrize("bad", ["", "ten", "10 Gi", "10GB", "1.2.3", "Gi", True, None, 1.5])
def test_bad_quantities_are_named(bad: object) -> None:
    with pytest.raises(QuantityError, match="quantity"):
        parse(bad)  # type: ignore[arg-type]


def test_same_compares_values() -> None:
    assert same("1Gi", "1024Mi") and same("30", 30) and not same("1Gi", "1G")

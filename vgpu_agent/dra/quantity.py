"""Kubernetes resource quantities ("10Gi", "500m", "100"): parse to exact numbers, format in the
API server's canonical form. Pure.

The API server stores a quantity in canonical form (`1024Mi` is read back as `1Gi`, `100000` as
`100k`), so anything that compares what it wrote with what it reads back compares values, or
canonical strings, never the strings it sent.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

Format = Literal["BinarySI", "DecimalSI", "DecimalExponent"]

_NUMBER = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([A-Za-z]*|[eE][+-]?[0-9]+)$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exp: suffix for suffix, exp in _DECIMAL.items()}
_BINARY_SUFFIX = {exp: suffix for suffix, exp in _BINARY.items()}


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


def parse(text: str | int) -> Fraction:
    """The exact value of a quantity such as `"10Gi"`, `"1.5"`, `"500m"`, `"1e3"` or `7`."""
    return parse_with_format(text)[0]


def parse_with_format(text: str | int) -> tuple[Fraction, Format]:
    if isinstance(text, bool):
        raise QuantityError(f"quantity must be a string or integer, got {text!r}")
    if isinstance(text, int):
        return Fraction(text), "DecimalSI"
    if not isinstance(text, str):
        raise QuantityError(f"quantity must be a string or integer, got {text!r}")
    match = _NUMBER.match(text.strip())
    if not match:
        raise QuantityError(
            f"quantity {text!r} is not a number with an optional suffix "
            "(Ki Mi Gi Ti Pi Ei, n u m k M G T P E, or an exponent like e3)"
        )
    number, suffix = Fraction(match[1]), match[2]
    if suffix in _BINARY:
        return number * 1024 ** _BINARY[suffix], "BinarySI"
    if suffix in _DECIMAL:
        return number * Fraction(10) ** _DECIMAL[suffix], "DecimalSI"
    if suffix[:1] in ("e", "E"):
        return number * Fraction(10) ** int(suffix[1:]), "DecimalExponent"
    raise QuantityError(f"quantity {text!r} has an unknown suffix {suffix!r}")


def canonical(text: str | int) -> str:
    """The form the API server stores `text` in."""
    return format_quantity(*parse_with_format(text))


def format_quantity(value: Fraction | int, fmt: Format = "DecimalSI") -> str:
    """Canonical text of `value`: binary suffixes for whole multiples of 1024 when `fmt` is
    BinarySI, otherwise the largest decimal suffix that keeps the mantissa whole (values are
    rounded up to nano units, as the API server does)."""
    value = Fraction(value)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if fmt == "BinarySI" and value.denominator == 1 and value >= 1024:
        whole, exp = int(value), 0
        while whole % 1024 == 0 and exp < 6:
            whole //= 1024
            exp += 1
        return f"{sign}{whole}{_BINARY_SUFFIX.get(exp, '')}"
    nanos = -(-value * 10**9 // 1)  # ceil
    if nanos == 0:
        return "0"
    exp = -9
    while nanos % 1000 == 0 and exp < 18:
        nanos //= 1000
        exp += 3
    if fmt == "DecimalExponent":
        return f"{sign}{nanos}" + (f"e{exp}" if exp else "")
    return f"{sign}{nanos}{_DECIMAL_SUFFIX[exp]}"


def same(a: str | int, b: str | int) -> bool:
    """Whether two quantities have the same value (`"1Gi"` and `"1024Mi"` do)."""
    return parse(a) == parse(b)

"""The one rule for the priorities a tenant may take for itself (annotations and claims)."""

from __future__ import annotations

import pytest

from vgpu_agent.priorityrule import Overreach, overreach


@pytest.mark.parametrize(
    ("value", "namespace", "expected"),
    [
        (-5, "team", None),  # lower than the default: anyone, anywhere
        (0, "team", None),  # the default itself
        (1, "team", Overreach.OUTSIDE_NAMESPACES),
        (1, "serving", None),
        (50, "serving", None),  # the most, in an allowed namespace
        (51, "serving", Overreach.ABOVE_MOST),
        (51, "team", Overreach.ABOVE_MOST),  # the larger breach is named
    ],
)
def test_the_rule(value, namespace, expected):
    assert overreach(value, namespace, most=50, namespaces={"serving"}) is expected


def test_a_default_above_zero_is_free_to_take_everywhere():
    assert overreach(10, "team", most=50, namespaces=(), default=10) is None
    assert overreach(11, "team", most=50, namespaces=(), default=10) is Overreach.OUTSIDE_NAMESPACES


def test_a_most_below_the_default_still_bounds():
    assert overreach(5, "serving", most=3, namespaces={"serving"}, default=10) is Overreach.ABOVE_MOST

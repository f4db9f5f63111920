"""Parsing the simulated inventory spec: valid forms, every kind of bad part, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_agent.gpu.simspec import MAX_GPUS, SimGpuSpec, parse_sim_spec


def test_parses_counts_models_and_memory():
    assert parse_sim_spec("2xA100-80GB,1xL4-24GB") == [
        SimGpuSpec(2, "A100", 80),
        SimGpuSpec(1, "L4", 24),
    ]


def test_count_defaults_to_one_and_models_may_contain_dashes():
    assert parse_sim_spec(" H100-SXM5-80GB ") == [SimGpuSpec(1, "H100-SXM5", 80)]


@pytest.mark.parametrize(
    ("spec", "bad_part"),
    [
        ("2xA100", "2xA100"),  # no memory
        ("A100-80", "A100-80"),  # no unit
        ("2xA100-80GB,,L4-24GB", "''"),  # empty entry
        ("-80GB", "-80GB"),  # no model
        ("2xA100-80TB", "2xA100-80TB"),
        ("A100-80GB;L4-24GB", "A100-80GB;L4-24GB"),
    ],
)
def test_bad_entries_are_named_with_the_expected_form(spec, bad_part):
    with pytest.raises(ValueError) as err:
        parse_sim_spec(spec)
    assert bad_part in str(err.value)
    assert "[<count>x]<model>-<memory>GB" in str(err.value)


@pytest.mark.parametrize(("spec", "what"), [("0xA100-80GB", "count"), ("A100-0GB", "memory")])
def test_zero_count_or_memory_is_rejected(spec, what):
    with pytest.raises(ValueError, match=f"{what} must be >= 1"):
        parse_sim_spec(spec)


def test_empty_spec_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        parse_sim_spec("  ")


def test_absurd_gpu_counts_are_rejected():
    with pytest.raises(ValueError, match=f"at most {MAX_GPUS}"):
        parse_sim_spec(f"{MAX_GPUS}xA100-80GB,1xL4-24GB")


models = st.from_regex(r"[A-Z][A-Za-z0-9]{0,6}(-[A-Za-z0-9]{1,5})?", fullmatch=True)
entries = st.builds(
    SimGpuSpec, count=st.integers(1, 8), model=models, memory_gib=st.integers(1, 1024)
)


@settings(deadline=None)  # timing varies on a loaded CI machine
@given(st.lists(entries, min_size=1, max_size=6))
def test_formatted_specs_parse_back(specs):
    text = ",".join(f"{s.count}x{s.model}-{s.memory_gib}GB" for s in specs)
    assert parse_sim_spec(text) == specs

"""The machine line the benches print: the CPU model, wherever /proc/cpuinfo says it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tests.bench import machine


def test_the_first_model_name_is_the_cpu(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
                    "\nprocessor\t: 1\nmodel name\t: Something Else\n")
    assert machine.cpu_model(str(info)) == "AMD EPYC 7B13"
    assert machine.describe(str(info)) == (
        f"{os.cpu_count()} CPUs, AMD EPYC 7B13, Python {platform.python_version()}")


def test_no_model_name_or_no_file_falls_back_to_the_architecture(tmp_path: Path) -> None:
    fallback = platform.processor() or platform.machine() or "unknown"
    arm = tmp_path / "cpuinfo"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nmodel name\t:   \n")  # empty: no model
    assert machine.cpu_model(str(arm)) == fallback
    assert machine.cpu_model(str(tmp_path / "absent")) == fallback

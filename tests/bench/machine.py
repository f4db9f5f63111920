"""The machine a bench ran on, as its first line says it.

This workplace's machines change between days (an AMD EPYC one day, an Intel Xeon the next, the
same 2 vCPUs), and their pace differs by half: a figure without the CPU model cannot be compared
with another day's.
"""

from __future__ import annotations

import os
import platform


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first `model name` in `cpuinfo`, or the architecture where none can be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                    if model:
                        return model
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def describe(cpuinfo: str = "/proc/cpuinfo") -> str:
    """'2 CPUs, AMD EPYC, Python 3.11.7': what a bench's result depends on."""
    return f"{os.cpu_count()} CPUs, {cpu_model(cpuinfo)}, Python {platform.python_version()}"

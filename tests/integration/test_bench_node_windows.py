"""`tests/bench/bench_node.py`: the whole agent's CPU window by window, beside another checkout.
Run small here (16 container-devices, one short window): what it prints, and what it refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "bench" / "bench_node.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_beside_a_baseline_prints_both_and_their_ratio():
    done = run("--devices", "16", "--changing", "--windows", "2", "--seconds", "1",
               "--settle", "1", "--rounds", "1", "--scrape-every", "0.5",
               "--baseline", str(ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "16 container-devices, per-process drivers, shares changing, a scrape every 0.5 s" \
        in out
    rows = re.findall(r"^round 1, (this tree|baseline): ([\d.]+), ([\d.]+) %$", out, re.M)
    assert [name for name, _, _ in rows] == ["this tree", "baseline"]
    # a busy agent's CPU, each window's own
    assert all(0 < float(v) < 200 for _, *values in rows for v in values)
    assert re.search(r"^this tree: median [\d.]+ %, min [\d.]+, max [\d.]+ \(2 windows\)$", out,
                     re.M)
    assert re.search(r"^ratio of the medians, this tree / baseline: x[\d.]+$", out, re.M)


@pytest.mark.parametrize(("args", "named"), [
    (("--windows", "0"), "--windows must be 1 or more, got 0"),
    (("--seconds", "0"), "--seconds must be a number of seconds > 0, got 0.0"),
    (("--settle", "nan"), "--settle must be a number of seconds >= 0, got nan"),
    (("--scrape-every", "-1"), "--scrape-every must be a number of seconds >= 0, got -1.0"),
    (("--baseline", "/nonexistent"), "--baseline '/nonexistent' is not a checkout of this"),
])
def test_bad_arguments_are_refused_by_name(args, named):
    done = run(*args)
    assert done.returncode == 2
    assert named in done.stderr

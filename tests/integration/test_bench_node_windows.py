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
    rows = re.findall(r"^round 1, (this tree|baseline): ([\d.]+), ([\d.]+) %; off their "
                      r"shares by ([\d.]+|-), ([\d.]+|-) points$", out, re.M)
    assert [row[0] for row in rows] == ["this tree", "baseline"]
    # a busy agent's CPU, each window's own
    assert all(0 < float(v) < 200 for row in rows for v in row[1:3])
    assert re.search(r"^this tree: median [\d.]+ %, min [\d.]+, max [\d.]+ \(2 windows\); "
                     r"off their shares by [\d.]+ points \(median of the windows\)$", out, re.M)
    assert re.search(r"^ratio of the medians, this tree / baseline: x[\d.]+$", out, re.M)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_containers_changing_phase_at_their_own_pace_are_measured_with_how_close_they_are_held():
    done = run("--devices", "16", "--phase-every", "3", "--windows", "1", "--seconds", "2",
               "--settle", "2", "--rounds", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "each container changing phase every 3 s, unscraped" in out
    found = re.search(r"^round 1, this tree: ([\d.]+) %; off their shares by ([\d.]+) points$",
                      out, re.M)
    assert found, out
    # two container-devices a GPU, a share of 50 points each: held within it (not exactly:
    # they change phase meanwhile)
    assert 0 < float(found[2]) < 50


@pytest.mark.parametrize(("args", "named"), [
    (("--changing", "--phase-every", "30"), "not allowed with argument"),
    (("--phase-every", "-1"), "--phase-every must be a number of seconds >= 0, got -1.0"),
    (("--windows", "0"), "--windows must be 1 or more, got 0"),
    (("--nvml-poll-periods", "0"), "--nvml-poll-periods must be 1 or more, got 0"),
    (("--seconds", "0"), "--seconds must be a number of seconds > 0, got 0.0"),
    (("--settle", "nan"), "--settle must be a number of seconds >= 0, got nan"),
    (("--scrape-every", "-1"), "--scrape-every must be a number of seconds >= 0, got -1.0"),
    (("--baseline", "/nonexistent"), "--baseline '/nonexistent' is not a checkout of this"),
])
def test_bad_arguments_are_refused_by_name(args, named):
    done = run(*args)
    assert done.returncode == 2
    assert named in done.stderr

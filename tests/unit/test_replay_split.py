"""`shim/tests/gpu/replay_split.py`: a traced run's splits fed again to today's split."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.scripts import load_script
from vgpu_agent.throttle.timesliced import TimeSlicedSplit

SCRIPT = Path(__file__).resolve().parents[2] / "shim" / "tests" / "gpu" / "replay_split.py"


def _script():
    return load_script(SCRIPT, "replay_split")


def _trace(path: Path, tamper: bool = False) -> list[float]:
    """A trace as `nvml_loop.py --trace` writes it: a's turn alone, then a and b sharing
    (NVML reads between the splits). With `tamper`, the shares written are not the split's.
    Returns a's shares as written."""
    rng, split, rows, written = random.Random(1), TimeSlicedSplit(), [], []
    for n in range(40):
        if n < 8:
            owners, busy, spent, solo = [["a"]], 20.0, {"a": 1000, "b": 0}, "a"
        else:
            owners = [[rng.choice("ab")]]
            busy, spent, solo = 99.0, {"a": rng.randint(900, 1100), "b": 1000}, ""
        rows.append({"t": 100.0 + n * 0.2, "since_us": 0, "samples": [[7, n, busy]]})
        shares = split.share(owners, busy, spent, 0.2, (), solo)
        if tamper:
            shares = {a: s + 1 for a, s in shares.items()}
        written.append(shares["a"])
        rows.append({"t": 100.0 + n * 0.2 + 0.01, "owners": owners, "busy": busy,
                     "spent": spent, "dt_s": 0.2, "untrusted": [], "solo": solo,
                     "shares": shares, "beyond_work": [], "margin": 1.05})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return written


def test_the_same_inputs_give_the_same_shares_and_a_difference_shows(tmp_path):
    script = _script()
    trace = tmp_path / "trace.jsonl"
    written = _trace(trace)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    replayed = list(script.replayed(rows))
    assert len(replayed) == 40  # the splits, not the reads
    assert [then["a"] for _, then, _, _ in replayed] == written
    assert all(then == pytest.approx(now) for _, then, now, _ in replayed)
    assert replayed[0][0] == pytest.approx(0.01)
    # a's turn gave it a figure: the reading and half a percent, at 5,000 tokens/s
    split = replayed[-1][3]
    figure, rate, _ = split.alone["a"]
    assert (figure * rate, rate) == pytest.approx((20.5, 5000))
    # shares that today's split would not give are told apart
    _trace(trace, tamper=True)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert all(then["a"] == pytest.approx(now["a"] + 1)
               for _, then, now, _ in script.replayed(rows))


def test_it_prints_then_and_now_every_so_often(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    _trace(trace)
    assert _script().main([str(trace), "--every", "2", "--from", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # 1.x, 3.x, 5.x, 7.x s
    assert all(" then " in ln and " now " in ln and "figures 20.5@5e+03" in ln for ln in lines)


def test_what_a_launch_costs_is_replayed_where_traced(tmp_path):
    # a's turn at four and five launches of 262,144 tokens a tick in turn: steady only by
    # what one launch costs, which the trace carries; a trace written before it did replays
    # as the split then ran (no figure from such a turn)
    rows = []
    for n in range(8):
        tokens = (4 + n % 2) * 262_144
        rows.append({"t": 100.0 + n * 0.1, "owners": [["a"]], "busy": 10.0,
                     "spent": {"a": tokens, "b": 0}, "dt_s": 0.1, "untrusted": [], "solo": "a",
                     "per_launch": {"a": 262_144.0}, "shares": {}, "beyond_work": [],
                     "margin": 1.02})
    split = list(_script().replayed(rows))[-1][3]
    assert "a" in split.measured()
    for row in rows:
        del row["per_launch"]
    split = list(_script().replayed(rows))[-1][3]
    assert "a" not in split.measured()

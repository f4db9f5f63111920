"""`tests/bench/children.run_child`: a bench's run on one checkout's code, in a child process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.children import run_child

SCRIPT = """
import json, sys
import marker  # from the checkout the child runs in, which comes first on the path
if marker.MODE == "fails":
    print("half a line", flush=True)
    sys.stderr.write("the child's own complaint\\n")
    sys.exit(3)
if marker.MODE != "silent":
    print("chatter before the result")
if marker.MODE == "ok":
    print(json.dumps({"tree": marker.NAME, "args": sys.argv[1:]}))
"""


def _run(root: Path, name: str, mode: str, args: list[str]) -> object:
    script = root / "bench_x.py"
    script.write_text(SCRIPT)
    tree = root / name
    tree.mkdir()
    (tree / "marker.py").write_text(f"NAME, MODE = {name!r}, {mode!r}\n")
    return run_child(str(script), tree, args, "the steady run")


def test_each_run_uses_its_trees_code_and_returns_the_last_lines_json(tmp_path):
    for name in ("this", "baseline"):
        got = _run(tmp_path, name, "ok", ["--seconds", "2"])
        assert got == {"tree": name, "args": ["--child", "--seconds", "2"]}


@pytest.mark.parametrize("mode, why", [
    ("fails", "exit status 3"),
    ("silent", "no result printed"),
    ("chatters", "its last line is no result: 'chatter before the result'"),
])
def test_a_child_without_a_result_stops_the_bench_naming_it(tmp_path, mode, why):
    with pytest.raises(SystemExit) as stopped:
        _run(tmp_path, "broken", mode, [])
    message = str(stopped.value)
    assert message.startswith(f"the steady run in {tmp_path / 'broken'} failed ({why})")
    assert ("the child's own complaint" in message) == (mode == "fails")

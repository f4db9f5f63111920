"""A bench's measurement in a child process, on one checkout's code.

The benches that take `--baseline DIR` run the same script against this tree and another,
alternating, so that both see the same machine: each run is the script itself with `--child`,
started in the checkout whose code it measures (that checkout first on the path), and printing
its result as JSON on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_child(script: str, tree: Path, args: Sequence[str], what: str) -> Any:
    """Runs `script` with `--child` and `args` in `tree`, with that tree's code first on the
    path, and returns the JSON its last line of output holds. A child that fails, or whose last
    line holds no result, stops the bench with `what`, the tree and the tail of its errors."""
    out = subprocess.run(
        [sys.executable, script, "--child", *args], cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
        check=False)
    lines = out.stdout.strip().splitlines()
    why = f"exit status {out.returncode}" if out.returncode else (
        "no result printed" if not lines else "")
    if not why:
        try:
            return json.loads(lines[-1])
        except ValueError:
            why = f"its last line is no result: {lines[-1][:200]!r}"
    raise SystemExit(f"{what} in {tree} failed ({why}):\n{out.stderr[-2000:]}")

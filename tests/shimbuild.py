"""`make` in the repository's shim directory, one at a time across test processes.

The suite runs in several worker processes (pytest-xdist, `scripts/test`), and three test files
build the same shim targets into `shim/build`: two makes at once would write the same files
together, and a test could load a half-written library. So every such make holds an exclusive
lock on a file beside the build first; the second finds its targets up to date. Builds of copies
elsewhere (an older shim checked out into a test's own directory) need no lock."""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1] / "shim"
BUILD = SHIM / "build"
LOCK = BUILD / ".make.lock"


def make(*targets: str, jobs: int = 1, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`make -j<jobs> -C shim <targets>` while no other test process makes there."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return subprocess.run(["make", f"-j{jobs}", "-C", str(SHIM), *targets],
                              capture_output=True, text=True, timeout=timeout, check=False)

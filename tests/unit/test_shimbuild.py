"""`tests/shimbuild.make`: makes in the repository's shim directory wait for one another, so
that parallel test workers never write the same build files at once."""

from __future__ import annotations

import fcntl
import shutil
import threading

import pytest

from tests import shimbuild

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def test_a_make_waits_while_another_holds_the_build():
    shimbuild.LOCK.parent.mkdir(parents=True, exist_ok=True)
    done: list[int] = []
    with shimbuild.LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another worker's make would
        # (`-n`: the commands printed, nothing built)
        maker = threading.Thread(target=lambda: done.append(shimbuild.make("-n").returncode))
        maker.start()
        maker.join(0.5)
        assert maker.is_alive() and not done  # waiting on the lock
    maker.join(30)
    assert done == [0]

"""The steering's common path in C under AddressSanitizer and UBSan: it runs inside the agent's
process, on references it borrows from the controller's objects, where a reference dropped once
too often or a stray write would corrupt the agent rather than fail a call.

`_steerc.c` is compiled here with both sanitizers (`tests/sanitized.py`) and loaded into a
Python preloaded with the ASan runtime, in place of the built module; the child steers twin
controllers through hostile random ticks (`test_controller_native_steering.hostile_run`), each
compared with the Python reference after every tick.
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests import sanitized

SOURCE = sanitized.REPO / "vgpu_agent" / "throttle" / "_steerc.c"

CHILD = textwrap.dedent("""
    module = load("vgpu_agent.throttle._steerc", sys.argv[1])
    import gc
    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    from vgpu_agent.throttle import controller
    assert controller._steerc is module and controller.NATIVE_STEERING
    from tests.integration.test_controller_native_steering import hostile_run
    compared = handed = 0
    for seed in range(8):
        ticks, calls = hostile_run(seed, 100)
        compared, handed = compared + ticks, handed + calls["_observe"]
        gc.collect()  # what was freed too early is used here at the latest
    print("compared", compared, "handed", handed)
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_steering_in_c_is_clean_under_asan_and_ubsan(tmp_path):
    built = sanitized.build(SOURCE, tmp_path, "-ffp-contract=off")
    out = sanitized.run(CHILD, str(built), cwd=tmp_path)
    words = out.split()
    compared, handed = int(words[words.index("compared") + 1]), int(words[-1])
    assert compared > 2000 and handed < compared, out

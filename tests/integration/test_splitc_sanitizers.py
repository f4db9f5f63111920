"""The time-sliced split's loops in C under AddressSanitizer and UBSan: they write into the
split's own dicts, inside the agent's process, where a reference dropped once too often or a
stray write would corrupt the agent rather than fail a call.

`_splitc.c` is compiled here with both sanitizers (`tests/sanitized.py`) and loaded into a
Python preloaded with the ASan runtime, in place of the built module; the child compares each
loop with its Python reference on seeded random inputs
(`test_throttle_splitc_agreement.agree_on_random_cases`), then on what it declines.
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests import sanitized

SOURCE = sanitized.REPO / "vgpu_agent" / "throttle" / "_splitc.c"

CHILD = textwrap.dedent("""
    module = load("vgpu_agent.throttle._splitc", sys.argv[1])
    import gc
    from vgpu_agent.throttle import timesliced
    assert timesliced._splitc is module and timesliced.NATIVE_SPLIT
    from tests.unit.test_throttle_splitc_agreement import agree_on_random_cases
    computed = {"learn": 0, "watch": 0, "age": 0}
    for seed in range(6):
        for name, count in agree_on_random_cases(seed, 300).items():
            computed[name] += count
        gc.collect()  # what was freed too early is used here at the latest
    # declined: written nothing, freed everything
    assert module.learn({"a": (0, 4.0)}, {"a": 1.0, "b": 0.0}, ["a"], 0.5, 2.0) is None
    assert module.watch({"a": [1.0, 0.0]}, {"a": 0.5, "b": 0.5}, ["a"], 3.0, 1.1, 1e-3, 6.0) is None
    assert module.age({"a": (0.5, 0.5, 3.0)}, {}, [["a"]], {"a": 1}, 1, 100) is None
    print("computed", computed["learn"], computed["watch"], computed["age"])
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_splits_loops_in_c_are_clean_under_asan_and_ubsan(tmp_path):
    built = sanitized.build(SOURCE, tmp_path, "-ffp-contract=off")
    out = sanitized.run(CHILD, str(built), cwd=tmp_path)
    words = out.split()
    learned, watched, aged = (int(w) for w in words[words.index("computed") + 1:][:3])
    assert learned > 1600 and watched == aged == 1800, out

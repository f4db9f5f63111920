"""The optional C extensions: loaded where built and accepted, the Python reference otherwise,
with the reason kept (`vgpu_agent.native`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu_agent import native

REPO = Path(__file__).resolve().parents[2]


def test_an_extension_not_built_is_named_with_the_likely_cause():
    module, reason = native.load("vgpu_agent.no_such_extension")
    assert module is None
    assert reason == "vgpu_agent.no_such_extension was not built (no C compiler at install)"


@pytest.mark.parametrize(("source", "said"), [
    # a shared object the loader refuses (what the loader says, whatever it is)
    ('raise ImportError("undefined symbol: PyUnicode_New")', "undefined symbol: PyUnicode_New"),
    # one that needs a module that is missing: that module is named, not the extension
    ("import vgpu_agent_missing_dependency", "No module named 'vgpu_agent_missing_dependency'"),
])
def test_a_build_that_does_not_load_is_not_called_unbuilt(tmp_path, monkeypatch, source,
                                                           said):
    (tmp_path / "vgpu_broken_extension.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, reason = native.load("vgpu_broken_extension")
    assert module is None
    assert reason == f"vgpu_broken_extension was built but does not load: {said}"
    sys.modules.pop("vgpu_broken_extension", None)


def test_a_build_its_bind_refuses_is_not_used_and_the_refusal_is_the_reason():
    seen = []

    def refuse(module):
        seen.append(module)
        return "built for another layout: header size 1088, this one has 1096"

    module, reason = native.load("json", refuse)
    assert module is None
    assert reason == "built for another layout: header size 1088, this one has 1096"
    assert seen == [json]


def test_a_build_its_bind_accepts_is_the_module_itself():
    assert native.load("json", lambda module: None) == (json, None)
    assert native.load("json") == (json, None)


def test_an_error_other_than_a_missing_module_is_not_taken_for_one():
    def broken(module):
        raise RuntimeError("bind crashed")

    with pytest.raises(RuntimeError, match="bind crashed"):
        native.load("json", broken)


# (extension, the module that loads it, its flag, its reason)
EXTENSIONS = [
    ("vgpu_agent.shm._statec", "vgpu_agent.shm.headerread", "NATIVE_READ",
     "NOT_NATIVE_READ_REASON"),
    ("vgpu_agent.shm._usagec", "vgpu_agent.shm.usageread", "NATIVE_USAGE",
     "NOT_NATIVE_USAGE_REASON"),
    ("vgpu_agent.throttle._lawc", "vgpu_agent.throttle.nativelaw", "NATIVE",
     "NOT_NATIVE_REASON"),
    ("vgpu_agent.throttle._steerc", "vgpu_agent.throttle.controller", "NATIVE_STEERING",
     "NOT_NATIVE_STEERING_REASON"),
    ("vgpu_agent.throttle._splitc", "vgpu_agent.throttle.timesliced", "NATIVE_SPLIT",
     "NOT_NATIVE_SPLIT_REASON"),
]


@pytest.mark.parametrize(("extension", "loader", "flag", "reason"), EXTENSIONS,
                         ids=[row[0].rsplit(".", 1)[1] for row in EXTENSIONS])
def test_each_module_falls_back_to_python_where_its_extension_is_missing(
        extension, loader, flag, reason):
    # a fresh interpreter in which the extension cannot be imported, as on a node whose
    # image was built without a C compiler
    code = (
        "import importlib, json, sys\n"
        f"sys.modules[{extension!r}] = None\n"
        f"module = importlib.import_module({loader!r})\n"
        f"print(json.dumps([getattr(module, {flag!r}), getattr(module, {reason!r})]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == [
        False, f"{extension} was not built (no C compiler at install)"]

"""The agent's C extensions under AddressSanitizer and UBSan, for the tests that run them so.

An extension runs inside the agent's process, where a stray write or an undefined shift would
corrupt the agent rather than fail a call. `build` compiles one source with both sanitizers
(UBSan aborting on the first error), and `run` starts a Python preloaded with the ASan runtime
whose code (`LOADER` first) loads that build in place of the installed module.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# Prepended to a child's code: `load(name, path)` imports the build at `path` as module `name`.
LOADER = textwrap.dedent("""
    import importlib.machinery, importlib.util, sys

    def load(name, path):
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        return module
""")


def asan_runtime() -> str:
    """gcc's ASan runtime; the test is skipped where gcc has none."""
    found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                           text=True).stdout.strip()
    if not (os.path.isabs(found) and os.path.exists(found)):
        pytest.skip("gcc has no AddressSanitizer runtime here")
    return found


def build(source: Path, out_dir: Path, *flags: str) -> Path:
    """`source` compiled with both sanitizers as an extension in `out_dir`."""
    built = out_dir / (source.stem + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(
        ["gcc", "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer", *flags,
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-Wall", "-Wextra",
         "-Werror", "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", str(source),
         "-o", str(built)],
        check=True, capture_output=True, text=True)
    return built


def run(code: str, *args: str, cwd: Path) -> str:
    """Run `LOADER` + `code` with `args` under the sanitizers; its stdout, once it passed."""
    env = {**os.environ, "LD_PRELOAD": asan_runtime(), "PYTHONPATH": str(REPO),
           # Python's own allocations are not ours to judge; errors in ours abort
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PYTHONMALLOC": "malloc"}
    child = subprocess.run([sys.executable, "-c", LOADER + code, *args], env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    assert "runtime error" not in child.stderr and "AddressSanitizer" not in child.stderr
    return child.stdout


def fresh_copy(module: Any) -> Any:
    """Another module object from `module`'s built file, its own `bind` not yet called (its C
    state is the process's one copy all the same); skipped where nothing was built."""
    if module is None:
        pytest.skip("the C part was not built")
    loader = importlib.machinery.ExtensionFileLoader(module.__name__, module.__file__)
    spec = importlib.util.spec_from_file_location(module.__name__, module.__file__, loader=loader)
    assert spec is not None
    copy = importlib.util.module_from_spec(spec)
    loader.exec_module(copy)
    return copy

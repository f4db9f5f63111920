"""What the agent costs before it has work: modules it must not import at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        check=True, capture_output=True, text=True, env=env, timeout=60,
    ).stdout
    return set(out.split())


def test_the_agent_and_its_command_line_do_not_import_the_kubernetes_client():
    loaded = _modules_after("import vgpu_agent.agent, vgpu_agent.cli")
    assert "vgpu_agent.agent" in loaded
    assert not {m for m in loaded if m.startswith("kubernetes_asyncio")}
    assert "vgpu_agent.kube.node" not in loaded


def test_the_node_integration_still_brings_it_when_imported():
    loaded = _modules_after("import vgpu_agent.kube.node")
    assert "kubernetes_asyncio" in loaded


def test_the_agent_does_not_import_rich_in_either_log_format():
    for log_format in ("json", "console"):
        loaded = _modules_after(
            "import vgpu_agent.cli\n"
            "from vgpu_agent.logging import configure\n"
            f"configure({log_format!r})\n"
            "import vgpu_agent.agent\n"
        )
        assert "structlog" in loaded and "vgpu_agent.agent" in loaded
        assert not {m for m in loaded if m == "rich" or m.startswith("rich.")}, log_format


def test_console_logs_still_carry_tracebacks_and_rich_imports_afterwards():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (
        "import io, structlog\n"
        "from vgpu_agent.logging import configure\n"
        "out = io.StringIO()\n"
        "configure('console', stream=out)\n"
        "try:\n"
        "    raise KeyError('the-bad-key')\n"
        "except KeyError:\n"
        "    structlog.get_logger().exception('went_wrong')\n"
        "import rich.console\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, env=env, timeout=60)
    assert "went_wrong" in done.stdout
    assert "Traceback" in done.stdout and "the-bad-key" in done.stdout

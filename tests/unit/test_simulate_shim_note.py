"""`vgpu-agent simulate` says why the agent will warn that no shim is installed."""

from __future__ import annotations

import types
from pathlib import Path

from structlog.testing import capture_logs

from vgpu_agent.shm.regions import SHIM_FILE
from vgpu_agent.simulate import _say_who_plays_the_shim


def _agent(shim_dir: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(regions=types.SimpleNamespace(shim_dir=shim_dir))


def test_without_an_installed_shim_the_demo_says_it_plays_the_shim(tmp_path: Path) -> None:
    with capture_logs() as logs:
        _say_who_plays_the_shim(_agent(tmp_path))  # type: ignore[arg-type]
    (said,) = logs
    assert said["event"] == "sim_shim_played_by_the_demo"
    assert said["missing"] == str(tmp_path / SHIM_FILE)
    assert "shim_not_installed" in said["why"]


def test_with_an_installed_shim_nothing_is_said(tmp_path: Path) -> None:
    (tmp_path / SHIM_FILE).write_bytes(b"\x7fELF")
    with capture_logs() as logs:
        _say_who_plays_the_shim(_agent(tmp_path))  # type: ignore[arg-type]
    assert logs == []

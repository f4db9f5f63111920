"""What `vgpu-agent run` imports before it registers: not the metrics server's libraries, not the
Kubernetes client, not yaml (no config file). Checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LATER = ["aiohttp", "prometheus_client", "kubernetes_asyncio", "yaml", "vgpu_agent.metrics.http",
         "vgpu_agent.kube.pods", "vgpu_agent.kube.node", "vgpu_agent.kube.events",
         "vgpu_agent.dra.grant"]


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_agent_module_leaves_the_heavy_imports_for_later():
    loaded = loaded_after("import vgpu_agent.cli, vgpu_agent.logging, vgpu_agent.agent")
    assert "vgpu_agent.agent" in loaded and "grpc" in loaded  # the probe itself works
    assert loaded.isdisjoint(LATER), sorted(loaded & set(LATER))


def test_a_config_from_flags_and_env_does_not_import_yaml():
    loaded = loaded_after(
        "from vgpu_agent.config import ConfigSources, build_config\n"
        "build_config(ConfigSources(env={'VGPU_AGENT_SPLIT_COUNT': '4'}, flags={'backend': 'sim'}))"
    )
    assert "yaml" not in loaded


def test_a_config_file_still_parses():
    loaded = loaded_after(
        "from vgpu_agent.config import ConfigSources, build_config\n"
        "c = build_config(ConfigSources(file_text='split_count: 7\\n'))\n"
        "assert c.split_count == 7, c.split_count"
    )
    assert "yaml" in loaded

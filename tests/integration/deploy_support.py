"""Rendering and validating the deploy/ kustomizations with the real tools, for the deploy tests.

kubectl and cel-python come from `scripts/install-tools` (build/tools/); kubernetes-validate and
hadolint from the test extra. A missing tool is a test failure that says how to install it.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBECTL = REPO / "build" / "tools" / "kubectl" / "bin" / "kubectl"
CEL_PATH = REPO / "build" / "tools" / "cel"
# kubernetes-validate ships offline schemas for these exact versions (checked in the tests).
KUBE_VERSIONS = ("1.30.0", "1.37.0")
# DRA variants (a path part `dra` or `dra-...`) need resource.k8s.io/v1, GA in 1.34; consumable
# capacity, the extended-resource mapping and device taints are on by default from 1.36.
DRA_KUBE_VERSIONS = ("1.34.0", "1.36.0")


def versions_for(variant: str) -> tuple[str, ...]:
    """The Kubernetes versions a variant is validated against."""
    dra = any(part == "dra" or part.startswith("dra-") for part in variant.split("/"))
    return DRA_KUBE_VERSIONS if dra else KUBE_VERSIONS


def tool(name: str) -> str:
    if name == "kubectl":
        if not KUBECTL.is_file():
            raise AssertionError(f"kubectl missing at {KUBECTL}: run scripts/install-tools")
        return str(KUBECTL)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} not on PATH: run pip install -e '.[test]'")
    return found


def kustomizations() -> dict[str, str]:
    """Every kustomization under deploy/, by path relative to deploy/, mapped to its kind."""
    found = {}
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        data = yaml.safe_load(path.read_text())
        found[str(path.parent.relative_to(DEPLOY))] = data.get("kind", "Kustomization")
    return found


def variants() -> list[str]:
    """The renderable kustomizations (components only render as part of an overlay)."""
    return [path for path, kind in kustomizations().items() if kind != "Component"]


@functools.cache
def render_text(variant: str) -> str:
    proc = subprocess.run(
        [tool("kubectl"), "kustomize", str(DEPLOY / variant)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize deploy/{variant} failed:\n{proc.stderr}")
    return proc.stdout


def render(variant: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(variant)) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def validate_files(paths: list[Path], version: str) -> dict[Path, list[str]]:
    """Run `kubernetes-validate --strict` once over all paths; for each path, the output lines
    about it that are not a pass (an empty list: every resource in the file passed)."""
    proc = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", version, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    report: dict[Path, list[str]] = {path: [] for path in paths}
    passed: set[Path] = set()
    for line in lines:
        path = next((p for p in paths if f" {p} " in f"{line} "), None)
        if path is None:
            if line.strip():
                raise AssertionError(f"kubernetes-validate said something unexpected: {line}")
            continue
        if " passed for resource " in line:
            passed.add(path)
        else:
            report[path].append(line)
    for path in paths:
        if path not in passed and not report[path]:
            report[path].append(f"{path}: no resource was validated (exit {proc.returncode})")
    return report

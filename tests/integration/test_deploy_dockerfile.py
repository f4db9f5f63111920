"""The Dockerfile: hadolint-clean, multi-stage, pinned, non-root, no build tools in the final
stage, and consistent with the installer, the config and the build context it is given.

No container engine runs here, so the image is checked by its structure, by building the wheel
its `wheels` stage builds, and by evaluating .dockerignore against the paths it copies."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.deploy_support import REPO, one, render, tool
from vgpu_agent import shiminstall
from vgpu_agent.config import Config

DOCKERFILE = REPO / "Dockerfile"
BUILD_TOOLS = re.compile(r"\b(apt-get|apk|yum|dnf|gcc|g\+\+|cc|make|build-essential)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]


def parse(text: str) -> list[Stage]:
    """Instructions per stage: continuation lines joined, comments and directives dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif keyword != "ARG" or stages:
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def in_build_context(path: str, dockerignore: str) -> bool:
    """Docker's rule: the last matching pattern decides; a pattern matches a path or a parent."""
    rules = []
    for raw in dockerignore.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, _ignore_regex(line.lstrip("!").strip("/"))))
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for negated, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            included = negated
    return included


STAGES = parse(DOCKERFILE.read_text())
FINAL = STAGES[-1]


def test_hadolint_is_clean() -> None:
    proc = subprocess.run(
        [tool("hadolint"), "--format", "tty", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_does_report_problems() -> None:
    """The lint step can fail: an unpinned base and a root user are reported."""
    bad = "FROM python:latest\nUSER root\nRUN apt-get install gcc\n"
    proc = subprocess.run(
        [tool("hadolint"), "-f", "json", "-"], input=bad, capture_output=True, text=True
    )
    codes = {finding["code"] for finding in json.loads(proc.stdout)}
    assert {"DL3007", "DL3002", "DL3008"} <= codes and proc.returncode != 0


def test_multi_stage_with_every_base_pinned() -> None:
    names = [s.name for s in STAGES]
    assert len(STAGES) >= 3 and {"shim", "wheels"} <= set(names)
    for stage in STAGES:
        if stage.base in names:
            continue
        _image, _, tag = stage.base.partition(":")
        assert "@sha256:" in stage.base or (
            tag and tag != "latest" and re.search(r"\d", tag)
        ), f"base image {stage.base} is not pinned to a digest or an exact version tag"


def test_final_stage_has_no_build_tools_and_no_sources() -> None:
    for run in FINAL.all("RUN"):
        command = run.split("pip install", 1)[0]
        assert not BUILD_TOOLS.search(command), f"build tool in the final stage: {run}"
    copies = FINAL.all("COPY")
    for copy in copies:
        if "--from=" not in copy:
            assert "vgpu_agent" not in copy and "shim/" not in copy.split()[0], copy
    (install,) = [run for run in FINAL.all("RUN") if "pip install" in run]
    assert "--no-index" in install and "--mount=type=bind,from=wheels" in install
    assert "pip uninstall" in install


def test_entrypoint_is_vgpu_agent_run_and_the_script_exists() -> None:
    (entrypoint,) = FINAL.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["vgpu-agent", "run"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vgpu-agent"] == "vgpu_agent.cli:main"
    (cmd,) = FINAL.all("CMD")
    daemonset = one(render("base"), "DaemonSet", "vgpu-agent")
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert json.loads(cmd) == agent["args"]


def test_runs_as_a_non_root_user_by_default() -> None:
    (user,) = FINAL.all("USER")
    uid = user.split(":")[0]
    assert uid not in ("0", "root") and uid.isdigit(), user


def test_shim_and_config_land_where_installer_and_daemonset_look() -> None:
    copies = [c.split() for c in FINAL.all("COPY")]
    shim = next(c for c in copies if c[0] == "--from=shim")
    assert shim[1].endswith("/shim/build/libvgpu.so")
    assert Path(shim[2]) == shiminstall.DEFAULT_SOURCE / shiminstall.SHIM_NAME
    config = next(c for c in copies if c[0] == "deploy/base/config.yaml")
    daemonset = one(render("base"), "DaemonSet", "vgpu-agent")
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert config[1] == args[args.index("--config") + 1]
    (exposed,) = FINAL.all("EXPOSE")
    assert int(exposed) == Config().metrics_host_port()[1]


def test_shim_stage_build_then_install_shim_end_to_end(tmp_path: Path) -> None:
    """The shim stage's commands on a copy of shim/, then the init container's command on the
    library they produce."""
    (shim,) = [s for s in STAGES if s.name == "shim"]
    (workdir,) = shim.all("WORKDIR")
    (build,) = [run for run in shim.all("RUN") if run.startswith("make")]
    copies = [c.split() for c in shim.all("COPY")]
    assert copies == [["shim/", "./"]], copies
    source = tmp_path / "shim"
    shutil.copytree(REPO / "shim", source, ignore=shutil.ignore_patterns("build"))
    proc = subprocess.run(
        ["sh", "-c", build], cwd=source, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final_copy = next(c.split() for c in FINAL.all("COPY") if c.startswith("--from=shim"))
    built = source / Path(final_copy[1]).relative_to(workdir)
    assert built.read_bytes().startswith(b"\x7fELF")

    dest = tmp_path / "host" / "shim"
    from vgpu_agent import cli

    assert cli.main(["install-shim", "--source", str(built), "--dest", str(dest)]) == 0
    installed = shiminstall.current_shim(dest)
    assert installed.read_bytes() == built.read_bytes()


@pytest.mark.parametrize(
    ("path", "included"),
    [
        ("pyproject.toml", True),
        ("README.md", True),
        ("vgpu_agent/cli.py", True),
        ("vgpu_agent/_proto/deviceplugin/v1beta1/api_pb2.py", True),
        ("shim/include/vgpu_shm.h", True),
        ("deploy/base/config.yaml", True),
        ("deploy/base/daemonset.yaml", False),
        ("tests/conftest.py", False),
        (".git/HEAD", False),
        ("shim/build/libvgpu.so", False),
        ("vgpu_agent/__pycache__/cli.cpython-311.pyc", False),
        ("build/tools/bin/kubectl", False),
    ],
)
def test_dockerignore_sends_only_what_the_build_needs(path: str, included: bool) -> None:
    assert in_build_context(path, (REPO / ".dockerignore").read_text()) is included


def test_every_copied_path_is_in_the_build_context() -> None:
    ignore = (REPO / ".dockerignore").read_text()
    for stage in STAGES:
        for copy in stage.all("COPY"):
            parts = [p for p in copy.split() if not p.startswith("--")]
            if any(p.startswith("--from=") for p in copy.split()):
                continue
            for source in parts[:-1]:
                path = source.rstrip("/")
                assert (REPO / path).exists(), f"COPY source {source} does not exist"
                assert in_build_context(path, ignore), f"COPY source {source} is ignored"


def test_wheels_stage_builds_an_installable_agent(tmp_path: Path) -> None:
    """What the `wheels` stage does, on exactly the files it copies."""
    (wheels,) = [s for s in STAGES if s.name == "wheels"]
    context = tmp_path / "src"
    context.mkdir()
    for copy in wheels.all("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            src = REPO / source.rstrip("/")
            if src.is_dir():
                shutil.copytree(
                    src, context / source.rstrip("/"), ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy(src, context / source)
    proc = subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
            "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheels"), str(context),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("vgpu_agent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("vgpu_agent/cli.py", "vgpu_agent/shiminstall.py", "vgpu_agent/kube/node.py"):
        assert module in names
    assert any(n.startswith("vgpu_agent/_proto/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vgpu-agent = vgpu_agent.cli:main" in text
    assert not any(n.startswith("tests/") for n in names)
    # the extensions are built in, and their sources left out
    for native in ("vgpu_agent/throttle/_lawc", "vgpu_agent/throttle/_steerc",
                   "vgpu_agent/throttle/_splitc", "vgpu_agent/shm/_statec",
                   "vgpu_agent/shm/_usagec"):
        assert any(n.startswith(native) and n.endswith(".so") for n in names), native
    assert not any(n.endswith(".c") for n in names)

"""Installing the shim into a host dir: versioned files, atomic link switch, pruning, errors."""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vgpu_agent import shiminstall
from vgpu_agent.shiminstall import ShimInstallError, current_shim, install_shim, main


def fake_shim(tmp_path: Path, body: bytes) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    path = src / "libvgpu.so"
    path.write_bytes(b"\x7fELF" + body)
    return path


def versioned_files(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.glob("libvgpu-*.so"))


def test_fresh_install_lays_out_versioned_file_link_and_preload(tmp_path: Path) -> None:
    src = fake_shim(tmp_path, b"build one")
    dest = tmp_path / "state" / "shim"

    installed = install_shim(src.parent, dest, "1.2.3")

    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert installed == dest / f"libvgpu-1.2.3-{digest[:12]}.so"
    assert installed.read_bytes() == src.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o755
    assert os.readlink(dest / "libvgpu.so") == installed.name
    assert (dest / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"
    assert current_shim(dest) == installed
    assert not list(dest.glob(".vgpu-install-*")), "temp files left behind"


def test_source_may_name_the_file_itself(tmp_path: Path) -> None:
    src = fake_shim(tmp_path, b"x")
    installed = install_shim(src, tmp_path / "d", "1")
    assert installed.read_bytes() == src.read_bytes()


def test_rerun_with_same_build_rewrites_nothing(tmp_path: Path) -> None:
    src = fake_shim(tmp_path, b"same")
    dest = tmp_path / "d"
    first = install_shim(src, dest, "1.0")
    inodes = {p.name: p.lstat().st_ino for p in dest.iterdir()}

    second = install_shim(src, dest, "1.0")

    assert second == first
    assert {p.name: p.lstat().st_ino for p in dest.iterdir()} == inodes


def test_upgrade_keeps_old_file_intact_for_running_containers(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    old = install_shim(fake_shim(tmp_path, b"old build" * 100), dest, "1.0")
    # A running container has the old build mapped, as the dynamic loader maps it.
    with open(old, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        new = install_shim(fake_shim(tmp_path, b"new build" * 100), dest, "1.1")
        assert mapped[:13] == b"\x7fELFold build"
    assert new != old
    assert old.read_bytes().startswith(b"\x7fELFold build")
    assert os.readlink(dest / "libvgpu.so") == new.name


def test_keeps_newest_three_versions(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    installed = []
    for n in range(5):
        installed.append(install_shim(fake_shim(tmp_path, b"build %d" % n), dest, f"1.{n}"))
        # mtime decides age; age each install so the next one is clearly newer.
        stamp = time.time() - 100 + n
        os.utime(installed[-1], (stamp, stamp))

    assert versioned_files(dest) == sorted(p.name for p in installed[2:])
    assert current_shim(dest) == installed[4]


def test_never_prunes_the_link_target_even_when_it_looks_old(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    older = [install_shim(fake_shim(tmp_path, b"b%d" % n), dest, f"0.{n}") for n in range(2)]
    future = time.time() + 3600
    for path in older:  # clock skew: older builds carry newer mtimes than the next install
        os.utime(path, (future, future))
    src = fake_shim(tmp_path, b"current")
    # install touches the file to now, which is still older than the skewed ones
    current = install_shim(src, dest, "1.0", keep=1)

    assert current.exists()
    assert current_shim(dest) == current
    assert len(versioned_files(dest)) == 2  # newest skewed one + the current one


def test_reinstalling_a_kept_build_makes_it_current_again(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    first = install_shim(fake_shim(tmp_path, b"v1"), dest, "1")
    install_shim(fake_shim(tmp_path, b"v2"), dest, "2")
    again = install_shim(fake_shim(tmp_path, b"v1"), dest, "1")
    assert again == first
    assert current_shim(dest) == first


def test_corrupt_versioned_file_is_rewritten(tmp_path: Path) -> None:
    src = fake_shim(tmp_path, b"good")
    dest = tmp_path / "d"
    installed = install_shim(src, dest, "1")
    installed.write_bytes(b"\x7fELFtruncat")
    install_shim(src, dest, "1")
    assert installed.read_bytes() == src.read_bytes()


def test_stale_temp_files_are_removed_fresh_ones_kept(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    dest.mkdir()
    stale = dest / ".vgpu-install-libvgpu.so.999"
    fresh = dest / ".vgpu-install-libvgpu.so.998"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 2 * shiminstall.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    install_shim(fake_shim(tmp_path, b"x"), dest, "1")
    assert not stale.exists()
    assert fresh.exists()


def test_failed_link_switch_leaves_previous_version_in_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "d"
    old = install_shim(fake_shim(tmp_path, b"old"), dest, "1")
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if Path(dst).name == "libvgpu.so":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ShimInstallError, match=r"cannot switch .*libvgpu.so: No space left"):
        install_shim(fake_shim(tmp_path, b"new"), dest, "2")

    assert current_shim(dest) == old
    assert not list(dest.glob(".vgpu-install-*"))


def test_preload_file_is_repaired(tmp_path: Path) -> None:
    src = fake_shim(tmp_path, b"x")
    dest = tmp_path / "d"
    install_shim(src, dest, "1")
    (dest / "ld.so.preload").write_text("/tmp/evil.so\n")
    install_shim(src, dest, "1")
    assert (dest / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"


@pytest.mark.parametrize("version", ["", "../1", "1/2", "-x", "a b", "x" * 65])
def test_bad_version_is_rejected_by_name(tmp_path: Path, version: str) -> None:
    with pytest.raises(ShimInstallError, match="invalid shim version"):
        install_shim(fake_shim(tmp_path, b"x"), tmp_path / "d", version)
    assert not (tmp_path / "d").exists()


def test_missing_source_is_named(tmp_path: Path) -> None:
    with pytest.raises(ShimInstallError, match=r"cannot read shim source .*nope/libvgpu.so"):
        install_shim(tmp_path / "nope" / "libvgpu.so", tmp_path / "d", "1")


def test_non_elf_source_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "libvgpu.so"
    src.write_text("#!/bin/sh\n")
    with pytest.raises(ShimInstallError, match="is not an ELF shared object"):
        install_shim(src, tmp_path / "d", "1")


def test_dest_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    dest = tmp_path / "file"
    dest.write_text("")
    with pytest.raises(ShimInstallError, match=r"exists and is not a directory"):
        install_shim(fake_shim(tmp_path, b"x"), dest, "1")


def test_link_that_is_a_directory_is_rejected(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    (dest / "libvgpu.so").mkdir(parents=True)
    with pytest.raises(ShimInstallError, match=r"is a directory, expected a symlink"):
        install_shim(fake_shim(tmp_path, b"x"), dest, "1")


def test_unwritable_dest_fails_with_clear_message(tmp_path: Path) -> None:
    # pytest's tmp dirs are private to root; the unprivileged run needs a world-readable one
    base = Path(tempfile.mkdtemp(prefix="vgpu-shim-"))
    try:
        base.chmod(0o755)
        src = fake_shim(base, b"x")
        src.parent.chmod(0o755)
        dest = base / "ro"
        dest.mkdir(mode=0o555)
        dest.chmod(0o555)
        check_unwritable(src, dest)
    finally:
        shutil.rmtree(base)


def check_unwritable(src: Path, dest: Path) -> None:
    code = (
        "import os, sys\n"
        "from vgpu_agent.shiminstall import main\n"
        "if os.geteuid() == 0:  # root writes anywhere: drop to nobody for a real EACCES\n"
        "    os.setgid(65534); os.setuid(65534)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--source", str(src), "--dest", str(dest), "--version", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"shim destination {dest} is not writable by uid" in proc.stderr
    assert list(dest.iterdir()) == []


def test_main_prints_installed_path_and_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = fake_shim(tmp_path, b"x")
    dest = tmp_path / "d"
    assert main(["--source", str(src.parent), "--dest", str(dest), "--version", "9.9"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(out) == current_shim(dest)
    assert Path(out).name.startswith("libvgpu-9.9-")


def test_main_reports_error_and_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--source", str(tmp_path / "none"), "--dest", str(tmp_path / "d")]) == 1
    assert "install-shim: cannot read shim source" in capsys.readouterr().err


def test_main_defaults_version_to_the_package_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    src = fake_shim(tmp_path, b"x")
    assert main(["--source", str(src), "--dest", str(tmp_path / "d")]) == 0
    version = metadata.version("vgpu-agent")
    assert current_shim(tmp_path / "d").name.startswith(f"libvgpu-{version}-")
    assert shiminstall.build_parser().parse_args(["--dest", "x"]).source == Path("/opt/vgpu")

"""Install the shim (`libvgpu.so`) and its `ld.so.preload` file into the host state dir.

Runs as the DaemonSet's init container (`vgpu-agent install-shim`). Layout of `<dest>`:

    libvgpu-<version>-<sha256[:12]>.so   one file per installed build, never rewritten in place
    libvgpu.so -> libvgpu-<...>.so       the link new containers are given
    ld.so.preload                        names the shim's path *inside* containers

Why upgrades cannot break running pods: a container's bind mount is made from the link's target
as it is when the container starts (the mount follows the link to the versioned file). Installing
a new build writes a new versioned file and switches the link with one rename, so running
containers keep the inode they mapped; nothing they use is ever truncated or overwritten. Even a
pruned file stays alive for the containers that mounted it, because their mounts hold the inode.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

SHIM_NAME = "libvgpu.so"
PRELOAD_NAME = "ld.so.preload"
CONTAINER_SHIM_PATH = "/usr/local/vgpu/libvgpu.so"
DEFAULT_SOURCE = Path("/opt/vgpu")
KEEP_VERSIONS = 3
# A temp file older than this was left by an install that died; younger ones may be live.
STALE_TEMP_SECONDS = 600

_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_VERSIONED_RE = re.compile(r"^libvgpu-.+-[0-9a-f]{12}\.so$")
_TEMP_PREFIX = ".vgpu-install-"
_ELF_MAGIC = b"\x7fELF"
_T = TypeVar("_T")


class ShimInstallError(Exception):
    """The shim could not be installed; the message names the path or value at fault."""


def install_shim(source: Path, dest: Path, version: str, keep: int = KEEP_VERSIONS) -> Path:
    """Install the shim from `source` (the file, or a directory holding `libvgpu.so`) into `dest`.

    Returns the path of the versioned file the link now points to. Safe to run again: an
    unchanged build rewrites nothing.
    """
    if not _VERSION_RE.match(version):
        raise ShimInstallError(
            f"invalid shim version {version!r}: use 1-64 characters of letters, digits, "
            "'.', '_', '+' or '-', starting with a letter or digit"
        )
    if keep < 1:
        raise ShimInstallError(f"invalid keep count {keep}: at least 1 version must be kept")
    data = _read_shim(source)
    digest = hashlib.sha256(data).hexdigest()
    _prepare_dest(dest)
    _remove_stale_temps(dest)

    versioned = dest / f"libvgpu-{version}-{digest[:12]}.so"
    _guard(f"write {versioned}", lambda: _install_versioned(versioned, data, digest))
    preload = (CONTAINER_SHIM_PATH + "\n").encode()
    _guard(f"write {dest / PRELOAD_NAME}", lambda: _write_if_changed(dest / PRELOAD_NAME, preload))
    _guard(f"switch {dest / SHIM_NAME}", lambda: _switch_link(dest / SHIM_NAME, versioned.name))
    _fsync_dir(dest)
    removed = _guard(f"prune {dest}", lambda: _prune(dest, versioned.name, keep))
    log.info(
        "shim_installed",
        path=str(versioned),
        version=version,
        sha256=digest,
        removed=[p.name for p in removed],
    )
    return versioned


def current_shim(dest: Path) -> Path:
    """The versioned file the link in `dest` points to now (what a new container should mount)."""
    link = dest / SHIM_NAME
    try:
        target = os.readlink(link)
    except OSError as exc:
        raise ShimInstallError(f"no installed shim at {link}: {exc.strerror}") from exc
    return dest / target


def _read_shim(source: Path) -> bytes:
    path = source
    try:
        if source.is_dir():
            path = source / SHIM_NAME
        data = path.read_bytes()
    except OSError as exc:
        raise ShimInstallError(f"cannot read shim source {path}: {exc.strerror}") from exc
    if not data.startswith(_ELF_MAGIC):
        raise ShimInstallError(
            f"shim source {path} is not an ELF shared object ({len(data)} bytes, "
            f"starts with {data[:4]!r}; expected {_ELF_MAGIC!r})"
        )
    return data


def _prepare_dest(dest: Path) -> None:
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise ShimInstallError(f"shim destination {dest} exists and is not a directory") from exc
    except OSError as exc:
        raise ShimInstallError(f"cannot create shim destination {dest}: {exc.strerror}") from exc
    if not os.access(dest, os.W_OK | os.X_OK):
        raise ShimInstallError(
            f"shim destination {dest} is not writable by uid {os.geteuid()}: "
            "mount the host state dir read-write into the init container"
        )


def _guard(what: str, action: Callable[[], _T]) -> _T:
    try:
        return action()
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        raise ShimInstallError(f"cannot {what}: {reason}") from exc


def _install_versioned(path: Path, data: bytes, digest: str) -> None:
    if path.is_file() and not path.is_symlink():
        if hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            # Re-installing a kept build (a rollback) makes it the newest for pruning.
            os.utime(path)
            return
        log.warning("shim_file_corrupt_rewriting", path=str(path))
    _atomic_write(path, data, mode=0o755)


def _write_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    _atomic_write(path, data, mode=0o644)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Write a temp file beside `path`, fsync it, then rename it over `path`."""
    tmp = path.with_name(f"{_TEMP_PREFIX}{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _switch_link(link: Path, target_name: str) -> None:
    if link.is_symlink() and os.readlink(link) == target_name:
        return
    if link.is_dir() and not link.is_symlink():
        raise IsADirectoryError(errno.EISDIR, f"{link} is a directory, expected a symlink")
    tmp = link.with_name(f"{_TEMP_PREFIX}{link.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target_name, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _prune(dest: Path, current: str, keep: int) -> list[Path]:
    """Delete versioned files beyond the newest `keep`, never the one the link points to."""
    versions = [
        p
        for p in dest.iterdir()
        if _VERSIONED_RE.match(p.name) and p.is_file() and not p.is_symlink()
    ]
    versions.sort(key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    removed = []
    for path in versions[keep:]:
        if path.name == current:
            continue
        path.unlink()
        removed.append(path)
    return removed


def _remove_stale_temps(dest: Path) -> None:
    cutoff = time.time() - STALE_TEMP_SECONDS
    for path in dest.glob(_TEMP_PREFIX + "*"):
        with contextlib.suppress(FileNotFoundError):
            if path.lstat().st_mtime < cutoff:
                path.unlink()
                log.info("shim_stale_temp_removed", path=str(path))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _package_version() -> str:
    try:
        return metadata.version("vgpu-agent")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu-agent install-shim",
        description="Install libvgpu.so and ld.so.preload into the host state dir.",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=DEFAULT_SOURCE,
        help="libvgpu.so, or a directory holding it (default: %(default)s)",
    )
    parser.add_argument(
        "--dest", type=Path, required=True, help="host directory, e.g. /var/lib/vgpu-agent/shim"
    )
    parser.add_argument(
        "--version",
        default=None,
        help="version named in the installed file (default: the agent's package version)",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=KEEP_VERSIONS,
        help="versioned files to keep (default: %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        version = args.version or _package_version()
        path = install_shim(args.source, args.dest, version, keep=args.keep)
    except ShimInstallError as exc:
        log.error("shim_install_failed", error=str(exc))
        print(f"install-shim: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

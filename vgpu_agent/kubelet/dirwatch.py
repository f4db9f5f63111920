"""Changes in a kubelet socket directory, from inotify: a restart noticed without polling.

The kubelet shows a restart by deleting the plugin sockets in its directory and creating
`kubelet.sock` anew. Polling two `stat` calls every half second finds that within a second, but it
wakes an idle agent twice a second for nothing; inotify wakes it only when an entry of the
directory is created, deleted, renamed or has its attributes changed.

`DirWatch.open` gives None where inotify cannot be had (not Linux, no libc symbol, the per-user
watch limit reached, a directory gone): the caller then polls as before. A watch whose directory
is deleted or moved is over (`alive` turns False, and `wait` returns at once from then on): the
caller checks the sockets and opens a new one, or polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import struct

import structlog

log = structlog.get_logger(__name__)

# <sys/inotify.h>
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000

_ENTRY_CHANGES = IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_WATCH_OVER = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
_EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library the interpreter runs on (the process's own symbols: no search for a file,
    which would run `ldconfig`); None where it has no inotify."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


class DirWatch:
    """One inotify watch on one directory, read on the running event loop."""

    def __init__(self, fd: int, path: str):
        self.path = path
        self.alive = True
        self._fd: int | None = fd
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._on_readable)

    @classmethod
    def open(cls, path: str) -> DirWatch | None:
        """Watch `path` (a directory) from now on; None, logged, where inotify is not to be had.
        Call on the event loop that will wait on it."""
        libc = _libc()
        if libc is None:
            log.info("dir_watch_unavailable", path=path, reason="no inotify in the C library")
            return None
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            log.info("dir_watch_unavailable", path=path, reason=os.strerror(err))
            return None
        mask = _ENTRY_CHANGES | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
        if libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            log.info("dir_watch_unavailable", path=path, reason=os.strerror(err))
            return None
        return cls(fd, path)

    def _on_readable(self) -> None:
        if self._fd is None:
            return
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            except OSError as err:  # not expected of inotify; polling is the way on
                log.warning("dir_watch_read_failed", path=self.path, error=str(err))
                self._over()
                break
            if not data:
                break
            # Any event, an overflow (events lost) included, has the caller check its sockets.
            if any(mask & _WATCH_OVER for mask in _masks(data)):
                self._over()
        self._changed.set()

    def _over(self) -> None:
        self.alive = False
        self._changed.set()

    async def wait(self, timeout_s: float | None) -> bool:
        """Until an entry of the directory changed (True) or `timeout_s` passed (False)."""
        if not self.alive:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
        except TimeoutError:
            return False
        self._changed.clear()
        return True

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self.alive = False
        with contextlib.suppress(RuntimeError, ValueError):  # the loop closed meanwhile
            self._loop.remove_reader(fd)
        os.close(fd)

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _masks(data: bytes) -> list[int]:
    """The event masks in one read of an inotify descriptor (names are skipped)."""
    masks, offset = [], 0
    while offset + _EVENT_HEADER.size <= len(data):
        _, mask, _, name_len = _EVENT_HEADER.unpack_from(data, offset)
        masks.append(mask)
        offset += _EVENT_HEADER.size + name_len
    return masks

"""POSIX shared-memory arenas that peers on the same host map and copy into directly.

`multiprocessing.shared_memory` registers every segment with the resource tracker, which
unlinks a segment when *any* process that attached it exits (before Python 3.13's
`track=False`), so a reader dying would delete a writer's memory. This module calls
shm_open/mmap itself: only the creator unlinks, and only when it says so.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from typing import Final

import numpy as np

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing uses)
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX CPython
    _posixshmem = None

log = logging.getLogger(__name__)

NAME_PREFIX: Final = "mc-"
_SHM_DIR: Final = "/dev/shm"


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return int(_posixshmem.shm_open("/" + name, flags, mode))
    return os.open(os.path.join(_SHM_DIR, name), flags, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:  # pragma: no cover
        os.unlink(os.path.join(_SHM_DIR, name))


def new_name(hint: str = "") -> str:
    """A fresh, unguessable shm name `mc-<pid>-<hint>-<random>` (a valid POSIX shm name);
    the creator's pid lets sweep_stale() find arenas whose creator died without cleanup."""
    safe = "".join(c if c.isalnum() else "-" for c in hint)[:32]
    return f"{NAME_PREFIX}{os.getpid()}-{safe}-{secrets.token_hex(8)}"


def sweep_stale() -> list[str]:
    """Unlink this host's arenas whose creating process is gone (it was killed before it
    could unlink them); returns their names. Arenas of live processes are never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(NAME_PREFIX) :].split("-", 1)[0]
        if not name.startswith(NAME_PREFIX) or not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                _shm_unlink(name)
                removed.append(name)
        except PermissionError:
            pass  # alive, another user's
    if removed:
        log.warning("removed %d shared-memory arenas left by dead processes", len(removed))
    return removed


class ShmArena:
    """A mapped POSIX shared-memory object; create() owns (and unlinks) it, attach() maps a
    peer's. `buf` is a writable memoryview of the whole arena, `array` a uint8 view of it."""

    def __init__(self, name: str, num_bytes: int, fd: int, is_owner: bool):
        self.name = name  # POSIX name without the leading "/"
        self.num_bytes = num_bytes  # bytes mapped
        self.is_owner = is_owner  # True if this process created the object and unlinks it
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, num_bytes) if num_bytes else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(bytearray())
        self.array = np.frombuffer(self.buf, dtype=np.uint8)

    @classmethod
    def create(cls, num_bytes: int, name: str | None = None) -> ShmArena:
        """Create and map a new zero-filled arena of `num_bytes` (name generated if None)."""
        name = name or new_name()
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        try:
            os.ftruncate(fd, num_bytes)
        except OSError:
            os.close(fd)
            _shm_unlink(name)
            raise
        return cls(name, num_bytes, fd, is_owner=True)

    @classmethod
    def attach(cls, name: str, num_bytes: int | None = None) -> ShmArena:
        """Map an existing arena; its size is checked against `num_bytes` when given.

        Raises FileNotFoundError if it does not exist and ValueError if it is smaller than
        expected (a peer must never map less than it will copy into).
        """
        fd = _shm_open(name, os.O_RDWR)
        size = os.fstat(fd).st_size
        if num_bytes is not None and size < num_bytes:
            os.close(fd)
            raise ValueError(f"shm {name!r} holds {size} bytes, expected at least {num_bytes}")
        return cls(name, num_bytes if num_bytes is not None else size, fd, is_owner=False)

    def close(self) -> None:
        """Unmap (and unlink if this process owns the arena). Safe to call twice.

        If views of the memory are still exported (a transfer in flight holds one), the
        mapping is left to the garbage collector instead of raising.
        """
        if self._mmap is not None:
            self.array = np.empty(0, dtype=np.uint8)
            try:
                self.buf.release()
                self._mmap.close()
            except BufferError:
                log.debug("shm %s still has exported views; unmapping later", self.name)
            self._mmap = None
        if self.is_owner:
            self.is_owner = False
            with contextlib.suppress(FileNotFoundError):
                _shm_unlink(self.name)

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmArena({self.name!r}, {self.num_bytes} bytes, owner={self.is_owner})"

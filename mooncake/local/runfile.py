"""The run directory of a `mooncake up --local` cluster, and its runfile.

The run directory, `$XDG_RUNTIME_DIR/mooncake-<uid>` (else `/tmp/mooncake-<uid>`), holds the
generated config (with the cluster secret), the cost-model cache and the runfile: where the
cluster is, so `mooncake status` and `mooncake replay` find it with no arguments. Its name is
predictable, so another local user could create it first: a directory is used only if it is
a real directory (not a symlink) of this user that nobody else may write in
(`private_dir`), and files are written into it without following symlinks
(`write_private`: a new file created exclusively in the checked directory, then renamed).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec

from mooncake.errors import MooncakeError

RUNFILE_NAME = "local.json"


class RunDirError(MooncakeError):
    """A run directory is not safe to keep the cluster secret in."""


class LocalCluster(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # base URL of the master's HTTP API, e.g. "http://127.0.0.1:8000"
    master: str  # host:port of the master's control plane
    config_path: str  # the generated config every process was started with
    pids: dict[str, int]  # node id -> process id
    api_key: str = ""  # a key the API accepts ("" when keys are off)
    # node id -> its process's start time (clock ticks after boot): tells our process from
    # a later one that reuses the pid; filled in by write_runfile
    start_ticks: dict[str, int] = msgspec.field(default_factory=dict)


def default_run_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"mooncake-{os.getuid()}"


def runfile_path() -> Path:
    return default_run_dir() / RUNFILE_NAME


@contextlib.contextmanager
def _open_dir(path: Path, create: bool, tighten: bool) -> Iterator[int]:
    """A descriptor of directory `path` once checked private (see private_dir)."""
    created = False
    if create:  # missing parents too are made 0700 (the cache dir's parent is the run dir)
        for missing in reversed([p for p in (path, *path.parents) if not p.exists()]):
            with contextlib.suppress(FileExistsError):
                missing.mkdir(mode=0o700)
                created = missing == path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        what = "a symbolic link" if os.path.islink(path) else "not a directory we can open"
        raise RunDirError(
            f"{path}: {what} ({e.strerror}); the run directory must be a real directory of "
            f"yours: remove it, or pass --run-dir DIR (or set XDG_RUNTIME_DIR)"
        ) from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise RunDirError(
                f"{path}: belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); another "
                "user may have created it to read the cluster secret. Have it removed (by its "
                "owner or root), or pass --run-dir DIR (or set XDG_RUNTIME_DIR) with a "
                "directory of yours"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise RunDirError(
                f"{path}: others may write in it (mode {stat.S_IMODE(st.st_mode):o}), so they "
                f"could replace the files it holds; run `chmod go-w {path}` (or remove it), or "
                "pass --run-dir DIR with a directory of yours"
            )
        if created or (tighten and st.st_mode & 0o077):
            os.fchmod(fd, 0o700)  # mkdir's mode passes through the umask
        yield fd
    finally:
        os.close(fd)


def private_dir(path: Path, tighten: bool = False) -> Path:
    """Create `path` (mode 0700, with its parents) if missing and check it: raises RunDirError
    when it is a symlink or no directory, belongs to another user, or others may write in
    it. `tighten` sets an existing directory of ours to 0700 (for the default run dir)."""
    with _open_dir(path, create=True, tighten=tighten):
        return path


def write_private(directory: Path, name: str, data: bytes) -> Path:
    """Replace `directory/name` with `data` (mode 0600) without following a symlink at either
    path: a new file created exclusively in the checked directory, then renamed over `name`.
    Creates `directory` as private_dir does; raises RunDirError."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    with _open_dir(directory, create=True, tighten=False) as dir_fd:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise RunDirError(f"cannot write {directory / name}: {e.strerror or e}") from e
    return directory / name


def _read_private(path: Path) -> bytes | None:
    """`path`'s bytes if its directory is private and it is a regular file (no symlink)."""
    try:
        with _open_dir(path.parent, create=False, tighten=False) as dir_fd:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            with open(fd, "rb") as f:
                return f.read()
    except FileNotFoundError:
        return None
    except OSError:  # a symlink in our own directory (ELOOP): not a runfile of ours
        return None


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, field 22 of /proc/PID/stat), or
    None when there is no such live process (a zombie counts as dead)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[1].split()  # the name in (...) may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # fields[0] is field 3 (state)


def _is_ours(pid: int, ticks: int | None) -> bool:
    """Process `pid` is alive and is the one recorded (same start time; a runfile written
    before start times were recorded: its command line names mooncake)."""
    now = start_ticks(pid)
    if now is None:
        return False
    if ticks is not None:
        return now == ticks
    try:
        return b"mooncake" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def write_runfile(cluster: LocalCluster, path: Path | None = None) -> Path:
    """Write the runfile (mode 0600, in a private directory), recording the start time of
    every pid it lists that `cluster.start_ticks` lacks; raises RunDirError."""
    path = path or runfile_path()
    ticks = {n: start_ticks(p) or 0 for n, p in cluster.pids.items()}
    ticks.update(cluster.start_ticks)
    whole = msgspec.structs.replace(cluster, start_ticks=ticks)
    return write_private(path.parent, path.name, msgspec.json.encode(whole))


def read_runfile(path: Path | None = None) -> LocalCluster | None:
    """The running local cluster, or None when there is none: no runfile, or its master is
    dead or its pid now belongs to another process. Raises RunDirError when the run
    directory is not private (someone else could have written the runfile)."""
    path = path or runfile_path()
    raw = _read_private(path)
    if raw is None:
        return None
    try:
        cluster = msgspec.json.decode(raw, type=LocalCluster)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    pid = cluster.pids.get("master")
    if pid is None or not _is_ours(pid, cluster.start_ticks.get("master")):
        return None
    return cluster


def remove_runfile(path: Path | None = None) -> None:
    (path or runfile_path()).unlink(missing_ok=True)

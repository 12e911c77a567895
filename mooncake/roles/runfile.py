"""Where a `mooncake up --local` cluster says it is, so `mooncake status` and `mooncake
replay` find it with no arguments: a JSON file in the user's runtime directory."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec


class LocalCluster(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # base URL of the master's HTTP API, e.g. "http://127.0.0.1:8000"
    master: str  # host:port of the master's control plane
    config_path: str  # the generated config every process was started with
    pids: dict[str, int]  # node id -> process id
    api_key: str = ""  # a key the API accepts ("" when keys are off)


def runfile_path() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"mooncake-{os.getuid()}" / "local.json"


def write_runfile(cluster: LocalCluster, path: Path | None = None) -> Path:
    path = path or runfile_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(cluster))
    os.replace(tmp, path)
    return path


def read_runfile(path: Path | None = None) -> LocalCluster | None:
    """The running local cluster, or None when there is none (or its master is dead)."""
    path = path or runfile_path()
    try:
        cluster = msgspec.json.decode(path.read_bytes(), type=LocalCluster)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    pid = cluster.pids.get("master")
    if pid is None or not _alive(pid):
        return None
    return cluster


def remove_runfile(path: Path | None = None) -> None:
    (path or runfile_path()).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

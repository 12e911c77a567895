"""The cluster secret of an engine or a Store client started through upstream's API,
which has no argument for one: every connection (data plane, master) is authenticated
with it, so it must come from the environment or the config file. One rule for both
(`mooncake.store.upstream.setup.cluster_secret` calls this), so that an engine, a Store
client and `mooncake_master` started side by side agree.

In order: `MOONCAKE_CLUSTER_SECRET`, `MOONCAKE_CLUSTER_SECRET_FILE`, or `cluster.secret` /
`cluster.secret_file` of the config file named by `MOONCAKE_CONFIG` (the usual config
layers, mooncake/config/load.py). Without any of them initialize() refuses, naming them,
unless `MOONCAKE_LOCAL_SECRET=1` opts into a secret generated for this user on this host
(a 0600 file under $XDG_RUNTIME_DIR, else ~/.cache/mooncake): processes of one user on one
host then find each other with no setup, and any other peer fails the handshake.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from mooncake.config.load import load_config
from mooncake.config.settings import CONFIG_ENV
from mooncake.errors import ConfigError

LOCAL_SECRET_ENV = "MOONCAKE_LOCAL_SECRET"
_TRUE = ("1", "true", "yes", "on")


def local_secret_path() -> Path:
    """Where the per-user, per-host secret lives."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path.home() / ".cache"
    return base / "mooncake" / "engine-secret"


def _local_secret() -> bytes:
    path = local_secret_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():  # NOTE: written aside, then linked: a reader sees all or nothing
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of this user made it first: use theirs
        finally:
            tmp.unlink()
    if path.stat().st_mode & 0o077:
        raise ConfigError(f"{path}: readable by other users; chmod 600 it or delete it")
    text = path.read_text().strip()
    if len(text) < 16:
        raise ConfigError(f"{path}: holds {len(text)} characters, need >= 16; delete it")
    return text.encode()


def engine_secret(env: Mapping[str, str] | None = None) -> bytes:
    """The cluster secret for this process's engines and Store clients (`env`: default
    os.environ); raises ConfigError saying how to give one when there is none (reads the
    environment, maybe files; changes nothing, except that the local opt-in creates its
    file once)."""
    env = os.environ if env is None else env
    cluster = load_config(env.get(CONFIG_ENV) or None, env).config.cluster
    if cluster.secret or cluster.secret_file:
        return cluster.require_secret().encode()
    if env.get(LOCAL_SECRET_ENV, "").lower() in _TRUE:
        return _local_secret()
    raise ConfigError(
        "no cluster secret for upstream's API (every connection, to the master and "
        "between engines, is authenticated): set "
        "MOONCAKE_CLUSTER_SECRET (>= 16 characters, the same on every node; e.g. "
        "`openssl rand -hex 32`), MOONCAKE_CLUSTER_SECRET_FILE, or cluster.secret in the "
        f"file named by {CONFIG_ENV}; or, for processes of one user on one host only, "
        f"{LOCAL_SECRET_ENV}=1"
    )

"""A one-member etcd on loopback: for `mooncake up --local --masters N` and for tests.

    etcd = LocalEtcd(data_dir)       # free client and peer ports
    etcd.start()                     # returns once it answers; etcd.url
    ...
    etcd.stop()

A local cluster's etcd keeps its data in memory (`tmpfs_data_dir`: a directory on the
/dev/shm tmpfs, removed by `stop`, or by the next local etcd when its process died): its
data dies with the cluster anyway, and on a busy host's disk etcd's fsyncs take seconds
(seen: 2-4 s), longer than `cluster.etcd_timeout_s`, which makes the leader step down.

It runs Debian's `etcd` (package etcd-server) or any `etcd` >= 3.4 on PATH (or
`$MOONCAKE_ETCD`); EtcdError when there is none, it is not a usable etcd, or it does not
answer in time (and then the data directory goes as with `stop`).

Its auth is on (`is_secured`, the default): before it returns, `start` adds the user root
with a random password (`password`; `access` for a client) and enables auth, so no other
local user or process can write it without that password; then it checks that nobody
slipped in while it was open (no other user, no key).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mooncake.ha.etcd import Etcd, EtcdAccess, EtcdError

ETCD_ENV = "MOONCAKE_ETCD"  # path of the etcd binary, if not the one on PATH
TMPFS = Path("/dev/shm")
TMPFS_PREFIX = "mooncake-etcd-"  # then the pid of the process that made it
MIN_VERSION = (3, 4)  # the JSON gateway at /v3/


def etcd_binary() -> str | None:
    """The etcd server to run, or None when this host has none."""
    return os.environ.get(ETCD_ENV) or shutil.which("etcd")


def check_binary(binary: str) -> None:
    """Raise EtcdError, naming where `binary` came from, unless it runs as etcd >= 3.4."""
    where = f"${ETCD_ENV}={binary}" if os.environ.get(ETCD_ENV) else f"etcd on PATH ({binary})"
    expected = "expected the path of an etcd server >= 3.4 (Debian: /usr/bin/etcd)"
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, timeout=10, check=False
        ).stdout.decode(errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EtcdError(f"{where}: cannot run it ({e}); {expected}") from e
    found = re.search(r"etcd Version: (\d+)\.(\d+)", out)
    if found is None:
        raise EtcdError(f"{where}: `--version` does not say it is etcd; {expected}")
    if (int(found[1]), int(found[2])) < MIN_VERSION:
        raise EtcdError(f"{where}: etcd {found[1]}.{found[2]} is too old; {expected}")


def tmpfs_data_dir(fallback: Path) -> Path:
    """A fresh data directory on the /dev/shm tmpfs named for this process (those of dead
    processes are removed first), or `fallback` when /dev/shm is not a tmpfs."""
    try:
        mounts = Path("/proc/mounts").read_text().split("\n")
    except OSError:
        return fallback
    if not any(line.split()[1:3] == [str(TMPFS), "tmpfs"] for line in mounts if line):
        return fallback
    for old in TMPFS.glob(f"{TMPFS_PREFIX}*"):
        pid = old.name[len(TMPFS_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMPFS_PREFIX}{os.getpid()}-", dir=TMPFS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """An etcd child process with its data in `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        preexec_fn: Callable[[], None] | None = None,
        is_secured: bool = True,  # auth on: root with a random password
        token_ttl_s: int = 300,  # s an unused auth token lives (etcd --auth-token-ttl)
    ):
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._preexec_fn = preexec_fn
        self.access = EtcdAccess("root", secrets.token_urlsafe(24)) if is_secured else EtcdAccess()
        self.token_ttl_s = token_ttl_s

    def start(self, timeout_s: float = 30.0) -> str:
        """Start etcd, secure it, and wait until it answers; returns its client URL. On
        failure nothing is left: the process is stopped, a tmpfs data directory removed."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start(self, timeout_s: float) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdError(
                "no etcd server on this host: install it (Debian: apt-get install etcd-server) "
                f"or name it in ${ETCD_ENV}"
            )
        check_binary(binary)
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            binary,
            "--name",
            "local",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"local={peer}",
            "--auth-token-ttl",
            str(self.token_ttl_s),
            "--log-level",
            "error",
        ]
        log_file = (self.data_dir / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=log_file, preexec_fn=self._preexec_fn
        )
        log_file.close()
        etcd = Etcd([self.url], timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise EtcdError(
                        f"etcd exited with status {self.proc.returncode}; see "
                        f"{self.data_dir / 'etcd.log'}"
                    )
                try:
                    etcd.get("/")
                    break
                except EtcdError as e:
                    if time.monotonic() > deadline:
                        raise EtcdError(f"etcd did not answer within {timeout_s:g} s: {e}") from e
                time.sleep(0.05)
            if self.access.user:
                # NOTE: a call of its own: adding a user hashes its password (bcrypt), which
                # on a loaded host takes longer than the readiness probe's second
                setup = Etcd([self.url], timeout_s=max(timeout_s, 10.0))
                try:
                    self._secure(setup)
                finally:
                    setup.close()
        finally:
            etcd.close()

    def _secure(self, etcd: Etcd) -> None:
        """Turn auth on with root's password, then check nobody wrote while it was off."""
        etcd.call("/v3/auth/user/add", {"name": "root", "password": self.access.password})
        etcd.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        etcd.call("/v3/auth/enable", {})
        root = Etcd([self.url], timeout_s=etcd.timeout_s, access=self.access)
        try:
            users = root.call("/v3/auth/user/list", {}).get("users", [])
            roles = root.call("/v3/auth/role/list", {}).get("roles", [])
            everything = {"key": "AA==", "range_end": "AA==", "count_only": True}  # b"\0": all
            num_keys = int(root.call("/v3/kv/range", everything).get("count", 0))
        finally:
            root.close()
        if users != ["root"] or roles not in ([], ["root"]) or num_keys:
            raise EtcdError(
                f"another process wrote to the local etcd at {self.url} before its auth was "
                f"on (users {users}, roles {roles}, {num_keys} keys): not used; start again"
            )

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.data_dir.parent == TMPFS:  # NOTE: memory, not disk: never left behind
            shutil.rmtree(self.data_dir, ignore_errors=True)

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
`$MOONCAKE_ETCD`); EtcdError when there is none or it does not answer in time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mooncake.ha.etcd import Etcd, EtcdError

ETCD_ENV = "MOONCAKE_ETCD"  # path of the etcd binary, if not the one on PATH
TMPFS = Path("/dev/shm")
TMPFS_PREFIX = "mooncake-etcd-"  # then the pid of the process that made it


def etcd_binary() -> str | None:
    """The etcd server to run, or None when this host has none."""
    return os.environ.get(ETCD_ENV) or shutil.which("etcd")


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

    def __init__(self, data_dir: Path, preexec_fn: Callable[[], None] | None = None):
        self.data_dir = data_dir
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._preexec_fn = preexec_fn

    def start(self, timeout_s: float = 30.0) -> str:
        """Start etcd and wait until it answers; returns its client URL."""
        binary = etcd_binary()
        if binary is None:
            raise EtcdError(
                "no etcd server on this host: install it (Debian: apt-get install etcd-server) "
                f"or name it in ${ETCD_ENV}"
            )
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
                    return self.url
                except EtcdError as e:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise EtcdError(f"etcd did not answer within {timeout_s:g} s: {e}") from e
                time.sleep(0.05)
        finally:
            etcd.close()

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

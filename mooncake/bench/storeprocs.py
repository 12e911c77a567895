"""A master and store nodes as child processes on loopback, for `mooncake bench store --local`.

    with LocalCluster(secret, dram_bytes=512 << 20) as cluster:
        store = Store.connect(cluster.master_address, secret)

Each child reports its address on a pipe once it serves (a handshake, never a sleep) and
stops cleanly (the node unmounts) when the parent sends anything on that pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

from mooncake.errors import StoreError

if TYPE_CHECKING:
    from mooncake.store.metadata.journal import BaseJournal

START_TIMEOUT_S = 30.0  # seconds a child may take to report it is serving


def _on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():  # close (unlink shm) on SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


class JournalSpec(NamedTuple):
    """Where a bench master journals: "" (nowhere), "file" (`where`: the file's path) or
    "etcd" (`where`: the URL of an etcd whose root has `password`; keys under `prefix`)."""

    kind: str = ""
    where: str = ""
    password: str = ""
    prefix: str = "/mooncake-bench"
    in_flight: int = 0  # etcd: groups written at once (0: cluster.etcd_commits_in_flight's)
    window_s: float = -1.0  # etcd: s a group waits for more (< 0: the config's default)


def _journal(spec: JournalSpec, secret: bytes) -> BaseJournal | None:
    """The journal `spec` names. For etcd, the fence is a leader key this function writes
    (a bench master leads alone: each write pays the same fenced transaction as with an
    elected master; ha/journal.py)."""
    from mooncake.store.metadata.journal import FileJournal

    if spec.kind == "file":
        return FileJournal(spec.where)
    if spec.kind != "etcd":
        return None
    from mooncake.config.etcd import EtcdConfig
    from mooncake.ha.etcd import Etcd, EtcdAccess
    from mooncake.ha.journal import EtcdJournal
    from mooncake.ha.sealed import Sealer

    etcd = Etcd([spec.where], timeout_s=5.0, access=EtcdAccess("root", spec.password))
    fence_key, fence_value = f"{spec.prefix}/leader", b"bench-master"
    etcd.put(fence_key, fence_value)
    defaults = EtcdConfig()
    return EtcdJournal(
        etcd,
        spec.prefix,
        fence_key,
        fence_value,
        Sealer(secret),
        lambda kv: False,
        window_s=spec.window_s if spec.window_s >= 0 else defaults.etcd_commit_window_s,
        in_flight=spec.in_flight or defaults.etcd_commits_in_flight,
    )


def serve_master(
    secret: bytes,
    lease_ttl_s: float,
    metrics_port: int,
    journal: JournalSpec,
    conn: Connection,
) -> None:
    """Run a StoreService (metrics on `metrics_port` when >= 0, journal as `journal` says);
    report its address on `conn`."""
    from mooncake.store.metadata.settings import MetadataConfig
    from mooncake.store.server.service import StoreService

    _on_sigterm()
    cfg = MetadataConfig(lease_ttl_s=lease_ttl_s)
    port = metrics_port if metrics_port >= 0 else None
    with StoreService(secret, cfg, metrics_port=port, journal=_journal(journal, secret)) as service:
        conn.send(service.address)
        conn.recv()


def serve_node(node_id: str, master: str, secret: bytes, dram_bytes: int, conn: Connection) -> None:
    """Run a StoreNode with a DRAM tier of `dram_bytes`; report its endpoint on `conn`."""
    from mooncake.store.node.node import StoreNode, TierSizes

    _on_sigterm()
    # NOTE: a pool in steady state has had every page written; prefaulting measures that
    # state rather than the first pass through fresh memory (a page fault per 4 KiB)
    node = StoreNode(
        node_id, master, secret, TierSizes(dram_bytes=dram_bytes), heartbeat_s=0.5, prefault=True
    )
    try:
        node.start()
        node.populated.wait()
        conn.send(node.endpoint)
        conn.recv()
    finally:
        node.stop()


class Child:
    """One spawned child; `address` is what it reported once serving."""

    def __init__(self, what: str, target: Any, *args: Any):
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args, child), daemon=True, name=what)
        self.proc.start()
        child.close()
        try:
            if not self.pipe.poll(START_TIMEOUT_S):
                raise EOFError
            self.address: str = self.pipe.recv()
        except EOFError:
            self.proc.kill()
            self.proc.join(5)
            raise StoreError(f"the local {what} process did not start (see its log)") from None

    def stop(self) -> None:
        """Ask the child to stop; kill it if it has not within 10 s."""
        with contextlib.suppress(OSError):  # already gone
            self.pipe.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.pipe.close()


class LocalCluster:
    """A master and one store node ("bench-node") as child processes on 127.0.0.1."""

    NODE_ID = "bench-node"

    def __init__(
        self,
        secret: bytes,
        dram_bytes: int,  # bytes of the node's DRAM tier
        *,
        lease_ttl_s: float = 0.2,  # s a read protects an object (short: the bench removes)
        metrics_port: int = -1,  # port of the master's /metrics; -1 = none
        journal: JournalSpec = JournalSpec(),  # where the master journals
    ):
        self.master = Child(
            "store master", serve_master, secret, lease_ttl_s, metrics_port, journal
        )
        try:
            self.node = Child(
                "store node", serve_node, self.NODE_ID, self.master.address, secret, dram_bytes
            )
        except BaseException:
            self.master.stop()
            raise

    @property
    def master_address(self) -> str:
        return self.master.address

    @property
    def node_endpoint(self) -> str:
        """host:port of the node's data plane."""
        return self.node.address

    def stop(self) -> None:
        self.node.stop()
        self.master.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

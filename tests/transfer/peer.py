"""A target node in a child process, for tests that need a real peer to stop or kill.

The child allocates a shm-backed segment "pool" filled with the pattern `i % 251`, reports
its port on a pipe (the ready handshake), then obeys commands on that pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from mooncake.transfer import EngineOptions, TransferEngine


def pattern(num_bytes: int, offset: int = 0) -> np.ndarray:
    return ((np.arange(num_bytes, dtype=np.int64) + offset) % 251).astype(np.uint8)


def _serve(secret: bytes, num_bytes: int, host: str, conn: Connection, fake_rdma: bool) -> None:
    verbs: Any = None
    if fake_rdma:
        from tests.transfer import fake_verbs

        verbs = fake_verbs
    engine = TransferEngine("peer", secret, EngineOptions(protocol="auto"), host=host, verbs=verbs)
    pool = engine.allocate("pool", num_bytes)
    pool[:] = pattern(num_bytes)
    conn.send((engine.server.port, engine.describe("pool").shm_name))  # type: ignore[union-attr]
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd == "drop":
            conn.send(engine.server.drop_connections())
        elif cmd == "checksum":
            conn.send(int(pool.astype(np.int64).sum()))
        elif cmd == "stop":
            break
    engine.close()
    conn.send("bye")


@dataclass
class PeerProcess:
    proc: Any
    conn: Connection
    port: int
    shm_name: str  # unlinked by kill(): a SIGKILLed owner cannot unlink its arena

    @classmethod
    def start(
        cls, secret: bytes, num_bytes: int, host: str = "127.0.0.1", fake_rdma: bool = False
    ) -> PeerProcess:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve, args=(secret, num_bytes, host, child, fake_rdma), daemon=True
        )
        proc.start()
        child.close()
        try:
            if not parent.poll(30):
                raise EOFError
            port, shm_name = parent.recv()
        except EOFError:
            proc.kill()
            raise RuntimeError("peer process did not report ready") from None
        return cls(proc, parent, port, shm_name)

    def call(self, cmd: str) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def stop_signal(self) -> None:
        """Freeze the process (SIGSTOP): it holds its connections but never answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill_only(self) -> None:
        """SIGKILL the process but leave its shm arena in place (to inspect it)."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{self.shm_name}")

"""An engine of upstream's API in a child process, for the tests' "other side".

The child starts `mooncake.engine.TransferEngine` (initialize with the given metadata
server and local name), registers a buffer of `num_bytes` filled with `pattern(...)`,
reports (rpc_port, buffer address) on a pipe (the ready handshake), then obeys commands:
("bytes",) its buffer's content; ("reregister",) unregister the buffer and register it
again at the same address (a new token for the same address) filled with pattern(n, 7);
("notifies",) what get_notifies() returns as (name, msg) pairs; ("stop",) stop.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def pattern(num_bytes: int, offset: int = 0) -> np.ndarray:
    return ((np.arange(num_bytes, dtype=np.int64) + offset) % 251).astype(np.uint8)


def _serve(env: dict[str, str], metadata: str, name: str, num_bytes: int, conn: Connection) -> None:
    os.environ.update(env)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(name, metadata, "tcp", "")
    if rc != 0:
        conn.send(("failed", rc))
        return
    buf = pattern(num_bytes)
    address = buf.ctypes.data
    assert engine.batch_register_memory([address], [num_bytes]) == 0
    conn.send((engine.get_rpc_port(), address))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd == "bytes":
            conn.send(buf.tobytes())
        elif cmd == "reregister":
            assert engine.unregister_memory(address) == 0
            buf[:] = pattern(num_bytes, 7)
            conn.send(engine.register_memory(address, num_bytes))
        elif cmd == "notifies":
            conn.send([(n.name, n.msg) for n in engine.get_notifies()])
        elif cmd == "stop":
            break
    engine.close()
    conn.send("bye")


@dataclass
class Peer:
    proc: Any
    conn: Connection
    port: int  # its get_rpc_port()
    address: int  # its registered buffer

    @classmethod
    def start(
        cls,
        env: dict[str, str],
        num_bytes: int,
        metadata: str = "P2PHANDSHAKE",
        name: str = "127.0.0.1",
    ) -> Peer:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(env, metadata, name, num_bytes, child), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(60):
            proc.kill()
            raise RuntimeError("peer process did not report ready")
        ready = parent.recv()
        if ready[0] == "failed":
            proc.join(5)
            raise RuntimeError(f"peer's initialize returned {ready[1]}")
        return cls(proc, parent, *ready)

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, cmd: str) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(EOFError, OSError):
                self.call("stop")
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()

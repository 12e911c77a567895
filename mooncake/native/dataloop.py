"""The data plane's READ/WRITE loop in C (`_dataloop.c`), when it was built.

`pip install` compiles `mooncake/native/_dataloop.c` (an optional extension: without a C
compiler the install goes on without it). It is a plain shared library, loaded here with
ctypes, which releases the GIL for each call: a node's connection threads then serve
READ and WRITE requests with no Python per request, and never take the GIL from a model
thread in the same process. `MOONCAKE_NATIVE_DATALOOP=0` turns it off.

    table = SegmentIndex.create()            # None: not built (or turned off)
    table.add(token, array); table.remove(token)
    rc, header = table.serve(sock.fileno())  # 1: `header` is for the Python loop

The loop hands back everything but a well-formed READ or WRITE of a known segment within
its bounds, so refusals, control ops, logging and closing stay in transfer/server.py.

Registering or unregistering a segment waits until no loop is inside a request (they hold
the table for reading while they move bytes). A peer that stalls in the middle of a
request would hold it indefinitely: after STUCK_TIMEOUT_MS the segment table drops the
server's connections (the peers reconnect) and tries again (transfer/segment.py).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from mooncake.native.cext import load_library

STUCK_TIMEOUT_MS = 2000  # a removal waits this long for a loop stuck on a stalled peer
FLUSH_BYTES = 512 << 10  # READ data queued before replies are sent (as the Python loop)
# transfer.wire's (not imported: the transfer package imports this module); a test pins them
REQ_BYTES = 32  # wire.REQ.size
MAX_DATA_BYTES = 1 << 30  # wire.MAX_DATA_BYTES


def library() -> ctypes.CDLL | None:
    """The loaded library, or None if it was not built or is turned off."""
    return load_library(
        "mooncake.native._dataloop",
        "MOONCAKE_NATIVE_DATALOOP",
        _declare,
        "the Python loop serves transfers",
    )


def _declare(lib: ctypes.CDLL) -> None:
    u64, ptr = ctypes.c_uint64, ctypes.c_void_p
    lib.dl_table_new.restype = ptr
    lib.dl_table_new.argtypes = []
    lib.dl_add.argtypes = [ptr, u64, ptr, u64, ctypes.c_int]
    lib.dl_remove.argtypes = [ptr, u64, ctypes.c_int]
    lib.dl_serve.argtypes = [ptr, ctypes.c_int, ctypes.c_char_p, u64, u64]


class SegmentIndex:
    """The C loop's table of this node's host-memory segments (token -> memory)."""

    def __init__(self, lib: ctypes.CDLL, handle: int):
        self._lib, self._handle = lib, handle
        self._local = threading.local()  # a header buffer per serving thread

    @classmethod
    def create(cls) -> SegmentIndex | None:
        lib = library()
        if lib is None:
            return None
        handle = lib.dl_table_new()
        return cls(lib, handle) if handle else None

    def add(self, token: int, array: np.ndarray, timeout_ms: int = STUCK_TIMEOUT_MS) -> int:
        """Serve `array` (uint8, contiguous, writable) under `token`: 0 added, -1 the table
        is full (the Python loop serves that segment), 1 a loop still held the table after
        `timeout_ms` (a stalled peer: drop the connections and call again)."""
        address = array.__array_interface__["data"][0]
        return int(self._lib.dl_add(self._handle, token, address, array.nbytes, timeout_ms))

    def remove(self, token: int, timeout_ms: int = STUCK_TIMEOUT_MS) -> bool:
        """Stop serving `token`; True once no loop touches its memory any more, False if a
        loop still held it after `timeout_ms` (a stalled peer: drop the connections and
        call again)."""
        return self._lib.dl_remove(self._handle, token, timeout_ms) == 0

    def serve(self, fd: int) -> tuple[int, bytes]:
        """Serve READ/WRITE requests on `fd` (GIL released) until something else comes:
        (0, b"") the peer closed between requests, (-1, b"") the connection broke,
        (1, header) a request for the Python loop, its payload still unread."""
        buf = getattr(self._local, "header", None)
        if buf is None:
            buf = self._local.header = ctypes.create_string_buffer(REQ_BYTES)
        rc = self._lib.dl_serve(self._handle, fd, buf, FLUSH_BYTES, MAX_DATA_BYTES)
        return rc, (buf.raw if rc == 1 else b"")

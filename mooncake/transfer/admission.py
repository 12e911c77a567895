"""Handshake admission: which unauthenticated connections may wait in the cluster-secret
handshake of a server (the transfer server, a pipeline stage's listener).

    pending = PendingHandshakes(limit, "transfer server", log_every_s=5.0)
    pending.admit(sock, host)        # at accept; may shut down an older pending connection
    pending.finish(sock)             # when its handshake ends; False: it had been dropped

A place is what one pending connection holds; authenticated connections hold none.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Final

log = logging.getLogger(__name__)

MAX_PENDING_HANDSHAKES: Final = 256  # default of [transfer] max_pending_handshakes


class PendingHandshakes:
    """Connections still in the cluster-secret handshake, at most `limit` of them from all
    addresses together (thread-safe). Authenticated connections hold no place.

    A server `admit`s each accepted connection and calls `finish` when its handshake ends,
    however it ends. When all `limit` places are taken, `admit` drops (shuts down) the
    oldest pending connection of the address holding the most places, and takes the new
    one (early drop, not refusal): idle connections then push out only each other, oldest
    first, and a real peer's handshake, one round trip long, completes unless `limit` newer
    connections come from its address within that round trip. A peer address holding few
    places is never dropped for one holding many. NOTE: refusing new connections instead
    would let anyone able to connect (on `up --local`: any local process, with the same
    address as every real peer) deny the data plane by holding `limit` idle connections."""

    def __init__(self, limit: int, server: str, log_every_s: float):
        assert limit >= 1, limit
        self.limit = limit
        self.num_dropped = 0  # pending connections dropped to admit newer ones
        self._server = server  # who logs the drops: "transfer server"
        self._log_every_s = log_every_s  # seconds between two drop warnings at least
        self._drop_logged_s = -float("inf")  # monotonic time of the last one
        self._sock_to_host: dict[socket.socket, str] = {}  # in order of arrival
        self._host_to_num: dict[str, int] = {}  # peer address -> pending connections
        self._lock = threading.Lock()

    def admit(self, sock: socket.socket, host: str) -> None:
        """Count `sock`, accepted from `host`, as pending; first, when full, drop (shut
        down) the connection that must make room, with a warning at most every
        `log_every_s` (a peer opening connections in a loop must not flood the log)."""
        with self._lock:
            if len(self._sock_to_host) >= self.limit:
                most = max(self._host_to_num.values())
                oldest, dropped = next(
                    (s, h) for s, h in self._sock_to_host.items() if self._host_to_num[h] == most
                )
                self._remove(oldest)
                with contextlib.suppress(OSError):  # its handshake thread sees EOF and ends
                    oldest.shutdown(socket.SHUT_RDWR)
                self.num_dropped += 1
                self._log_drop(dropped)
            self._sock_to_host[sock] = host
            self._host_to_num[host] = self._host_to_num.get(host, 0) + 1

    def finish(self, sock: socket.socket) -> bool:
        """The handshake of `sock` ended; False if `sock` had been dropped to admit another."""
        with self._lock:
            if sock not in self._sock_to_host:
                return False
            self._remove(sock)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._sock_to_host)

    def check_integrity(self) -> None:
        """Assert that the per-address counts match the pending connections."""
        with self._lock:
            counts: dict[str, int] = {}
            for host in self._sock_to_host.values():
                counts[host] = counts.get(host, 0) + 1
            assert counts == self._host_to_num, (counts, self._host_to_num)
            assert len(self._sock_to_host) <= self.limit, (len(self._sock_to_host), self.limit)

    def _log_drop(self, host: str) -> None:
        now = time.monotonic()
        if now - self._drop_logged_s >= self._log_every_s:
            self._drop_logged_s = now
            log.warning(
                "%s: %d connections are in the cluster-secret handshake at once ([transfer] "
                "max_pending_handshakes); dropped the oldest of %s's (%d dropped so far)",
                self._server,
                self.limit,
                host,
                self.num_dropped,
            )

    def _remove(self, sock: socket.socket) -> None:
        host = self._sock_to_host.pop(sock)
        n = self._host_to_num.pop(host) - 1
        if n > 0:
            self._host_to_num[host] = n

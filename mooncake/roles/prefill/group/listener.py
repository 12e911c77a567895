"""Where a later pipeline stage accepts its upstream link.

`StageListener` runs each handshake on its own thread, within a deadline for the whole
exchange and a bound on connections in the handshake at once (a new one pushes out the
oldest, `admission.PendingHandshakes`), so that slow or hostile peers never hold up the stage's
real upstream; authenticated connections become `TcpStageLink`s.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time

from mooncake.config.portrange import PortRange, listen
from mooncake.errors import AuthError
from mooncake.roles.prefill.group import auth as stageauth
from mooncake.roles.prefill.group.link import TcpStageLink
from mooncake.transfer import admission, wire

log = logging.getLogger(__name__)


class StageListener:
    """Accepts authenticated links from the previous stage (bind 127.0.0.1:0 in tests).

    An accept thread hands each connection to a handshake thread, which must finish the
    challenge within `handshake_timeout_s` in all; at most `max_pending_handshakes`
    connections are in the handshake at once (one more pushes out the oldest of the
    address holding the most).
    Authenticated links queue for `accept`; peers that fail are logged and closed."""

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int | PortRange = 0,  # a range: its first free port ([node] port_range)
        *,
        handshake_timeout_s: float = wire.HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = admission.MAX_PENDING_HANDSHAKES,
    ):
        stageauth.check_secret(secret)
        self._secret, self.handshake_timeout_s = secret, handshake_timeout_s
        self._pending = admission.PendingHandshakes(
            max_pending_handshakes, "stage listener", handshake_timeout_s
        )
        self._sock = listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._links: queue.SimpleQueue[TcpStageLink | None] = queue.SimpleQueue()  # None: closed
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="stage-accept", daemon=True).start()

    def accept(self, timeout: float | None = None) -> TcpStageLink:
        """The next authenticated link; raises TimeoutError when none came within
        `timeout` seconds, OSError once the listener is closed."""
        try:
            link = self._links.get(timeout=timeout)
        except queue.Empty as e:
            raise TimeoutError(f"no pipeline stage connected within {timeout} s") from e
        if link is None:
            self._links.put(None)  # every later accept fails the same way
            raise OSError("the stage listener is closed")
        return link

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:  # closed
                break
            self._pending.admit(sock, addr[0])
            auth = threading.Thread(
                target=self._handshake, args=(sock, addr), name="stage-auth", daemon=True
            )
            auth.start()
        self._links.put(None)

    def _handshake(self, sock: socket.socket, addr: tuple) -> None:
        deadline = time.monotonic() + self.handshake_timeout_s
        why = ""
        try:
            stageauth.server_handshake(sock, self._secret, deadline)
            sock.settimeout(None)
        except (OSError, AuthError) as e:
            why = str(e)
            if isinstance(e, TimeoutError):
                why = f"no complete handshake within {self.handshake_timeout_s:g} s"
        finally:
            is_pending = self._pending.finish(sock)
        if not is_pending:  # dropped to admit a newer connection (logged)
            sock.close()
            return
        if why:
            log.warning("refused a stage link from %s:%s: %s", addr[0], addr[1], why)
            sock.close()
            return
        with self._lock:
            if not self._closed:
                self._links.put(TcpStageLink(sock))
                return
        sock.close()

    def close(self) -> None:
        """Stop accepting; links not yet taken by `accept` are closed."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        while True:
            try:
                link = self._links.get_nowait()
            except queue.Empty:
                break
            if link is None:
                self._links.put(None)
                break
            link.close()

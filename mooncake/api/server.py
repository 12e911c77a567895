"""Run an ASGI app under uvicorn on a socket bound up front, so its URL is known before
it serves (port 0 picks a free port), in this thread or a background one.

    server = ApiServer(app, "127.0.0.1", 0)
    server.start_in_thread()          # returns once it accepts connections
    requests.get(server.url + "/health"); server.stop()

Stopping (SIGTERM, or `stop()`), the server accepts no more connections and lets running
requests finish for `drain_s`; then it sets the asyncio.Event every HTTP request finds at
`scope["extensions"][CLOSING]`, on which a request still running ends itself with an
error (`serving.py`), and after END_S more cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import math
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence

import psutil
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from mooncake.config.settings import ApiConfig
from mooncake.errors import ConfigError, PortInUseError

CLOSING = "mooncake.closing"  # scope["extensions"] key: set once a stopping server's drain is over
END_S = 1.0  # least seconds requests get after the drain to send their error (one write)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; raises ConfigError naming the address
    (PortInUseError when another process holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # NOTE: accepted sockets inherit this; without it a response's header and body writes
    # meet Nagle's algorithm and the client's delayed ACK (~40 ms per request).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        error = PortInUseError if e.errno == errno.EADDRINUSE else ConfigError
        raise error(f"api: cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


WILDCARDS = ("0.0.0.0", "::", "")


def this_host_address(ipv6: bool = False) -> str:
    """An address other hosts may reach this one at: its first non-loopback IPv4 address
    (with `ipv6`, a global IPv6 one first), else its host name."""
    families = (socket.AF_INET6, socket.AF_INET) if ipv6 else (socket.AF_INET,)
    interfaces = psutil.net_if_addrs().values()
    for family in families:
        for a in (a for addrs in interfaces for a in addrs if a.family == family):
            ip = ipaddress.ip_address(a.address.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return str(ip)
    return socket.gethostname()


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable from this host alone."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # every interface
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False  # binding will fail and say so
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_open_api(host: str, api_keys: Sequence[str], allow_unauthenticated: bool) -> None:
    """Raise ConfigError if the API would listen beyond loopback with no key, unless
    `allow_unauthenticated` says so on purpose."""
    if any(api_keys) or allow_unauthenticated or is_loopback(host):
        return
    raise ConfigError(
        f"api.host: {host or '(every interface)'} lets other hosts reach the API, and no API "
        "key is set: anyone could generate and read /v1/status (node addresses, pids, "
        "endpoints). Set keys (api.api_keys_file, a file of mode 0600, or "
        "MOONCAKE_API_API_KEYS), bind api.host to 127.0.0.1, or set "
        "api.allow_unauthenticated = true to serve it open on purpose."
    )


class _Server(uvicorn.Server):
    on_ready: Callable[[], None] | None = None

    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s  # seconds
        self.closing = asyncio.Event()  # set drain_s after the shutdown starts

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own would take SIGINT even where it is ignored (a child of `up --local`
        # leaves Ctrl-C to the launcher, which drains the cluster in order), and re-raises a
        # captured signal after its shutdown, killing the process before its owner cleans
        # up; here an ignored signal stays ignored and serve() just returns.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        taken = [
            s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN
        ]
        old = {s: signal.signal(s, self.handle_exit) for s in taken}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().call_later(self.drain_s, self.closing.set)
        await super().shutdown(sockets)  # NOTE: it cancels what still runs END_S later


class ApiServer:
    """One uvicorn server over `app` on a socket bound at construction."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        drain_s: float = ApiConfig().drain_s,
    ):
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            self._offer_closing(app),
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=math.ceil(drain_s + END_S),
        )
        self.server = _Server(config, drain_s)
        self._thread: threading.Thread | None = None

    def _offer_closing(self, app: ASGIApp) -> ASGIApp:
        async def offered(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                extensions = {**scope.get("extensions", {}), CLOSING: self.server.closing}
                scope = {**scope, "extensions": extensions}
            await app(scope, receive, send)

        return offered

    @property
    def url(self) -> str:
        """Base URL to connect to, e.g. http://127.0.0.1:8000 (a wildcard host shows as
        127.0.0.1)."""
        return _http_url({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host), self.port)

    @property
    def bound_url(self) -> str:
        """The address listened on, as a URL (http://0.0.0.0:8000 for every interface)."""
        return _http_url(self.host, self.port)

    @property
    def listening(self) -> str:
        """Where it listens, for a log line: its URL, or for a wildcard host "all
        interfaces, port N (http://<this host's address>:N)"."""
        if self.host not in WILDCARDS:
            return self.bound_url
        url = _http_url(this_host_address(ipv6=self.host == "::"), self.port)
        return f"all interfaces, port {self.port} ({url})"

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until `stop()` (or, run in the main thread, SIGTERM or a SIGINT this
        process does not ignore: then it returns after draining, see the module docstring)."""
        self.server.on_ready = on_ready
        await self.server.serve(sockets=[self.sock])

    def start_in_thread(self) -> None:
        """Serve on a daemon thread; returns when the server accepts connections."""
        ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.serve(ready.set)), name="api-server", daemon=True
        )
        self._thread.start()
        while not ready.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError("the API server thread exited before it was ready")

    def stop(self) -> None:
        """Ask the server to exit and wait for its thread (if any)."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.sock.close()

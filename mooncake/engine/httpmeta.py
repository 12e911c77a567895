"""`mooncake_http_metadata_server`: upstream's HTTP metadata server (the protocol of
mooncake-wheel/mooncake/http_metadata_server.py), a key-value store in memory:

    GET    /metadata?key=K   200 the value | 404 "metadata not found"
    PUT    /metadata?key=K   200 "metadata updated" (body = value) | 400 when K names an
                             rpc_meta entry that exists already (one engine per name)
    DELETE /metadata?key=K   200 "metadata deleted" | 404 "metadata not found"

A missing or blank key is 400; keys are stripped of surrounding blanks; bodies over
MAX_VALUE_BYTES are 413. Flags as upstream's: --host (0.0.0.0), --port (8080),
--log-level. It holds only where engines listen (engine/metadata.py), never memory
addresses or secrets: every data-plane connection still needs the cluster secret.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

MAX_VALUE_BYTES = 16 << 20  # one value; larger PUTs are refused (413)


class MetadataServer:
    """The store and its HTTP server on a thread: start() serves, close() stops."""

    def __init__(self, port: int = 8080, host: str = "0.0.0.0"):
        self.store: dict[str, bytes] = {}  # key -> value
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        bound, self.port = self._http.server_address[:2]
        self.host = bytes(bound).decode() if isinstance(bound, bytes | bytearray) else bound
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The metadata URL engines are given (http://HOST:PORT/metadata)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metadata"

    def start(self) -> MetadataServer:
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="http-metadata", daemon=True
        )
        self._thread.start()
        log.info("HTTP metadata server on %s:%s", self.host, self.port)
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def handle(self, method: str, key: str, body: bytes) -> tuple[int, bytes]:
        """One request on the store: (HTTP status, response body)."""
        key = key.strip()
        if not key:
            return 400, b"metadata key is required"
        with self._lock:
            if method == "GET":
                value = self.store.get(key)
                return (200, value) if value is not None else (404, b"metadata not found")
            if method == "PUT":
                if "rpc_meta" in key and key in self.store:
                    return 400, b"Duplicate rpc_meta key not allowed"
                self.store[key] = body
                return 200, b"metadata updated"
            if method == "DELETE":
                if self.store.pop(key, None) is None:
                    return 404, b"metadata not found"
                return 200, b"metadata deleted"
        return 405, b"Method not allowed"


def _handler(server: MetadataServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            url = urlsplit(self.path)
            if url.path.rstrip("/") != "/metadata":
                return self._reply(404, b"not found: use /metadata?key=...")
            key = parse_qs(url.query).get("key", [""])[0]
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_VALUE_BYTES:
                return self._reply(413, b"value too large")
            body = self.rfile.read(size) if size > 0 else b""
            self._reply(*server.handle(self.command, key, body))

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_DELETE = do_POST = _serve

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


def main(argv: list[str] | None = None) -> int:
    """The `mooncake_http_metadata_server` console script."""
    parser = argparse.ArgumentParser(
        description="HTTP metadata server for Mooncake Transfer Engines (upstream's protocol)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=8080, help="Port to listen on")
    parser.add_argument("--host", default="0.0.0.0", help="Host to bind to")
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="INFO",
        help="Logging level",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s"
    )
    try:
        server = MetadataServer(args.port, args.host).start()
    except OSError as e:
        parser.exit(
            1, f"mooncake_http_metadata_server: cannot listen on {args.host}:{args.port}: {e}\n"
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"HTTP metadata server listening on {server.host}:{server.port}", flush=True)
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A small etcd v3 client over etcd's JSON gateway (`/v3/...`, served by every etcd >= 3.4
on its client URL): keys and values travel base64-encoded, 64-bit integers as strings.
Only what the masters need: get / get_prefix, a transaction (compare, then puts and
deletes), leases (grant, keep alive, revoke).

Each thread keeps its own HTTP/1.1 connection to each endpoint, kept alive; a request is
one `sendall`, its reply (Content-Length or chunked) parsed here, and bodies are encoded
and decoded by msgspec (bytes become base64 in its encoder). A journal transaction is the
master's hot path under HA (store/metadata/groupcommit.py): this costs it a fraction of
what a general HTTP client did per call (httpx; `python -m mooncake.bench.etcdtxn`). A
connection the server closed while idle is seen before a request is sent on it (its
socket reports the hang-up) and replaced; a call that fails after it was sent is not
sent again on that endpoint (the next endpoint is tried, as for one that does not answer).

    etcd = Etcd(["http://127.0.0.1:2379"], timeout_s=2.0)
    lease = etcd.grant(ttl_s=3)
    ok = etcd.txn([Compare.absent("k")], [Put("k", b"v", lease)])

A call tries each endpoint in turn; EtcdError when none answers, naming them.

`EtcdAccess` says how the client proves who it is: with a user, it takes a token from
etcd's v3 auth (`/v3/auth/authenticate`) and sends it in the `Authorization` header of
every call, taking a new one when etcd says it expired; over `https://` it checks etcd's
certificate against a CA file and may present a client certificate (TLS settings come as
an `ssl.SSLContext`, see ha/etcdaccess.py, which builds both from `[cluster]`).
"""

from __future__ import annotations

import base64
import http.client
import logging
import select
import socket
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from mooncake.errors import MooncakeError

log = logging.getLogger(__name__)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_RECV_BYTES = 256 << 10
_MAX_HEAD_BYTES = 64 << 10  # of a reply's head, or of a chunk's size line


class EtcdError(MooncakeError):
    """etcd did not answer, or refused a call."""


@dataclass(frozen=True)
class EtcdAccess:
    """Credentials of an etcd client; the defaults: no auth, system CAs for https."""

    user: str = ""  # "" = etcd runs without auth
    password: str = ""
    tls: ssl.SSLContext | None = None  # CA and client certificate for https:// endpoints


_EXPIRED = "invalid auth token"  # etcd's message (code 16, HTTP 401) for an expired token


def _raw(data: str | bytes) -> bytes:
    """NOTE: msgspec's JSON encoder writes bytes as base64, as the gateway wants them"""
    return data.encode() if isinstance(data, str) else data


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    assert raw, f"no range end for prefix {prefix!r}"
    raw[-1] += 1
    return bytes(raw)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    lease: int  # 0 = none


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    is_prefix: bool = False


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction, on one key."""

    key: str
    target: str  # "VALUE" | "CREATE"
    value: bytes = b""
    create_revision: int = 0

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "CREATE", create_revision=0)

    @staticmethod
    def equals(key: str, value: bytes) -> Compare:
        return Compare(key, "VALUE", value=value)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": _raw(self.key), "target": self.target, "result": "EQUAL"}
        if self.target == "VALUE":
            out["value"] = self.value
        else:
            out["create_revision"] = str(self.create_revision)
        return out


@dataclass(frozen=True)
class _Endpoint:
    url: str  # as configured, for messages
    is_tls: bool
    host: str
    port: int
    path: str  # before /v3/... ("" mostly)

    @staticmethod
    def parse(url: str) -> _Endpoint:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise EtcdError(
                f"etcd endpoint {url!r}: expected a client URL http://host:port or "
                "https://host:port"
            )
        is_tls = parts.scheme == "https"
        return _Endpoint(url, is_tls, parts.hostname, port or (443 if is_tls else 80), parts.path)


class _Conn:
    """A kept-alive HTTP/1.1 connection of one thread to one endpoint: one `sendall` per
    request (head and body together), the reply read with as few `recv`s as it takes."""

    def __init__(self, endpoint: _Endpoint, timeout_s: float, tls: ssl.SSLContext | None):
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.is_tls:
            assert tls is not None
            try:
                sock = tls.wrap_socket(sock, server_hostname=endpoint.host)
            except BaseException:
                sock.close()
                raise
        self.sock = sock
        self.is_closed = False
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        self._head = (
            f"HTTP/1.1\r\nHost: {host}:{endpoint.port}\r\nContent-Type: application/json\r\n"
        )
        self._buf = bytearray()
        # NOTE: not POLLIN: over TLS 1.3 the server's session tickets arrive while idle
        self.idle = select.poll()  # hung up between calls: the server closed it
        self.idle.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)

    def is_stale(self) -> bool:
        """Closed here (`Etcd.close`, from any thread) or by the server while idle."""
        return self.is_closed or bool(self.idle.poll(0))

    def close(self) -> None:
        self.is_closed = True  # NOTE: before the fd goes: it may be reused at once
        self.sock.close()

    def post(self, path: str, payload: bytes, token: str) -> tuple[int, bytes, bool]:
        """(HTTP status, body, whether the server closes the connection after it)."""
        auth = f"Authorization: {token}\r\n" if token else ""
        head = f"POST {path} {self._head}{auth}Content-Length: {len(payload)}\r\n\r\n"
        self.sock.sendall(head.encode() + payload)
        end = self._fill_until(b"\r\n\r\n", 0)
        lines = self._buf[:end].decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise http.client.BadStatusLine(lines[0][:100])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip().lower()
        closes = fields.get("connection") == "close" or version == "HTTP/1.0"
        if "chunked" in fields.get("transfer-encoding", ""):
            body = self._chunked()
        elif "content-length" in fields:
            body = self._take(int(fields["content-length"]))
        else:  # the body runs to the end of the connection
            while chunk := self.sock.recv(_RECV_BYTES):
                self._buf += chunk
            body, closes = bytes(self._buf), True
            self._buf.clear()
        if self._buf:  # more than the reply: not HTTP as we speak it
            raise http.client.HTTPException(f"{len(self._buf)} bytes after the reply")
        return int(code), body, closes

    def _recv(self) -> None:
        chunk = self.sock.recv(_RECV_BYTES)
        if not chunk:
            raise http.client.RemoteDisconnected("etcd closed the connection mid-reply")
        self._buf += chunk

    def _fill_until(self, mark: bytes, start: int) -> int:
        """The offset of `mark` in the buffer at or after `start`, receiving until it comes."""
        while (at := self._buf.find(mark, start)) < 0:
            if len(self._buf) > _MAX_HEAD_BYTES + start:
                raise http.client.HTTPException("a reply's head or chunk line is too long")
            self._recv()
        return at

    def _take(self, num: int) -> bytes:
        while len(self._buf) < num:
            self._recv()
        out = bytes(self._buf[:num])
        del self._buf[:num]
        return out

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            end = self._fill_until(b"\r\n", 0)
            size = int(self._buf[:end].split(b";", 1)[0], 16)
            del self._buf[: end + 2]
            if size == 0:
                while (end := self._fill_until(b"\r\n", 0)) > 0:  # trailers, then a blank
                    del self._buf[: end + 2]
                del self._buf[:2]
                return bytes(out)
            out += self._take(size + 2)[:size]


class Etcd:
    """A blocking client of one etcd cluster (thread-safe: each thread has its own
    connections)."""

    def __init__(
        self, endpoints: Sequence[str], timeout_s: float, access: EtcdAccess = EtcdAccess()
    ):
        assert endpoints, "no etcd endpoints"
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self._targets = [_Endpoint.parse(e) for e in self.endpoints]
        self.access = access
        self.timeout_s = timeout_s  # s a call may take (per endpoint)
        self._tls = access.tls
        if self._tls is None and any(t.is_tls for t in self._targets):
            self._tls = ssl.create_default_context()  # the system's CAs
        self._local = threading.local()  # .conns: this thread's connection per endpoint
        self._conns: set[_Conn] = set()  # every thread's, for close
        self._conns_lock = threading.Lock()
        self._first = 0  # the endpoint that answered last
        self._token = ""  # of etcd's v3 auth; "" = none taken yet
        self._token_lock = threading.Lock()

    def close(self) -> None:
        """Close every thread's connections (a later call opens new ones)."""
        with self._conns_lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            conn.close()

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to `path` on the first endpoint that answers; its JSON reply. With a
        user, authenticates first, and once more when etcd says the token expired."""
        if not self.access.user:
            return self._post(path, body, "")
        token = self._token or self._authenticate("")
        try:
            return self._post(path, body, token)
        except EtcdError as e:
            if _EXPIRED not in str(e):
                raise
        return self._post(path, body, self._authenticate(token))

    def _authenticate(self, stale: str) -> str:
        """A fresh token in place of `stale` (one thread asks etcd; the others reuse it)."""
        with self._token_lock:
            if self._token == stale:
                creds = {"name": self.access.user, "password": self.access.password}
                try:
                    self._token = str(self._post("/v3/auth/authenticate", creds, "")["token"])
                except KeyError:
                    raise EtcdError(
                        "etcd gave no auth token: its auth is not enabled; leave "
                        "cluster.etcd_user empty or enable etcd's auth"
                    ) from None
            return self._token

    def _post(self, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
        errors = []
        n = len(self.endpoints)
        payload = msgspec.json.encode(body)
        for i in range(n):
            at = (self._first + i) % n
            url = self.endpoints[at]
            try:
                status, raw = self._request(at, path, payload, token)
            except (OSError, http.client.HTTPException, ValueError) as e:
                errors.append(f"{url}: {e or type(e).__name__}")
                continue
            self._first = at
            try:
                data = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                data = None
            if status != 200 or not isinstance(data, dict) or "error" in data:
                said = data.get("message") if isinstance(data, dict) else None
                text = said or raw.decode(errors="replace")[:300] or f"HTTP {status}"
                raise EtcdError(f"etcd {url}{path}: {text}{_hint(data, token)}")
            return data
        raise EtcdError(
            f"no etcd endpoint answered ({'; '.join(errors)}); check cluster.etcd and that "
            "etcd runs"
        )

    def _request(self, at: int, path: str, payload: bytes, token: str) -> tuple[int, bytes]:
        """POST on this thread's connection to endpoint `at` (made or remade as needed):
        (HTTP status, body). Raises OSError, HTTPException or ValueError (a bad reply);
        the connection is then dropped."""
        conns: list[_Conn | None] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = [None] * len(self._targets)
        conn = conns[at]
        if conn is not None and conn.is_stale():  # closed while idle: nothing sent on it
            self._drop(conns, at)
            conn = None
        try:
            if conn is None:
                conn = conns[at] = _Conn(self._targets[at], self.timeout_s, self._tls)
                with self._conns_lock:
                    self._conns.add(conn)
            status, raw, closes = conn.post(self._targets[at].path + path, payload, token)
        except BaseException:
            self._drop(conns, at)
            raise
        if closes:
            self._drop(conns, at)
        return status, raw

    def _drop(self, conns: list[_Conn | None], at: int) -> None:
        conn, conns[at] = conns[at], None
        if conn is not None:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    # -- keys --
    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": _raw(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, page: int = 1000) -> list[KeyValue]:
        """Every key under `prefix`, in key order (fetched `page` keys per call)."""
        out: list[KeyValue] = []
        start, end = prefix.encode(), prefix_end(prefix)
        while True:
            body = {"key": start, "range_end": end, "limit": str(page)}
            data = self.call("/v3/kv/range", body)
            kvs = [_kv(kv) for kv in data.get("kvs", [])]
            out += kvs
            if not data.get("more") or not kvs:
                return out
            start = kvs[-1].key.encode() + b"\0"

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _raw(key), "value": value}
        if lease:
            body["lease"] = str(lease)
        self.call("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _raw(key)})

    def txn(
        self, compare: Sequence[Compare], ops: Sequence[Put | Delete], read: str = ""
    ) -> tuple[bool, KeyValue | None]:
        """If every `compare` holds, apply `ops` at once; returns whether they held and, when
        they did not, `read`'s current value (None if absent or not asked)."""
        assert len(ops) <= MAX_TXN_OPS, len(ops)
        body: dict[str, Any] = {
            "compare": [c.body() for c in compare],
            "success": [_op(o) for o in ops],
        }
        if read:
            body["failure"] = [{"request_range": {"key": _raw(read)}}]
        data = self.call("/v3/kv/txn", body)
        if data.get("succeeded"):
            return True, None
        for resp in data.get("responses", []):
            kvs = resp.get("response_range", {}).get("kvs", [])
            if kvs:
                return False, _kv(kvs[0])
        return False, None

    # -- leases --
    def grant(self, ttl_s: float) -> int:
        """A new lease of `ttl_s` (rounded up to whole seconds); its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(max(1, int(-(-ttl_s // 1))))})["ID"])

    def keepalive(self, lease: int) -> bool:
        """Renew `lease`; False if it expired already (it is gone for good)."""
        result = self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        """End `lease` now: its keys go at once (best effort)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            log.info("etcd: revoking lease %x: %s", lease, e)


def _hint(data: object, token: str) -> str:
    """What to do about an error of etcd's auth, for the user."""
    message = str(data.get("message", "")) if isinstance(data, dict) else ""
    if "user name is empty" in message and not token:
        return (
            " (this etcd requires authentication: set cluster.etcd_user and "
            "cluster.etcd_password_file or MOONCAKE_CLUSTER_ETCD_PASSWORD)"
        )
    if "invalid user ID or password" in message:
        return " (check cluster.etcd_user and its password)"
    if "permission denied" in message:
        return " (the etcd user lacks read-write access to cluster.etcd_prefix)"
    return ""


def _kv(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(kv["key"]).decode(),
        value=_unb64(kv.get("value", "")),
        create_revision=int(kv.get("create_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _op(op: Put | Delete) -> dict[str, Any]:
    if isinstance(op, Put):
        body: dict[str, Any] = {"key": _raw(op.key), "value": op.value}
        if op.lease:
            body["lease"] = str(op.lease)
        return {"request_put": body}
    body = {"key": _raw(op.key)}
    if op.is_prefix:
        body["range_end"] = prefix_end(op.key)
    return {"request_delete_range": body}

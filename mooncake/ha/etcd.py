"""A small etcd v3 client over etcd's JSON gateway (`/v3/...`, served by every etcd >= 3.4
on its client URL), with httpx: keys and values travel base64-encoded, 64-bit integers as
strings. Only what the masters need: get / get_prefix, a transaction (compare, then puts
and deletes), leases (grant, keep alive, revoke).

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
import logging
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from mooncake.errors import MooncakeError

log = logging.getLogger(__name__)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


class EtcdError(MooncakeError):
    """etcd did not answer, or refused a call."""


@dataclass(frozen=True)
class EtcdAccess:
    """Credentials of an etcd client; the defaults: no auth, system CAs for https."""

    user: str = ""  # "" = etcd runs without auth
    password: str = ""
    tls: ssl.SSLContext | None = None  # CA and client certificate for https:// endpoints


_EXPIRED = "invalid auth token"  # etcd's message (code 16, HTTP 401) for an expired token


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


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
        out: dict[str, Any] = {"key": _b64(self.key), "target": self.target, "result": "EQUAL"}
        if self.target == "VALUE":
            out["value"] = _b64(self.value)
        else:
            out["create_revision"] = str(self.create_revision)
        return out


class Etcd:
    """A blocking client of one etcd cluster (thread-safe: httpx's client is)."""

    def __init__(
        self, endpoints: Sequence[str], timeout_s: float, access: EtcdAccess = EtcdAccess()
    ):
        assert endpoints, "no etcd endpoints"
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.access = access
        self.timeout_s = timeout_s  # s a call may take (per endpoint)
        self._http = httpx.Client(timeout=timeout_s, verify=access.tls or True)
        self._first = 0  # the endpoint that answered last
        self._token = ""  # of etcd's v3 auth; "" = none taken yet
        self._token_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

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
        headers = {"Authorization": token} if token else {}
        for i in range(n):
            url = self.endpoints[(self._first + i) % n]
            try:
                r = self._http.post(url + path, json=body, headers=headers)
            except httpx.HTTPError as e:
                errors.append(f"{url}: {e}")
                continue
            self._first = (self._first + i) % n
            data = r.json()
            if r.status_code != 200 or "error" in data:
                raise EtcdError(
                    f"etcd {url}{path}: {data.get('message') or r.text}{_hint(data, token)}"
                )
            return dict(data)
        raise EtcdError(
            f"no etcd endpoint answered ({'; '.join(errors)}); check cluster.etcd and that "
            "etcd runs"
        )

    # -- keys --
    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, page: int = 1000) -> list[KeyValue]:
        """Every key under `prefix`, in key order (fetched `page` keys per call)."""
        out: list[KeyValue] = []
        start, end = prefix.encode(), prefix_end(prefix)
        while True:
            body = {"key": _b64(start), "range_end": _b64(end), "limit": str(page)}
            data = self.call("/v3/kv/range", body)
            kvs = [_kv(kv) for kv in data.get("kvs", [])]
            out += kvs
            if not data.get("more") or not kvs:
                return out
            start = kvs[-1].key.encode() + b"\0"

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

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
            body["failure"] = [{"request_range": {"key": _b64(read)}}]
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


def _hint(data: dict[str, Any], token: str) -> str:
    """What to do about an error of etcd's auth, for the user."""
    message = str(data.get("message", ""))
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
        body: dict[str, Any] = {"key": _b64(op.key), "value": _b64(op.value)}
        if op.lease:
            body["lease"] = str(op.lease)
        return {"request_put": body}
    body = {"key": _b64(op.key)}
    if op.is_prefix:
        body["range_end"] = _b64(prefix_end(op.key))
    return {"request_delete_range": body}

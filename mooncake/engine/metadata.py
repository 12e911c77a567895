"""Where upstream's API finds a peer named by `target_hostname`: its metadata service.

    "P2PHANDSHAKE"                       the name is the peer's "ip:port" (its get_rpc_port)
    "http://host:port/metadata"          upstream's HTTP metadata server (ours:
                                         `mooncake_http_metadata_server`, engine/httpmeta.py)
    "etcd://host:2379" or "host:2379"    etcd (several endpoints separated by "," or ";")

With a metadata service, an engine publishes its name -> {"ip_or_host_name", "rpc_port"}
under upstream's key `mooncake/rpc_meta/<name>` (transfer_metadata.cpp's rpc_meta prefix)
and peers look names up there. Segment descriptors are not published: a peer's buffers are
asked of the peer itself over the authenticated data plane (transfer/addrindex.py), so an
entry in the metadata service only says where to connect; the connection still has to
pass the cluster-secret handshake.
"""

from __future__ import annotations

import json
import logging

import httpx

from mooncake.errors import ConfigError, TransferError
from mooncake.ha.etcd import Etcd, EtcdError

log = logging.getLogger(__name__)

P2PHANDSHAKE = "P2PHANDSHAKE"
RPC_META_PREFIX = "mooncake/rpc_meta/"
TIMEOUT_S = 3.0  # s a metadata call may take (upstream's HTTP plugin: 3 s)


def split_host_port(name: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; raises TransferError otherwise."""
    host, sep, port = name.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"peer {name!r}: expected IP:PORT (the peer's get_rpc_port())")
    return host, int(port)


class BaseMetadata:
    """Names of engines -> where their data plane listens."""

    def publish(self, name: str, host: str, port: int) -> None:
        """Say that engine `name` listens at host:port (raises TransferError if refused)."""

    def withdraw(self, name: str) -> None:
        """Remove what publish() said (best effort)."""

    def resolve(self, name: str) -> tuple[str, int]:
        """Where engine `name` listens; raises TransferError if unknown or unreachable."""
        return split_host_port(name)

    def close(self) -> None:
        """Release connections."""


class KeyValueMetadata(BaseMetadata):
    """rpc_meta entries in a key-value service (`get`, `put`, `delete` of bytes)."""

    def get(self, key: str) -> bytes | None:  # pragma: no cover - interface
        raise NotImplementedError

    def put(self, key: str, value: bytes) -> bool:  # pragma: no cover - interface
        """False when the service refuses (e.g. the key exists)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def publish(self, name: str, host: str, port: int) -> None:
        key = RPC_META_PREFIX + name
        entry = {"ip_or_host_name": host, "rpc_port": port}
        if self.put(key, json.dumps(entry).encode()):
            return
        if self._entry(key) == entry:
            return
        raise TransferError(
            f"metadata key {key!r} is held by another engine; if that engine is gone, "
            "delete the key (HTTP metadata server: DELETE /metadata?key=...)"
        )

    def withdraw(self, name: str) -> None:
        try:
            self.delete(RPC_META_PREFIX + name)
        except TransferError as e:
            log.warning("could not withdraw %r from the metadata service: %s", name, e)

    def resolve(self, name: str) -> tuple[str, int]:
        entry = self._entry(RPC_META_PREFIX + name)
        if entry is None:
            raise TransferError(f"peer {name!r} is not registered in the metadata service")
        host, port = entry.get("ip_or_host_name"), entry.get("rpc_port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise TransferError(f"peer {name!r}: malformed metadata entry {entry!r}")
        return host, port

    def _entry(self, key: str) -> dict | None:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise TransferError(f"metadata key {key!r} holds no JSON: {e}") from e
        return value if isinstance(value, dict) else None


class HttpMetadata(KeyValueMetadata):
    """Upstream's HTTP metadata protocol: GET/PUT/DELETE `<url>?key=<key>`."""

    def __init__(self, url: str):
        self.url = url
        self._http = httpx.Client(timeout=TIMEOUT_S)

    def _call(self, method: str, key: str, body: bytes | None = None) -> httpx.Response:
        try:
            return self._http.request(method, self.url, params={"key": key}, content=body)
        except httpx.HTTPError as e:
            raise TransferError(f"metadata server {self.url}: {e}") from e

    def get(self, key: str) -> bytes | None:
        r = self._call("GET", key)
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise TransferError(f"metadata server {self.url}: GET {key!r}: HTTP {r.status_code}")
        return r.content

    def put(self, key: str, value: bytes) -> bool:
        return self._call("PUT", key, value).status_code == 200

    def delete(self, key: str) -> None:
        self._call("DELETE", key)

    def close(self) -> None:
        self._http.close()


class EtcdMetadata(KeyValueMetadata):
    """rpc_meta entries in etcd (no auth, as upstream's etcd plugin)."""

    def __init__(self, endpoints: list[str]):
        self._etcd = Etcd(endpoints, TIMEOUT_S)

    def get(self, key: str) -> bytes | None:
        try:
            kv = self._etcd.get(key)
        except EtcdError as e:
            raise TransferError(str(e)) from e
        return kv.value if kv is not None else None

    def put(self, key: str, value: bytes) -> bool:
        try:
            self._etcd.put(key, value)
        except EtcdError as e:
            raise TransferError(str(e)) from e
        return True

    def delete(self, key: str) -> None:
        try:
            self._etcd.delete(key)
        except EtcdError as e:
            raise TransferError(str(e)) from e

    def close(self) -> None:
        self._etcd.close()


def connect_metadata(server: str, metadata_type: str = "") -> BaseMetadata:
    """The metadata service named as upstream's initialize() / initialize_ext() name it.
    Raises ConfigError for a kind we do not speak (redis, ...)."""
    if server == P2PHANDSHAKE:
        return BaseMetadata()
    if "://" not in server:
        server = f"{metadata_type or 'etcd'}://{server}"
    scheme, _, rest = server.partition("://")
    if scheme == "p2p":
        return BaseMetadata()
    if scheme in ("http", "https"):
        return HttpMetadata(server)
    if scheme == "etcd":
        hosts = [h for h in rest.replace(";", ",").split(",") if h]
        if not hosts:
            raise ConfigError(f"metadata server {server!r}: no etcd endpoint")
        return EtcdMetadata([f"http://{h}" for h in hosts])
    raise ConfigError(
        f"metadata server {server!r}: {scheme!r} is not supported; use P2PHANDSHAKE, "
        "http://HOST:PORT/metadata or etcd://HOST:PORT"
    )

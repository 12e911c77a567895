"""Sealed etcd values: every value a master writes in etcd (its member and leader records,
the pool's journal entries) carries a MAC keyed by the cluster secret, so a value written
by anyone else who can reach etcd is told apart and never trusted.

    sealer = Sealer(secret)
    etcd.put(key, sealer.seal(key, payload, lease), lease)
    payload = sealer.open(etcd.get(key))     # ForgedRecord if not sealed for this key+lease

A value is `b"mc1"`, then HMAC-SHA256(key', key | lease | payload) (32 bytes), then the
payload; key' is derived from the cluster secret for this one use. The MAC covers the etcd
key and the lease the value is held under, so a genuine value copied to another key, or
put again without its lease (where it would outlive its master), fails as a forgery does.
A genuine value put back at its own key after it changed (a replay) is not detected.
"""

from __future__ import annotations

import hashlib
import hmac

from mooncake.errors import MooncakeError
from mooncake.ha.etcd import KeyValue

MAGIC = b"mc1"
MAC_BYTES = 32


class ForgedRecord(MooncakeError):
    """An etcd value under this cluster's prefix was not written by one of its masters."""


class Sealer:
    """Seals and opens values with a key derived from the cluster secret (no state)."""

    def __init__(self, secret: bytes):
        assert secret, "no cluster secret"
        self._key = hmac.new(secret, b"mooncake etcd values", hashlib.sha256).digest()

    def _mac(self, key: str, lease: int, payload: bytes) -> bytes:
        head = key.encode() + b"\0" + lease.to_bytes(8, "big")
        return hmac.new(self._key, head + payload, hashlib.sha256).digest()

    def seal(self, key: str, payload: bytes, lease: int = 0) -> bytes:
        """The value to put at `key` under `lease` (0 = none)."""
        return MAGIC + self._mac(key, lease, payload) + payload

    def open(self, kv: KeyValue) -> bytes:
        """The payload of `kv`; raises ForgedRecord naming the key when it is not sealed
        with this cluster's secret for this key and lease."""
        value = kv.value
        if not value.startswith(MAGIC) or len(value) < len(MAGIC) + MAC_BYTES:
            raise ForgedRecord(
                f"etcd key {kv.key} holds a value no master of this cluster wrote (not sealed)"
            )
        mac, payload = value[len(MAGIC) : len(MAGIC) + MAC_BYTES], value[len(MAGIC) + MAC_BYTES :]
        if not hmac.compare_digest(mac, self._mac(kv.key, kv.lease, payload)):
            raise ForgedRecord(
                f"etcd key {kv.key} holds a value whose seal does not match this cluster's "
                f"secret, key and lease {kv.lease:x} (forged, replayed, or a master with "
                "another cluster.secret)"
            )
        return payload

"""The engine's KV source and sink over the cluster's Store (`store.client.Store`).

One pool object per block, under `kv_key(block_hash)`; the hash already covers the
model fingerprint, the cluster seed and the tenant salt, so keys never collide across
models. Writing reuses `DramKVPool`'s layer-wise builders (a writer thread copies each
finished layer into the object while the next one computes); a completed object is put
into the Store in one batch at commit, into DRAM, or SSD when DRAM cannot make room at
once (`PUT_TIERS`). Reading asks the master which leading blocks exist (one call) and
fetches them in one batch, from whichever tier holds each (SSD replicas are read where
they are); the prefill runner validates every object.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from mooncake.engine.kvio import Buffer, DramKVPool
from mooncake.engine.kvobject import KVLayout
from mooncake.errors import MooncakeError
from mooncake.store.client import Store

log = logging.getLogger(__name__)
KEY_PREFIX = "kv/"
# NOTE: DRAM first; the master drops copies there to make room at once, and a block goes
# to SSD only when it cannot (its victims are not copied yet): a block is never dropped
PUT_TIERS = ("dram", "ssd")


def kv_key(block_hash: int) -> str:
    return f"{KEY_PREFIX}{block_hash:032x}"


def parse_kv_key(key: str) -> int | None:
    """The block hash a pool key names, or None for a key that is not a KV block."""
    if not key.startswith(KEY_PREFIX) or len(key) != len(KEY_PREFIX) + 32:
        return None
    try:
        return int(key[len(KEY_PREFIX) :], 16)
    except ValueError:
        return None


class StoreKVPool(DramKVPool):
    """`BaseKVSource` + `BaseKVSink` backed by the distributed Store."""

    def __init__(self, store: Store, layout: KVLayout, fingerprint: bytes, replicas: int = 0):
        super().__init__(layout, fingerprint)
        self.store = store
        self.replicas = replicas  # copies per object; 0 = the master's default
        self.num_put_failures = 0  # objects the Store refused or failed to write

    def insert(self, objects: list[tuple[int, bytearray]]) -> None:
        """Put completed objects (called on the writer thread at commit)."""
        with self._lock:
            for h, _ in objects:
                self._pending.pop(h, None)
        if not objects:
            return
        keys = [kv_key(h) for h, _ in objects]
        values = [memoryview(data) for _, data in objects]
        results = self.store.put_batch(keys, values, replicas=self.replicas, tiers=PUT_TIERS)
        # exists / busy: the block is (being) stored by another writer already
        failed = [r for r in results if r.status not in ("ok", "exists", "busy")]
        if failed:
            self.num_put_failures += len(failed)
            counts = Counter(r.status for r in failed)
            log.warning(
                "%d of %d KV blocks not stored (%s; %d so far), e.g. %s: %s",
                len(failed),
                len(results),
                ", ".join(f"{n} {status}" for status, n in counts.items()),
                self.num_put_failures,
                failed[0].key,
                failed[0].message,
            )

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        if not block_hashes:
            return 0
        try:
            found = self.store.exists_batch([kv_key(h) for h in block_hashes])
        except MooncakeError as e:  # the pool being unreachable is a miss, not a failure
            log.warning("prefix lookup failed, recomputing: %s", e)
            return 0
        return next((i for i, ok in enumerate(found) if not ok), len(found))

    def fetch(self, block_hashes: Sequence[int]) -> list[Buffer | None]:
        try:
            results = self.store.get_batch([kv_key(h) for h in block_hashes])
        except MooncakeError as e:
            log.warning("prefix fetch failed, recomputing: %s", e)
            return [None] * len(block_hashes)
        return [r.value if r.status == "ok" else None for r in results]

    def discard(self, block_hash: int) -> None:
        try:
            self.store.remove(kv_key(block_hash))
        except MooncakeError as e:
            log.warning("could not drop bad KV block %032x: %s", block_hash, e)

"""The engine's KV source and sink over the cluster's Store (`store.client.Store`).

One pool object per block, under `kv_key(block_hash)`; the hash already covers the
model fingerprint, the cluster seed and the tenant salt, so keys never collide across
models. Writing builds objects layer by layer with a `LayerWriter` (kv/layerio.py: its
thread copies each finished layer into the object while the next one computes); a
completed object is put into the Store in one batch at commit, into DRAM, or SSD when
DRAM cannot make room at once (`PUT_TIERS`). Reading asks the master which leading
blocks exist (one call) and fetches them in one batch, from whichever tier holds each
(SSD replicas are read where they are); the prefill runner validates every object.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from mooncake.errors import MooncakeError, StoreError, TransferError
from mooncake.kv.keys import kv_key
from mooncake.kv.layerio import (
    BaseKVPut,
    BaseKVSink,
    BaseKVSource,
    Buffer,
    BuiltObjects,
    LayerWriter,
)
from mooncake.kv.object import KVLayout, object_head
from mooncake.kv.stream import PoolTarget
from mooncake.store.client.client import Store
from mooncake.store.metadata.objects import KeyResult, PutStartResult
from mooncake.store.node.node import remote_name
from mooncake.transfer import TransferRequest
from mooncake.transfer.types import TransferOp

log = logging.getLogger(__name__)
# NOTE: DRAM first; the master drops copies there to make room at once, and a block goes
# to SSD only when it cannot (its victims are not copied yet): a block is never dropped
PUT_TIERS = ("dram", "ssd")


class StoreKVPool(BaseKVSource, BaseKVSink):
    """`BaseKVSource` + `BaseKVSink` backed by the distributed Store."""

    def __init__(self, store: Store, layout: KVLayout, fingerprint: bytes, replicas: int = 0):
        self.layout = layout
        self.fingerprint = fingerprint
        self._writer = LayerWriter(layout, fingerprint, self.insert)
        self.store = store
        self.replicas = replicas  # copies per object; 0 = the master's default
        self.num_put_failures = 0  # objects the Store refused or failed to write
        self._heads_name = f"{store.node_id}.kvheads"
        self._heads: np.ndarray | None = None  # registered staging of object heads
        self._heads_lock = threading.Lock()

    def close(self) -> None:
        self._writer.close()

    def begin(
        self, block_hashes: Sequence[int], token_blocks: Sequence[Sequence[int]]
    ) -> BaseKVPut:
        return self._writer.begin(block_hashes, token_blocks)

    def insert(self, objects: BuiltObjects) -> None:
        """Put completed objects (called on the writer thread at commit)."""
        self._writer.built(h for h, _ in objects)
        if not objects:
            return
        keys = [kv_key(h) for h, _ in objects]
        values = [memoryview(data) for _, data in objects]
        results = self.store.put_batch(keys, values, replicas=self.replicas, tiers=PUT_TIERS)
        # exists / busy: the block is (being) stored by another writer already
        failed = [r for r in results if r.status not in ("ok", "exists", "busy")]
        if failed:
            self._count_failures(failed, len(results))

    def _count_failures(self, failed: Sequence[KeyResult | PutStartResult], total: int) -> None:
        self.num_put_failures += len(failed)
        counts = Counter(r.status for r in failed)
        log.warning(
            "%d of %d KV blocks not stored (%s; %d so far), e.g. %s: %s",
            len(failed),
            total,
            ", ".join(f"{n} {status}" for status, n in counts.items()),
            self.num_put_failures,
            failed[0].key,
            failed[0].message,
        )

    # -- objects written in place by the stages of a group -----------------------------
    def start_objects(self, block_hashes: Sequence[int], first_block: int) -> list[PoolTarget]:
        """Start the puts of blocks first_block, first_block+1, ... (their hashes); returns
        the ones this prompt writes (a block stored or being stored already is skipped)."""
        if not block_hashes:
            return []
        size = self.layout.object_bytes
        try:
            keys = [kv_key(h) for h in block_hashes]
            results = self.store.start_puts(keys, size, replicas=self.replicas, tiers=PUT_TIERS)
        except MooncakeError as e:  # the pool being unreachable: nothing stored, no failure
            log.warning("KV blocks not stored: %s", e)
            return []
        bad = [r for r in results if r.status not in ("ok", "exists", "busy")]
        if bad:
            self._count_failures(bad, len(results))
        return [
            PoolTarget(block=first_block + i, replicas=list(r.replicas))
            for i, r in enumerate(results)
            if r.status == "ok"
        ]

    def seal_objects(
        self,
        targets: Sequence[PoolTarget],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        digests: dict[int, list[int]],
    ) -> int:
        """Every layer of every target is written (`digests`: layer -> digest per target):
        write each object's head into its replicas and commit; returns objects stored."""
        if not targets:
            return 0
        lay, bt = self.layout, self.layout.block_tokens
        if sorted(digests) != list(range(lay.num_layers)):
            self.revoke_objects(targets, block_hashes)
            raise StoreError(
                f"KV objects not sealed: digests of layers {sorted(digests)} of {lay.num_layers}"
            )
        head_bytes = lay.payload_offset
        with self._heads_lock:
            if self._heads is None or len(self._heads) < head_bytes * len(targets):
                if self._heads is not None:
                    self.store.engine.unregister(self._heads_name)
                size = 1 << (head_bytes * len(targets) - 1).bit_length()
                self._heads = self.store.engine.allocate(self._heads_name, size)
            reqs: list[TransferRequest] = []
            for i, t in enumerate(targets):
                b = t.block
                head = object_head(
                    lay,
                    self.fingerprint,
                    block_hashes[b],
                    token_ids[b * bt : (b + 1) * bt],
                    [digests[layer][i] for layer in range(lay.num_layers)],
                )
                self._heads[i * head_bytes : (i + 1) * head_bytes] = np.frombuffer(head, np.uint8)
                for d in t.replicas:
                    reqs.append(
                        TransferRequest(
                            TransferOp.WRITE,
                            self._heads_name,
                            i * head_bytes,
                            remote_name(d.segment, d.endpoint),
                            d.offset,
                            head_bytes,
                            d.token,
                        )
                    )
            try:
                self.store.engine.transfer(reqs, self.store.timeout_s).check()
            except TransferError:
                self.revoke_objects(targets, block_hashes)
                raise
        keys = [kv_key(block_hashes[t.block]) for t in targets]
        results = self.store.end_puts(keys, [t.replicas for t in targets])
        return sum(r.status == "ok" for r in results)

    def revoke_objects(self, targets: Sequence[PoolTarget], block_hashes: Sequence[int]) -> None:
        """Drop the uncommitted puts of `targets` (a failed or abandoned prompt)."""
        if targets:
            self.store.revoke_puts([kv_key(block_hashes[t.block]) for t in targets])

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

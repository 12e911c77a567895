"""One engine step's KV moves between the pool and vLLM's paged cache (paged.py).

- `Loads`: one lookup for every block the step loads, the objects' heads read and checked
  (block hash, token ids, checksum), then every layer's reads in flight at once, straight
  into vLLM's blocks; `wait(l)` waits for layer l and checks each block against the
  layer's digest. A block that fails cuts its request's run there: it and every later
  block of the run are reported (`failed_block_ids`) and vLLM recomputes them.
- `Saves`: the step's new full blocks started as in-place puts (`StoreKVPool`); each layer
  written from vLLM's blocks as soon as it is computed, its digest taken there; `finish`
  writes the heads and commits the objects, or revokes those that failed or that belong to
  a request whose load failed (their KV was computed on a bad prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import numpy as np

from mooncake.errors import MooncakeError
from mooncake.integrations.vllm.paged import PagedCache
from mooncake.integrations.vllm.plan import BlockRun
from mooncake.kv.keys import kv_key
from mooncake.kv.object import KVObjectError, decode_kv_head
from mooncake.kv.pool import StoreKVPool
from mooncake.store.client.datapath import ReadPlan
from mooncake.store.metadata.objects import ReplicaDesc
from mooncake.transfer import Batch, TransferRequest
from mooncake.transfer.types import TransferOp, TransferState

log = logging.getLogger(__name__)


class HeadBuffer:
    """A registered buffer the heads of a step's objects are read into; grows."""

    def __init__(self, pool: StoreKVPool):
        self.engine, self.name = pool.store.engine, f"{pool.store.node_id}.vllm-heads"
        self.array: np.ndarray | None = None

    def ensure(self, num_bytes: int) -> np.ndarray:
        if self.array is None or len(self.array) < num_bytes:
            if self.array is not None:
                self.engine.unregister(self.name)
            self.array = self.engine.allocate(self.name, 1 << max(num_bytes - 1, 1).bit_length())
        return self.array


class Loads:
    """A step's loads (module docstring); every block the pool lost is reported, none is
    ever left holding bytes that were not checked."""

    def __init__(
        self, cache: PagedCache, pool: StoreKVPool, heads: HeadBuffer, runs: Sequence[BlockRun]
    ) -> None:
        self.cache, self.pool, self.runs = cache, pool, list(runs)
        self.cut = [len(r.block_ids) for r in self.runs]  # per run: blocks before it are good
        self._layers: list[tuple[Batch, list[tuple[int, int]]] | None] = []
        self._digests: dict[tuple[int, int], np.ndarray] = {}  # (run, block) -> per layer
        self._waited: set[int] = set()
        self._start(heads)

    def _fail(self, run: int, block: int, why: str) -> None:
        if block < self.cut[run]:
            self.cut[run] = block
            log.warning(
                "pool KV of request %s not loaded from block %d: %s",
                self.runs[run].req_id,
                block,
                why,
            )

    def _start(self, heads: HeadBuffer) -> None:
        store, lay = self.pool.store, self.cache.layout
        todo = [(i, j) for i, run in enumerate(self.runs) for j in range(len(run.block_ids))]
        keys = [kv_key(self.runs[i].block_hashes[j]) for i, j in todo]
        try:
            found = store.locate_batch(keys)
        except MooncakeError as e:
            for i in range(len(self.runs)):
                self._fail(i, 0, f"lookup failed: {e}")
            return
        head_bytes = lay.payload_offset
        buf = heads.ensure(head_bytes * len(todo))
        plan: ReadPlan = [
            (r.key, r.replicas, heads.name, n * head_bytes, head_bytes)
            for n, r in enumerate(found)
            if r.replicas
        ]
        failed, moved = store.data.read_many(plan)
        replica: dict[tuple[int, int], ReplicaDesc] = {}
        for n, ((i, j), r) in enumerate(zip(todo, found, strict=True)):
            if j >= self.cut[i]:
                continue
            if not r.replicas or r.key in failed:
                self._fail(i, j, failed.get(r.key, r.message or r.status))
                continue
            run, bt = self.runs[i], lay.block_tokens
            try:
                _, _, digests = decode_kv_head(
                    buf[n * head_bytes : (n + 1) * head_bytes].data,
                    lay,
                    self.pool.fingerprint,
                    block_hash=run.block_hashes[j],
                    token_ids=run.token_ids[j * bt : (j + 1) * bt],
                )
            except KVObjectError as e:
                self._fail(i, j, str(e))
                continue
            self._digests[i, j] = digests.copy()
            replica[i, j] = moved.get(r.key, r.replicas[0])
        for layer in range(lay.num_layers):
            reqs: list[TransferRequest] = []
            owners: list[tuple[int, int]] = []
            for (i, j), d in replica.items():
                if j < self.cut[i]:
                    got = self.cache.requests(TransferOp.READ, layer, self.runs[i].block_ids[j], d)
                    reqs += got
                    owners += [(i, j)] * len(got)
            self._layers.append(self._submit(reqs, owners))

    def _submit(
        self, reqs: list[TransferRequest], owners: list[tuple[int, int]]
    ) -> tuple[Batch, list[tuple[int, int]]] | None:
        if not reqs:
            return None
        try:
            return self.pool.store.engine.submit(reqs, self.pool.store.timeout_s), owners
        except MooncakeError as e:
            for i, j in owners:
                self._fail(i, j, f"reads not started: {e}")
            return None

    def wait(self, layer: int) -> None:
        """Layer `layer` of every block landed and checked (or cut off); idempotent."""
        if layer in self._waited or layer >= len(self._layers):
            return
        self._waited.add(layer)
        entry = self._layers[layer]
        if entry is None:
            return
        batch, owners = entry
        for st, (i, j) in zip(batch.wait(), owners, strict=True):
            if st.state is not TransferState.DONE:
                self._fail(i, j, f"layer {layer}: {st.state.value} {st.reason}")
        blocks = dict.fromkeys(owners)
        for i, j in blocks:
            if j < self.cut[i]:
                got = self.cache.digest(layer, self.runs[i].block_ids[j])
                if got != int(self._digests[i, j][layer]):
                    self._fail(i, j, f"layer {layer} does not match its digest")

    def finish(self) -> set[int]:
        """Wait for every layer; the vLLM block ids that did not load (vLLM recomputes)."""
        for layer in range(len(self._layers)):
            self.wait(layer)
        return {
            b for run, cut in zip(self.runs, self.cut, strict=True) for b in run.block_ids[cut:]
        }

    @property
    def failed_req_ids(self) -> set[str]:
        return {
            r.req_id for r, cut in zip(self.runs, self.cut, strict=True) if cut < len(r.block_ids)
        }


class Saves:
    """A step's saves (module docstring)."""

    def __init__(self, cache: PagedCache, pool: StoreKVPool, runs: Sequence[BlockRun]):
        self.cache, self.pool = cache, pool
        self.block_hashes = [h for r in runs for h in r.block_hashes]
        self.block_ids = [b for r in runs for b in r.block_ids]
        self.req_ids = [r.req_id for r in runs for _ in r.block_ids]
        self.token_ids = [t for r in runs for t in r.token_ids]
        self.targets = pool.start_objects(self.block_hashes, 0)  # NOTE: [] if unreachable
        self._digests: dict[int, list[int]] = {}  # layer -> digest per target
        self._batches: list[Batch] = []
        self._owners: list[list[int]] = []  # per batch: the target of each request
        self._bad: set[int] = set()  # targets whose writes failed

    def layer(self, layer: int) -> None:
        """Write layer `layer` of every target (just computed) into its replicas."""
        if not self.targets or layer in self._digests:
            return
        reqs: list[TransferRequest] = []
        owners: list[int] = []
        digests = []
        for n, t in enumerate(self.targets):
            block_id = self.block_ids[t.block]
            digests.append(self.cache.digest(layer, block_id))
            for d in t.replicas:
                got = self.cache.requests(TransferOp.WRITE, layer, block_id, d)
                reqs += got
                owners += [n] * len(got)
        self._digests[layer] = digests
        try:
            self._batches.append(self.pool.store.engine.submit(reqs, self.pool.store.timeout_s))
            self._owners.append(owners)
        except MooncakeError as e:
            log.warning("KV blocks not stored: layer %d writes not started: %s", layer, e)
            self._bad.update(owners)

    def finish(self, skip_req_ids: Collection[str] = ()) -> int:
        """Commit every target fully written whose request is not in `skip_req_ids`;
        revoke the rest. Returns the objects committed."""
        if not self.targets:
            return 0
        for batch, owners in zip(self._batches, self._owners, strict=True):
            for st, n in zip(batch.wait(), owners, strict=True):
                if st.state is not TransferState.DONE:
                    self._bad.add(n)
        if len(self._digests) != self.cache.layout.num_layers:  # a layer never saved
            self._bad.update(range(len(self.targets)))
        keep = [
            n
            for n, t in enumerate(self.targets)
            if n not in self._bad and self.req_ids[t.block] not in skip_req_ids
        ]
        drop = [t for n, t in enumerate(self.targets) if n not in keep]
        self.pool.revoke_objects(drop, self.block_hashes)
        if not keep:
            return 0
        digests = {layer: [d[n] for n in keep] for layer, d in self._digests.items()}
        kept = [self.targets[n] for n in keep]
        try:
            return self.pool.seal_objects(kept, self.block_hashes, self.token_ids, digests)
        except MooncakeError as e:
            log.warning("%d KV blocks not stored: %s", len(kept), e)
            return 0

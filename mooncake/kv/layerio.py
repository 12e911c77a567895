"""How the engine reads and writes pool KV: interfaces, a DRAM pool, a layer-wise loader.

- `BaseKVSource`: which leading blocks of a prompt the pool holds, and their objects in
  local memory (the Store's client fetches remote ones first). The engine validates each
  object (`kvobject.decode_kv_object`) and `LayerLoader` copies it into the paged cache
  layer by layer on a thread, ahead of the compute that needs it.
- `BaseKVSink`: put-start (`begin`) -> `BaseKVPut.write_layer` after each layer computes
  -> `commit` (put-end) -> `wait`. Every call but `wait` is asynchronous: the tensors passed
  to `write_layer` are cache views that must stay untouched until `wait` returns.
- `LayerWriter`: the writer thread and the objects being built of a sink, which a pool owns
  (this one, and kv/pool.py's `StoreKVPool`).
- `DramKVPool`: both, in this process's memory; LRU by bytes; optionally paced like a
  network link. It stands in for the Store in tests and `mooncake bench engine`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from mooncake.errors import StoreError
from mooncake.kv.heads import HeadShards, rank_heads
from mooncake.kv.object import KVLayout, KVObjectBuilder, KVObjectView
from mooncake.model.kvcache import PagedKVCache

log = logging.getLogger(__name__)
Buffer = bytes | bytearray | memoryview
# Objects are read-only to the loader; torch warns on every read-only buffer it wraps.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _bytes_tensor(buf: Any, offset: int, count: int) -> Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=offset)


class BaseKVSource(ABC):
    """Read side of the KV pool, for one model (layout and fingerprint)."""

    @abstractmethod
    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` are committed in the pool (no state change)."""

    @abstractmethod
    def fetch(self, block_hashes: Sequence[int]) -> list[Buffer | None]:
        """Each object's bytes in local memory (None if gone since `match_prefix`); blocks.
        The buffers stay valid until `release`."""

    def release(self, block_hashes: Sequence[int]) -> None:  # noqa: B027 (optional hook)
        """End the read leases `fetch` took (no-op where there are none)."""

    def discard(self, block_hash: int) -> None:  # noqa: B027 (optional hook)
        """Report an object that failed validation, so the pool drops (or repairs) it and a
        fresh one can be stored under its name."""


class BaseKVPut(ABC):
    """One group of objects being written (put-start done)."""

    @abstractmethod
    def write_layer(
        self,
        layer: int,
        block_indices: Sequence[int],
        k: Sequence[Tensor],
        v: Sequence[Tensor],
        event: Any = None,
    ) -> None:
        """Queue layer `layer` of blocks `block_indices` (positions in `begin`'s lists); each
        k/v is (block_tokens, kv_heads, head_dim). `event`: the CUDA event after the kernels
        that wrote them (None on CPU), waited before they are read. Returns at once."""

    @abstractmethod
    def commit(self) -> None:
        """Queue put-end of this writer. An object becomes visible to readers once every
        layer is written, possibly by several writers (the stages of a pipeline)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Block until this writer's layers are written and committed; returns how many
        objects it wrote. Raises StoreError."""


class BaseKVSink(ABC):
    """Write side of the KV pool, for one model."""

    @abstractmethod
    def begin(
        self, block_hashes: Sequence[int], token_blocks: Sequence[Sequence[int]]
    ) -> BaseKVPut:
        """Put-start for these blocks (each with its block_tokens token ids)."""


class _Put(BaseKVPut):
    def __init__(self, writer: LayerWriter, builders: list[KVObjectBuilder | None]):
        self.writer = writer
        self.builders = builders  # None: the pool holds this block already
        self.bufs = [
            None if b is None else torch.frombuffer(b.buf, dtype=torch.uint8) for b in builders
        ]
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.num_committed = 0

    def write_layer(
        self,
        layer: int,
        block_indices: Sequence[int],
        k: Sequence[Tensor],
        v: Sequence[Tensor],
        event: Any = None,
    ) -> None:
        idx, ks, vs = list(block_indices), list(k), list(v)
        self.writer.submit(self, lambda: self._write(layer, idx, ks, vs, event))

    def _write(
        self, layer: int, indices: list[int], ks: list[Tensor], vs: list[Tensor], event: Any
    ) -> None:
        if event is not None:
            event.synchronize()  # NOTE: the layer's kernels may still be writing k and v
        lay = self.writer.layout
        k_off, v_off, n = lay.k_offset(layer), lay.v_offset(layer), lay.half_bytes
        for i, k, v in zip(indices, ks, vs, strict=True):
            buf, builder = self.bufs[i], self.builders[i]
            if buf is None or builder is None:
                continue
            buf[k_off : k_off + n].copy_(k.reshape(-1).view(torch.uint8))
            buf[v_off : v_off + n].copy_(v.reshape(-1).view(torch.uint8))
            builder.mark_written(layer)
            if self.writer.link_bytes_per_s > 0:
                time.sleep(2 * n / self.writer.link_bytes_per_s)

    def commit(self) -> None:
        self.writer.submit(self, self._commit)

    def _commit(self) -> None:
        # Pipeline stages share builders: an object is sealed by whichever writer completes it.
        builders = [b for b in self.builders if b is not None]
        self.writer.store([(b.block_hash, b.commit()) for b in builders if b.is_complete])
        self.num_committed = len(builders)
        self.done.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise StoreError(f"KV store did not finish within {timeout} s")
        if self.error is not None:
            raise StoreError(f"KV store failed: {self.error}") from self.error
        return self.num_committed


BuiltObjects = list[tuple[int, bytearray]]  # (block hash, object) pairs


class LayerWriter:
    """The write side a pool owns: objects built layer by layer on one writer thread.

    `begin` shares one builder per block among the writers of a prompt (the stages of a
    pipeline) and skips the blocks `is_stored` names; at commit, the writer thread hands
    each completed object to `store` (the pool's: keep it, or put it into the Store),
    which calls `built` for them. `lock` guards the builders; a pool guards its own index
    with it too, so that a block goes from being built to stored at once."""

    def __init__(
        self,
        layout: KVLayout,
        fingerprint: bytes,
        store: Callable[[BuiltObjects], None],
        link_bytes_per_s: float = 0.0,
    ):
        self.layout = layout
        self.fingerprint = fingerprint
        self.store = store
        # > 0: writes also wait as if the bytes crossed a link this fast (benchmarks use it
        # to stand in for a remote Store; the wait releases the GIL like a real transfer).
        self.link_bytes_per_s = link_bytes_per_s
        self.lock = threading.RLock()  # NOTE: reentrant: a pool's `store` holds it to call `built`
        self._pending: dict[int, KVObjectBuilder] = {}  # block hash -> object being written
        self._tasks: queue.SimpleQueue[tuple[_Put, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._tasks.get()) is not None:
            put, task = item
            if put.error is not None:
                continue
            try:
                task()
            except BaseException as e:  # reported to the waiter, never kills the writer
                log.exception("KV store task failed")
                put.error = e
                put.done.set()

    def submit(self, put: _Put, task: Callable[[], None]) -> None:
        self._tasks.put((put, task))

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def begin(
        self,
        block_hashes: Sequence[int],
        token_blocks: Sequence[Sequence[int]],
        is_stored: Callable[[int], bool] | None = None,
    ) -> BaseKVPut:
        """Put-start (`BaseKVSink.begin`); `is_stored` is called under `lock`."""
        builders: list[KVObjectBuilder | None] = []
        with self.lock:
            for h, tokens in zip(block_hashes, token_blocks, strict=True):
                if is_stored is not None and is_stored(h):
                    builders.append(None)
                    continue
                if h not in self._pending:
                    self._pending[h] = KVObjectBuilder(self.layout, self.fingerprint, h, tokens)
                builders.append(self._pending[h])
        return _Put(self, builders)

    def built(self, block_hashes: Iterable[int]) -> None:
        """These blocks' objects are complete: a later `begin` builds them anew."""
        with self.lock:
            for h in block_hashes:
                self._pending.pop(h, None)


class DramKVPool(BaseKVSource, BaseKVSink):
    """KV objects in this process's memory, with a writer thread and LRU eviction."""

    def __init__(
        self,
        layout: KVLayout,
        fingerprint: bytes,
        capacity_bytes: int | None = None,
        link_bytes_per_s: float = 0.0,
    ):
        self.layout = layout
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self._writer = LayerWriter(layout, fingerprint, self.insert, link_bytes_per_s)
        self._objects: OrderedDict[int, bytearray] = OrderedDict()  # block hash -> object
        self._lock = self._writer.lock  # NOTE: one lock for the objects and the builders

    def close(self) -> None:
        self._writer.close()

    # -- sink --
    def begin(
        self, block_hashes: Sequence[int], token_blocks: Sequence[Sequence[int]]
    ) -> BaseKVPut:
        return self._writer.begin(block_hashes, token_blocks, self._objects.__contains__)

    def insert(self, objects: BuiltObjects) -> None:
        with self._lock:
            self._writer.built(h for h, _ in objects)
            for block_hash, data in objects:
                self._objects[block_hash] = data
                self._objects.move_to_end(block_hash)
            while self.capacity_bytes is not None and self.num_bytes > self.capacity_bytes:
                self._objects.popitem(last=False)

    # -- source --
    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        with self._lock:
            for i, h in enumerate(block_hashes):
                if h not in self._objects:
                    return i
            return len(block_hashes)

    def fetch(self, block_hashes: Sequence[int]) -> list[Buffer | None]:
        with self._lock:
            found = [self._objects.get(h) for h in block_hashes]
            for h, data in zip(block_hashes, found, strict=True):
                if data is not None:
                    self._objects.move_to_end(h)
            return list(found)

    def discard(self, block_hash: int) -> None:
        with self._lock:
            self._objects.pop(block_hash, None)

    # -- inspection (tests, benches) --
    def get(self, block_hash: int) -> bytearray | None:
        with self._lock:
            return self._objects.get(block_hash)

    @property
    def num_objects(self) -> int:
        return len(self._objects)

    @property
    def num_bytes(self) -> int:
        return len(self._objects) * self.layout.object_bytes


class LayerLoader:
    """Copies validated objects into cache blocks layer by layer, on a thread, so that
    layer l is in place by the time compute reaches it (`wait(l)`)."""

    def __init__(
        self,
        cache: PagedKVCache | Sequence[PagedKVCache],
        objects: list[KVObjectView],
        block_ids: list[int],
        layers: range,
    ):
        """`cache`: the cache, or every tensor-parallel rank's (rank order), each
        receiving its heads of each object (kv/heads.py)."""
        assert len(objects) <= len(block_ids), (len(objects), len(block_ids))
        self.caches = [cache] if isinstance(cache, PagedKVCache) else list(cache)
        self.objects, self.block_ids, self.layers = objects, block_ids, layers
        self._ready = {layer: threading.Event() for layer in layers}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if objects:
            self._thread = threading.Thread(target=self._run, name="kv-loader", daemon=True)
            self._thread.start()
        else:
            for event in self._ready.values():
                event.set()

    def _run(self) -> None:
        try:
            for layer in self.layers:
                self.load_layer(layer)
                self._ready[layer].set()
        except BaseException as e:
            log.exception("KV layer load failed")
            self._error = e
            for event in self._ready.values():
                event.set()

    def load_layer(self, layer: int) -> None:
        lay = self.objects[0].layout
        if len(self.caches) > 1:
            self._load_heads(layer)
            return
        k_cache, v_cache = self.caches[0].layer(layer)
        for obj, block in zip(self.objects, self.block_ids, strict=False):
            k_src = _bytes_tensor(obj.data, lay.k_offset(layer), lay.half_bytes)
            v_src = _bytes_tensor(obj.data, lay.v_offset(layer), lay.half_bytes)
            k_cache[block].view(-1).view(torch.uint8).copy_(k_src)
            v_cache[block].view(-1).view(torch.uint8).copy_(v_src)

    def _load_heads(self, layer: int) -> None:
        """Each rank's heads of each object's layer into its own cache block."""
        lay = self.objects[0].layout
        shards = HeadShards(lay.num_kv_heads, len(self.caches))
        halves = [c.layer(layer) for c in self.caches]
        dtype, shape = halves[0][0].dtype, (lay.block_tokens, lay.num_kv_heads, lay.head_dim)
        for obj, block in zip(self.objects, self.block_ids, strict=False):
            for half, off in ((0, lay.k_offset(layer)), (1, lay.v_offset(layer))):
                whole = _bytes_tensor(obj.data, off, lay.half_bytes).view(dtype).view(shape)
                for r, pair in enumerate(halves):
                    pair[half][block].copy_(rank_heads(whole, shards, r))

    def wait(self, layer: int) -> None:
        """Block until `layer` of every reused block is in the cache; raises StoreError."""
        self._ready[layer].wait()
        if self._error is not None:
            raise StoreError(f"loading reused KV failed: {self._error}") from self._error

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

"""`MooncakeDistributedStore`: upstream's Python Store client (its methods, argument order
and integer return codes, from docs/source/api-reference/python/mooncake-store.md and
mooncake-integration/store/store_py.cpp) over our `Store`.

    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", "10.0.0.1:50051")
    store.put("k", b"v")          # 0; a key that exists: 0 too (upstream's put semantics)
    store.get("k")                # b"v"; a miss: b""
    store.close()

One instance is one client of our master: a Store (control channel + Transfer Engine) and,
when `global_segment_size` > 0, a DRAM segment of that size on the same engine, mounted
with the master and kept alive by heartbeats (a `StoreNode` sharing the engine), so that
its memory joins the pool and this client's reads and writes of it are local copies.
`close` unmounts it: the objects stored there are gone, as upstream's are; a store still
set up when the interpreter exits is closed then (upstream's clients are torn down at exit).

Every method answers as upstream's does: 0 or a negative `ErrorCode` (store/upstream/codes.py),
per key in batch forms; `get` returns b"" on a miss or error, `get_buffer` None. Errors are
also logged with their reason. Only a missing cluster secret raises (ConfigError from
setup), so that nothing runs unauthenticated.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from mooncake.config.portrange import PortRange
from mooncake.errors import MooncakeError
from mooncake.rpc.client import RpcClient
from mooncake.store.client.client import NotFoundError, StatusError, Store
from mooncake.store.metadata.objects import KeyResult
from mooncake.store.metadata.settings import key_error
from mooncake.store.node.node import StoreNode, TierSizes
from mooncake.store.server import messages as m
from mooncake.store.upstream import ranged
from mooncake.store.upstream.buffers import AddressBook, BufferHandle
from mooncake.store.upstream.codes import ErrorCode, code_of, code_of_put, code_of_status
from mooncake.store.upstream.descriptors import ReplicaDescriptor
from mooncake.store.upstream.replicate import ReplicateConfig, put_options
from mooncake.store.upstream.setup import (
    UPSTREAM_PORTS,
    SetupArgs,
    cluster_secret,
    read_args,
    read_dict,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.types import EngineOptions

log = logging.getLogger(__name__)

TIMEOUT_S: Final = 10.0  # s per master call and per transfer batch
MASTER_WAIT_S: Final = 10.0  # s setup waits for the master to take this client's segment
BAD: Final = int(ErrorCode.INVALID_PARAMS)
HC_HEALTHY, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2  # health_check's answers


def _tear_down(store: Store, node: StoreNode | None, book: AddressBook) -> None:
    """Unmount a client's segment, unregister its buffers, close its connections."""
    if node is not None:
        node.stop()
    book.clear()
    store.close()


class MooncakeDistributedStore:
    """A client of the pool in upstream's shape; thread-safe once set up."""

    def __init__(self) -> None:
        self._store: Store | None = None
        self._node: StoreNode | None = None
        self._book: AddressBook | None = None
        self._hostname = ""
        self._has_buffer = False  # local_buffer_size > 0: put and get may stage values
        self._buffer_bytes = 0  # local_buffer_size given to setup
        self._lock = threading.Lock()  # NOTE: guards setup, close and the address book
        # NOTE: a store collected or still set up at exit is torn down then, as upstream's
        # clients are (their destructor; the ResourceTracker's atexit handler in
        # mooncake-store/src/real_client.cpp): its segment leaves the master at once
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300), or setup(config_dict). 0, or a negative code (bad
        arguments: -600; the master unreachable: -900). Raises ConfigError when no
        cluster secret is set (store/upstream/setup.py)."""
        try:
            if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
                parsed = read_dict(args[0])
            else:
                parsed = _read_positional(*args, **kwargs)
        except (TypeError, ValueError) as e:
            log.error("MooncakeDistributedStore.setup: %s", e)
            return BAD
        secret = cluster_secret()
        with self._lock:
            if self._store is not None:
                log.error("MooncakeDistributedStore.setup: already set up; close() first")
                return BAD
            try:
                self._start(parsed, secret)
            except MooncakeError as e:
                log.error("MooncakeDistributedStore.setup: %s", e)
                return code_of(e)
            except OSError as e:  # the engine cannot listen there (MC_LEGACY_RPC_PORT_BINDING)
                log.error("MooncakeDistributedStore.setup: cannot listen: %s", e)
                return BAD
        return 0

    def _start(self, a: SetupArgs, text: str) -> None:
        secret = text.encode()
        node_id = f"client-{uuid.uuid4().hex[:12]}"
        # NOTE: a port in local_hostname is the client's name, not bound, as upstream's
        # (RealClient::setup_internal) unless MC_LEGACY_RPC_PORT_BINDING is set
        bind = a.port if a.port and os.environ.get("MC_LEGACY_RPC_PORT_BINDING") else 0
        ports = PortRange() if a.port else PortRange(*UPSTREAM_PORTS)
        opts = EngineOptions(protocol=a.protocol, nics=a.nics, ports=ports, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
        engine = TransferEngine(node_id, secret, opts, host=a.host, port=bind)
        node = None
        try:
            master = RpcClient(a.master, secret, timeout_s=TIMEOUT_S, max_frame_bytes=64 << 20)
            store = Store(master, engine, TIMEOUT_S, max(a.buffer_bytes, 4096))
            if a.segment_bytes:
                sizes = TierSizes(dram_bytes=a.segment_bytes)
                node = StoreNode(node_id, a.master, secret, sizes, host=a.host, engine=engine)
                node.start(wait_s=MASTER_WAIT_S)
            else:
                master.call(m.DirectPortMsg(), m.DirectPortReplyMsg)  # is the master there?
        except BaseException:
            if node is not None:
                node.stop()
            engine.close()
            raise
        self._store, self._node = store, node
        self._book = AddressBook(engine, node_id)
        self._has_buffer = a.buffer_bytes > 0
        self._buffer_bytes = a.buffer_bytes
        self._hostname = f"{a.hostname}:{a.port or engine.endpoints[0].port}"
        self._finalizer = weakref.finalize(self, _tear_down, store, node, self._book)

    @property
    def local_buffer_size(self) -> int:
        """The local buffer's bytes given to setup (0 before setup): what `BufferPool`
        leases from first."""
        return self._buffer_bytes

    def close(self) -> int:
        """Unmount this client's segment (its objects go), unregister every buffer, close
        the connections; 0. A store never set up closes too."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
            self._store = self._node = self._book = None
        if finalizer is not None:
            finalizer()
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer."""
        store = self._store
        if store is None:
            return HC_NOT_INITIALIZED
        try:
            store.master.call(m.DirectPortMsg(), m.DirectPortReplyMsg, timeout_s=2.0)
        except MooncakeError:
            return HC_MASTER_UNREACHABLE
        return HC_HEALTHY

    def get_hostname(self) -> str:
        """ "host:port" of this client's Transfer Engine ("" before setup)."""
        return self._hostname

    # -- buffers -----------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register host memory at `buffer_ptr` for the *_from / *_into calls; 0 or -600."""
        with self._lock:
            if self._book is None:
                return _not_set_up("register_buffer")
            try:
                self._book.register(int(buffer_ptr), int(size))
            except (ValueError, MooncakeError) as e:
                log.error("%s", e)
                return BAD
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            if self._book is None:
                return _not_set_up("unregister_buffer")
            try:
                self._book.unregister(int(buffer_ptr))
            except (ValueError, MooncakeError) as e:
                log.error("%s", e)
                return BAD
        return 0

    # -- single keys -------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put(key, value, config, overwrite=False)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """put that replaces an existing value (refused with -706 while one is read)."""
        return self._put(key, value, config, overwrite=True)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of `parts` (bytes-like) as one value."""
        return self._put(key, b"".join(map(_bytes_view, parts)), config, overwrite=False)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._put(key, b"".join(map(_bytes_view, parts)), config, overwrite=True)

    def _put(self, key: str, value: Any, config: ReplicateConfig | None, overwrite: bool) -> int:
        def put(store: Store, opts: dict[str, Any]) -> int:
            store.put(key, _bytes_view(value), **opts)
            return 0

        return self._with_opts("put", config, overwrite, put, buffered=True)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Zero-copy put of `size` bytes at `buffer_ptr` (inside a registered buffer)."""
        return self._put_from(key, buffer_ptr, size, config, overwrite=False)

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self._put_from(key, buffer_ptr, size, config, overwrite=True)

    def _put_from(
        self, key: str, ptr: int, size: int, config: ReplicateConfig | None, overwrite: bool
    ) -> int:
        def put(store: Store, opts: dict[str, Any]) -> int:
            seg, off, _ = self._resolve(ptr, size)
            store.put_from(key, seg, off, size, **opts)
            return 0

        return self._with_opts("put_from", config, overwrite, put)

    def get(self, key: str) -> bytes:
        """The value, or b"" on a miss or an error."""
        store = self._store
        if store is None or not self._has_buffer:
            _not_set_up("get") if store is None else log.error("get: local_buffer_size is 0")
            return b""
        try:
            return store.get(key)
        except NotFoundError:
            return b""
        except MooncakeError as e:
            log.warning("get of %r: %s", key, e)
            return b""

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value as a BufferHandle, or None on a miss or an error."""
        value = self.get(key)
        return BufferHandle(value) if value else None

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Zero-copy read into `size` bytes at `buffer_ptr` (registered); the value's size,
        or a negative code (a value larger than `size`: -600)."""
        store = self._store
        if store is None:
            return _not_set_up("get_into")
        try:
            seg, off, room = self._resolve(buffer_ptr, size)
            return store.get_into(key, seg, off, max_size=min(size, room))
        except ValueError as e:
            log.error("get_into of %r: %s", key, e)
            return BAD
        except MooncakeError as e:
            log.log(_level(e), "get_into of %r: %s", key, e)
            return code_of(e)

    def get_size(self, key: str) -> int:
        """Bytes of the value, or a negative code (a miss: -704)."""
        store = self._store
        if store is None:
            return _not_set_up("get_size")
        try:
            r = store.locate_batch([key])[0]
        except MooncakeError as e:
            return code_of(e)
        return r.size if r.status == "ok" else code_of_status(r.status)

    def is_exist(self, key: str) -> int:
        """1 the key is stored, 0 it is not, -1 an error."""
        return self.batch_is_exist([key])[0]

    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 (a miss), -706 (a reader's lease: retry after it, or force), -703
        (being written)."""
        store = self._store
        if store is None:
            return _not_set_up("remove")
        try:
            store.remove(key, force=force, wait=False)
        except MooncakeError as e:
            log.log(_level(e), "remove of %r: %s", key, e)
            return code_of(e)
        return 0

    def remove_all(self, force: bool = False) -> int:
        """Remove every object not leased (force: leased ones too); how many, or -1."""
        store = self._store
        if store is None:
            _not_set_up("remove_all")
            return -1
        try:
            return store.remove_all(force)
        except MooncakeError as e:
            log.error("remove_all: %s", e)
            return -1

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clear the replicas of those `keys` this client put whose leases have expired:
        every replica (`segment_name` ""), or those on the segment `segment_name` names
        (this client's get_hostname(), or a replica's transport_endpoint or segment as
        get_replica_desc reports it); the object goes with its last replica. Returns the
        keys cleared; keys missing, another client's, leased, being written or without a
        replica there are skipped, as are empty keys; [] on an error (logged)."""
        store = self._store
        if store is None:
            _not_set_up("batch_replica_clear")
            return []
        if segment_name and segment_name == self._hostname:
            segment_name = store.node_id  # NOTE: its segment's node, sharing its engine
        valid = [k for k in keys if not key_error(k)]
        try:
            return store.clear_replicas(valid, segment_name)
        except MooncakeError as e:
            log.error("batch_replica_clear: %s", e)
            return []

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The key's replicas ([] on a miss or an error)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """key -> its replicas, for the keys found."""
        store = self._store
        if store is None:
            _not_set_up("batch_get_replica_desc")
            return {}
        try:
            found = store.locate_batch(keys)
        except MooncakeError as e:
            log.error("batch_get_replica_desc: %s", e)
            return {}
        return {r.key: [ReplicaDescriptor(d) for d in r.replicas] for r in found if r.replicas}

    # -- batches: one answer per key, in order ----------------------------------------------

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        """0 when every key is stored, else the first key's negative code."""
        return self._put_batch(keys, values, config, overwrite=False)

    def upsert_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        return self._put_batch(keys, values, config, overwrite=True)

    def _put_batch(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        config: ReplicateConfig | None,
        overwrite: bool,
    ) -> int:
        if len(keys) != len(values):
            log.error("put_batch: %d keys but %d values", len(keys), len(values))
            return BAD

        def put(store: Store, opts: dict[str, Any]) -> int:
            results = store.put_batch(keys, [_bytes_view(v) for v in values], **opts)
            return next((c for c in map(_put_code, results) if c), 0)

        return self._with_opts("put_batch", config, overwrite, put, buffered=True)

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each value, b"" for a miss or an error."""
        store = self._store
        if store is None or not self._has_buffer:
            _not_set_up("get_batch") if store is None else log.error(
                "get_batch: local_buffer_size is 0"
            )
            return [b""] * len(keys)
        try:
            return [r.value or b"" for r in store.get_batch(keys)]
        except MooncakeError as e:
            log.warning("get_batch: %s", e)
            return [b""] * len(keys)

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return [BufferHandle(v) if v else None for v in self.get_batch(keys)]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 (stored), 0 (not) or -1 (an error)."""
        store = self._store
        if store is None:
            _not_set_up("batch_is_exist")
            return [-1] * len(keys)
        try:
            return [int(is_in) for is_in in store.exists_batch(keys)]
        except MooncakeError as e:
            log.error("batch_is_exist: %s", e)
            return [-1] * len(keys)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        store = self._store
        if store is None:
            return [_not_set_up("batch_remove")] * len(keys)
        try:
            return [
                code_of_status(r.status) for r in store.remove_batch(keys, force=force, wait=False)
            ]
        except MooncakeError as e:
            log.error("batch_remove: %s", e)
            return [code_of(e)] * len(keys)

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Zero-copy put of keys[i] from sizes[i] bytes at buffer_ptrs[i]; a code per key."""
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, overwrite=False)

    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, overwrite=True)

    def _batch_put_from(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None,
        overwrite: bool,
    ) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            log.error(
                "batch_put_from: %d keys, %d buffers, %d sizes", len(keys), len(ptrs), len(sizes)
            )
            return [BAD] * len(keys)

        def put(store: Store, opts: dict[str, Any]) -> list[int]:
            out, todo, sources = [BAD] * len(keys), [], []
            for i, (key, ptr, size) in enumerate(zip(keys, ptrs, sizes, strict=True)):
                try:
                    source = self._checked(key, ptr, size)
                except ValueError as e:
                    log.error("batch_put_from: %r: %s", key, e)
                    continue
                todo.append(i)
                sources.append(source[:2])
            results = store.put_batch_from(
                [keys[i] for i in todo], sources, [sizes[i] for i in todo], **opts
            )
            for i, r in zip(todo, results, strict=True):
                out[i] = _put_code(r)
            return out

        return self._with_opts_each("batch_put_from", config, overwrite, len(keys), put)

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Zero-copy read of keys[i] into sizes[i] bytes at buffer_ptrs[i]; per key the
        bytes read or a negative code."""
        store = self._store
        if store is None:
            return [_not_set_up("batch_get_into")] * len(keys)
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            log.error(
                "batch_get_into: %d keys, %d buffers, %d sizes",
                len(keys),
                len(buffer_ptrs),
                len(sizes),
            )
            return [BAD] * len(keys)
        out, todo, dests = [BAD] * len(keys), [], []
        for i, (key, ptr, size) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True)):
            try:
                seg, off, room = self._checked(key, ptr, size)
            except ValueError as e:
                log.error("batch_get_into: %r: %s", key, e)
                continue
            todo.append(i)
            dests.append((seg, off, min(size, room)))
        try:
            results = store.get_batch_into([keys[i] for i in todo], dests)
        except MooncakeError as e:
            log.error("batch_get_into: %s", e)
            return [code_of(e) if i in todo else BAD for i in range(len(keys))]
        for i, r in zip(todo, results, strict=True):
            out[i] = r.size if r.status == "ok" else _read_code(r.status)
        return out

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Put keys[i] as the concatenation of its buffers' bytes; a code per key."""

        def put(store: Store, opts: dict[str, Any]) -> list[int]:
            assert self._book is not None
            return ranged.put_multi(store, self._book, keys, all_buffer_ptrs, all_sizes, opts)

        return self._with_opts_each("batch_put_from_multi_buffers", config, False, len(keys), put)

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read keys[i] across its buffers in order; per key the bytes read or a code."""
        store, book = self._store, self._book
        if store is None or book is None:
            return [_not_set_up("batch_get_into_multi_buffers")] * len(keys)
        return ranged.get_multi(store, book, keys, all_buffer_ptrs, all_sizes)

    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        all_keys: Sequence[Sequence[str]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Byte ranges of values into registered buffers: results[i][j][k] is the bytes of
        fragment k of key j read into buffer i, or a negative code."""
        store, book = self._store, self._book
        if store is None or book is None:
            _not_set_up("get_into_ranges")
            return [[[BAD] for _ in keys] for keys in all_keys]
        return ranged.get_ranges(
            store, book, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes
        )

    # -- helpers -----------------------------------------------------------------------------

    def _resolve(self, ptr: int, size: int) -> tuple[str, int, int]:
        book = self._book
        if book is None:
            raise ValueError("not set up")
        return book.resolve(int(ptr), int(size))

    def _checked(self, key: str, ptr: int, size: int) -> tuple[str, int, int]:
        """`_resolve` of a batch entry whose key is valid; ValueError saying what is not."""
        if why := key_error(key):
            raise ValueError(why)
        return self._resolve(ptr, size)

    def _with_opts(
        self,
        what: str,
        config: ReplicateConfig | None,
        overwrite: bool,
        call: Callable[[Store, dict[str, Any]], int],
        buffered: bool = False,
    ) -> int:
        """call(store, our put options) with every refusal turned into upstream's code;
        `buffered`: the call stages values in the local buffer."""
        store = self._store
        if store is None:
            return _not_set_up(what)
        if buffered and not self._has_buffer:
            log.error("%s: local_buffer_size is 0: no buffer to stage the value in", what)
            return BAD
        try:
            return call(store, put_options(config, overwrite))
        except ValueError as e:
            log.error("%s: %s", what, e)
            return BAD
        except StatusError as e:
            if code := code_of_put(e.status):
                log.log(_level(e), "%s: %s", what, e)
            return code
        except MooncakeError as e:
            log.log(_level(e), "%s: %s", what, e)
            return code_of(e)

    def _with_opts_each(
        self,
        what: str,
        config: ReplicateConfig | None,
        overwrite: bool,
        num_keys: int,
        call: Callable[[Store, dict[str, Any]], list[int]],
    ) -> list[int]:
        """`_with_opts` of a call answering per key: a refusal of the whole call is every
        key's code."""
        out: list[int] = []

        def run(store: Store, opts: dict[str, Any]) -> int:
            out[:] = call(store, opts)
            return 0

        code = self._with_opts(what, config, overwrite, run)
        return out if len(out) == num_keys else [code] * num_keys


def _read_positional(
    local_hostname: str,
    metadata_server: str,
    global_segment_size: Any,
    local_buffer_size: Any,
    protocol: str,
    rdma_devices: str,
    master_server_addr: str,
    engine: object = None,
    enable_ssd_offload: bool = False,
    ssd_offload_path: str = "",
    tenant_id: str = "default",
    enable_client_http_server: bool = False,
    client_http_port: int = 9300,
) -> SetupArgs:
    """setup's positional form (upstream's argument order); ValueError for the options
    this pool has no counterpart of."""
    if engine is not None:
        raise ValueError(
            "engine: sharing a Transfer Engine with the store is not supported; pass None"
        )
    if enable_ssd_offload or ssd_offload_path:
        raise ValueError(
            "enable_ssd_offload: the SSD tier belongs to store nodes (mooncake up), not clients"
        )
    if tenant_id != "default":
        raise ValueError(f'tenant_id: only "default" is supported, got {tenant_id!r}')
    if enable_client_http_server:
        raise ValueError("enable_client_http_server: not supported; the master serves /metrics")
    return read_args(
        local_hostname,
        metadata_server,
        global_segment_size,
        local_buffer_size,
        protocol,
        rdma_devices,
        master_server_addr,
    )


def _bytes_view(value: Any) -> memoryview:
    """A flat byte view of any bytes-like object (no copy)."""
    mv = memoryview(value)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _put_code(r: KeyResult) -> int:
    """A batch put's code of one key: a write that failed is a transfer failure."""
    return int(ErrorCode.TRANSFER_FAIL) if r.status == "error" else code_of_put(r.status)


def _read_code(status: str) -> int:
    """A batch read's code of one key that was not read."""
    if status == "too_large":
        return BAD
    return int(ErrorCode.TRANSFER_FAIL) if status == "error" else code_of_status(status)


def _level(e: MooncakeError) -> int:
    """Misses and refusals are normal outcomes: logged at DEBUG; the rest at WARNING."""
    return logging.DEBUG if isinstance(e, NotFoundError | StatusError) else logging.WARNING


def _not_set_up(what: str) -> int:
    log.error("MooncakeDistributedStore.%s: call setup() first", what)
    return BAD

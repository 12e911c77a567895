"""Upstream Mooncake's Python Store API (`mooncake.store.MooncakeDistributedStore` of the
`mooncake-transfer-engine` wheel, kvcache-ai/Mooncake) over our Store, for vLLM's,
SGLang's and LMCache's Mooncake backends.

- `store`       `MooncakeDistributedStore`: setup, the methods, their return codes
- `setup`       setup's arguments (sizes like "16MB", the master address) and the secret
- `replicate`   `ReplicateConfig`, `SoftPinAction`, `ObjectDataType` -> our put options
- `codes`       upstream's `ErrorCode` values and our outcomes' mapping onto them
- `buffers`     raw addresses -> our segments (`AddressBook`), `BufferHandle`
- `ranged`      values gathered from / scattered to several buffers, byte ranges
- `descriptors` `get_replica_desc`'s `ReplicaDescriptor` and friends

Conformance (upstream method -> here):

    setup (positional and dict)      supported; protocol "rdma" without rdma_devices: TCP
                                     where no NIC opens, MC_FORCE_TCP: TCP (upstream's
                                     auto-discovery); metadata_server accepted, unused; engine=,
                                     SSD offload, tenants, client HTTP: -600
    setup_dummy                      left out: no shared-memory dummy clients
    put/get/put_batch/get_batch      supported; a put of an existing key: 0; a miss: b""
    put_parts, upsert*, put_from, get_into, batch_put_from, batch_get_into,
    *_multi_buffers, get_into_ranges supported (memory registered with register_buffer:
                                     host memory checked mapped and writable, else -600;
                                     CUDA memory recognised as the engine's, not yet run
                                     on a GPU)
    get_buffer/batch_get_buffer      supported: BufferHandle is a bytearray with ptr()/size()
    is_exist/batch_is_exist          1 / 0 / -1
    get_size, get_replica_desc, batch_get_replica_desc
                                     supported (a lookup that leases the object, as upstream's)
    remove/batch_remove/remove_all   supported, with force; a leased key: -706 at once
    batch_replica_clear              supported (the master's store.clear_replicas): this
                                     client's keys whose lease expired, every replica or
                                     those on segment_name (this client's get_hostname(), or
                                     a replica's transport_endpoint); differs: another
                                     client's local_hostname names no segment here (our
                                     segments are named by node): nothing is cleared there
    get_hostname, health_check, close, register_buffer/unregister_buffer
                                     supported; "host:port" as given (the port a name, bound
                                     only with MC_LEGACY_RPC_PORT_BINDING), else the first
                                     free port of 12300-14300; a store collected or still set
                                     up at exit is closed then (its segment leaves at once)
    remove_by_regex                  left out: no regular expressions run on the master
    put_from_with_metadata, tensor APIs (put_tensor...), copy/move tasks, sessions
    (batch_*_session_*), mount_segment & co, alloc_from_mem_pool, init_all
                                     left out (consumers probe with hasattr)
"""

from mooncake.store.upstream.buffers import BufferHandle
from mooncake.store.upstream.codes import ErrorCode
from mooncake.store.upstream.descriptors import (
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
)
from mooncake.store.upstream.replicate import ObjectDataType, ReplicateConfig, SoftPinAction
from mooncake.store.upstream.store import MooncakeDistributedStore

__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "ErrorCode",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
]

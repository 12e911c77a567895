"""`mooncake.engine`: upstream Mooncake's Python Transfer Engine API (the module its wheel
builds from mooncake-integration/transfer_engine/transfer_engine_py.cpp, documented in
docs/source/api-reference/python/transfer-engine.md), over our Transfer Engine.

    from mooncake.engine import TransferEngine
    te = TransferEngine()
    te.initialize("10.0.0.5", "P2PHANDSHAKE", "tcp", "")   # 0 = ok
    te.batch_register_memory([buf.ctypes.data], [buf.nbytes])
    te.batch_transfer_sync_write(f"{peer_ip}:{peer_rpc_port}", [src], [dst], [n])  # 0 = ok

The data plane is authenticated with the cluster secret (MOONCAKE_CLUSTER_SECRET; without
one initialize() refuses, see engine/secret.py). Upstream method -> what it does here:

    initialize, initialize_ext     supported; protocol "tcp" or "rdma" (device_name: the RDMA
                                   NICs, comma-separated; TCP where none opens, as upstream's
                                   auto-discovery; MC_FORCE_TCP set: TCP), "efa", "ascend"...
                                   -1; metadata "P2PHANDSHAKE", http://,
                                   etcd:// (no etcd auth); others (redis, nvlink, efa...) -1;
                                   with http:// or etcd:// local_hostname "ip:port" is the
                                   engine's name (port bound only with
                                   MC_LEGACY_RPC_PORT_BINDING), with P2PHANDSHAKE the name
                                   is "ip:<get_rpc_port()>", as upstream's
    get_rpc_port                   supported: our data-plane port, the "port" of "ip:port"
    register_memory,               supported: host memory wrapped in place (checked mapped
    unregister_memory,             and writable: -1 otherwise), CUDA memory recognised by
    batch_register_memory,         pointer attributes (the CUDA branch has not run yet);
    batch_unregister_memory        -7 overlap, -3 unknown address; location "cpu:N" kept
    transfer_sync_write/_read,     supported: 0 / -1; local memory must be registered (also
    transfer_sync,                 over tcp, unlike upstream's tcp transport: -1 otherwise);
    batch_transfer_sync_write/_read, a request must lie in one buffer on each side;
    batch_transfer_sync            notify delivered with the NOTIFY op after the transfer
    batch_transfer_async_write/_read, supported: a batch id > 0, or 0 when refused
    batch_transfer_async,
    transfer_submit_write
    get_batch_transfer_status      supported: waits; 0 / -1; an unknown id is -1
    transfer_check_status          supported: 1 done / 0 moving / -1 failed / -2 timed out
    allocate_managed_buffer,       supported: zero-filled host memory, one registration per
    free_managed_buffer            buffer (upstream: a buddy allocator over 2 GiB slabs)
    write_bytes_to_buffer,         differ: only inside registered host memory (-3, and
    read_bytes_from_buffer         ValueError for the read), never any address
    get_first_buffer_address       supported (peer "ip:port" or this engine's own name)
    send_probe                     supported: an authenticated request to the peer; 0 / -1
    get_notifies, TransferNotify   supported
    get_engine                     differs: our mooncake.transfer.TransferEngine (a Store can
                                   share it), not the C++ engine; None before initialize()
    transport_hint                 accepted and ignored (upstream: TENT backend only)
    *_on_cuda                      left out: needs cudaLaunchHostFunc (stream-ordered starts)
    get_local_topology             left out: our topology (`mooncake topo --json`) has
                                   another shape
    get_engine_ptr, warmup_efa_segment, InnerTransferEngine, RPC/shared-segment bindings
                                   left out: C++ objects and transports we do not have
    close                          ours (upstream stops the engine when it is collected)

SUPPORT_CUDA is true only where device pointers can be registered here (libcuda answers,
a device exists, torch is installed; computed at first use); SUPPORT_EFA, SUPPORT_HIP,
SUPPORT_MNNVL, SUPPORT_MUSA and SUPPORT_INTRA_NVLINK are false: we have none of them.

Module map:
    engine     TransferEngine, TransferOpcode, TransferNotify
    pointers   raw addresses -> host arrays or CUDA tensors, without copies
    metadata   P2PHANDSHAKE / http / etcd: where a peer named by upstream's name listens
    secret     the cluster secret from the environment or config, or the local opt-in
    httpmeta   `mooncake_http_metadata_server`, upstream's HTTP metadata protocol
"""

from __future__ import annotations

from mooncake.engine.engine import TransferEngine, TransferNotify, TransferOpcode
from mooncake.engine.pointers import cuda_supported

SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False


def __getattr__(name: str) -> bool:
    if name == "SUPPORT_CUDA":  # NOTE: lazily: loading libcuda costs time on GPU hosts
        return cuda_supported()
    raise AttributeError(f"module 'mooncake.engine' has no attribute {name!r}")


__all__ = [
    "SUPPORT_CUDA",  # noqa: F822 - module __getattr__
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]

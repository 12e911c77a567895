"""Transfer Engine: one-sided batch transfers between registered memory of cluster nodes.

Register memory as named segments, submit batches of READ/WRITE requests against peers'
segments, poll or wait. Transports: `local` (same process), `shm` (same host, shared
memory), `tcp` (any host) and `rdma` (pyverbs RC queue pairs); the engine picks the best
one both ends support unless `EngineOptions.protocol` forces one.

Module map:
    types      requests, statuses, segment descriptors, EngineOptions
    segment    local registrations (SegmentTable, Region) and bounds checks
    batch      Batch handle and Slice; per-request completion bookkeeping
    paths      Path health (pause on repeated failure) and NIC-preference path choice
    engine     TransferEngine: register -> submit -> poll, retries
    directory  name -> descriptor: BaseDirectory, PeerDirectory (P2P handshake)
    wire       TCP data-plane headers and the HMAC connection handshake
    admission  PendingHandshakes: how many connections wait in the handshake, who is dropped
    server     per-node TCP server: one-sided reads/writes, DESCRIBE, RDMA_CONNECT
    transport  BaseTransport, local and shm copy transports
    tcp        TCP transport (connection pool per path, zero-copy sendmsg/recv_into)
    rdma       RDMA transport over pyverbs (mooncake.native.rdma): registration, pollers,
               the RDMA_CONNECT responder; rdmapath: one path's QPs and waiting slices;
               rdmaqp: per-QP and per-CQ accounting, completion status classes
    bench      the measurement behind `mooncake bench transfer`
"""

from mooncake.transfer.batch import Batch
from mooncake.transfer.directory import BaseDirectory, PeerDirectory, StaticDirectory
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.types import (
    EndpointDesc,
    EngineOptions,
    RequestStatus,
    SegmentDesc,
    TransferOp,
    TransferRequest,
    TransferState,
)

__all__ = [
    "BaseDirectory",
    "Batch",
    "EndpointDesc",
    "EngineOptions",
    "PeerDirectory",
    "RequestStatus",
    "SegmentDesc",
    "StaticDirectory",
    "TransferEngine",
    "TransferOp",
    "TransferRequest",
    "TransferState",
]

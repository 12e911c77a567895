"""The Transfer Engine's data at its boundaries: requests, statuses, segment descriptors and
the engine's settings. Everything here is a plain frozen struct; nothing does I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from mooncake.config.portrange import PortRange
from mooncake.config.rdma import RdmaConfig

if TYPE_CHECKING:
    from mooncake.config.settings import TransferConfig

Protocol = Literal["auto", "rdma", "tcp", "shm"]


class TransferOp(enum.IntEnum):
    """One-sided direction, seen from the initiator."""

    READ = 1  # remote segment -> local buffer
    WRITE = 2  # local buffer -> remote segment


class TransferState(enum.Enum):
    """Where one request of a batch is."""

    PENDING = "pending"
    DONE = "done"  # every byte was moved and acknowledged
    FAILED = "failed"  # see RequestStatus.reason; the remote range may be partly written
    TIMED_OUT = "timed_out"  # the batch deadline passed first
    CANCELLED = "cancelled"


class TransferRequest(msgspec.Struct, frozen=True):
    """Move `length` bytes between a local registered segment and a remote one."""

    op: TransferOp
    local_segment: str  # name of a segment registered on this engine
    local_offset: int  # bytes from the start of the local segment
    remote_segment: str  # name of the peer's segment ("name" or "name@host:port")
    remote_offset: int  # bytes from the start of the remote segment
    length: int  # bytes, > 0
    # the remote segment's token (SegmentDesc.token) when the caller's offsets came with
    # it, e.g. from the Store's master: 0 = any; else a re-registered segment is refused
    remote_token: int = 0


class RequestStatus(msgspec.Struct, frozen=True):
    """Outcome (so far) of one request."""

    state: TransferState
    bytes_done: int  # bytes of acknowledged slices
    reason: str = ""  # why it failed, timed out or was cancelled; "" otherwise


class EndpointDesc(msgspec.Struct, frozen=True):
    """A TCP address where a node serves its segments (one per NIC it advertises)."""

    nic: str  # interface name, e.g. "eth0", "lo"
    host: str  # IP address or host name
    port: int


class RdmaKeyDesc(msgspec.Struct, frozen=True):
    """A segment's memory registration on one RDMA NIC of its owner."""

    nic: str  # device name, e.g. "mlx5_0"
    address: int  # virtual address the MR was registered at
    rkey: int  # remote key of that MR


class SegmentDesc(msgspec.Struct, frozen=True):
    """What a peer needs to reach a segment: what it is, where, and over which transports."""

    name: str
    token: int  # random u64 of this registration; a re-registered name gets a new one
    num_bytes: int  # length of the segment
    location: str  # "cpu:N" or "cuda:N" of the owner's memory
    node: str  # name of the owning engine
    host_id: str  # equal host_id = same host and /dev/shm (shm is possible)
    endpoints: list[EndpointDesc]  # TCP data plane and handshake
    preferred_nics: list[str] = []  # owner's NICs nearest `location`, best first
    shm_name: str = ""  # POSIX shm object holding the segment, "" if not shm-backed
    rdma: list[RdmaKeyDesc] = []  # one entry per NIC the segment is registered on

    @property
    def protocols(self) -> list[str]:
        """Transports a peer may use to reach this segment, best first."""
        found = ["rdma"] if self.rdma else []
        found += ["shm"] if self.shm_name else []
        return found + (["tcp"] if self.endpoints else [])


@dataclass(frozen=True)
class EngineOptions:
    """Settings of one TransferEngine (see `from_config` for the TOML [transfer] section)."""

    protocol: Protocol = "auto"
    nics: tuple[str, ...] = ()  # RDMA devices to use; empty = every usable one
    slice_bytes: int = 65536  # bytes per slice (rdma; other transports use >= group_bytes)
    connections_per_peer: int = 4  # TCP connections (or RDMA QPs) per path
    retry_budget: int = 3  # extra attempts of a failed slice, each on another path
    timeout_s: float = 10.0  # seconds from submit until pending requests time out
    io_timeout_s: float = 0.0  # seconds a socket may stall; 0 = timeout_s / (retry_budget + 1)
    pause_after_failures: int = 3  # consecutive failures that pause a path
    pause_s: float = 1.0  # first pause of a failing path; doubles while it keeps failing
    copy_threads: int = 2  # threads doing shm and local copies
    group_bytes: int = 1 << 20  # bytes of slices a TCP connection sends before reading replies
    spin_us: float = 200.0  # microseconds a thread polls for a reply before it sleeps
    handshake_timeout_s: float = 5.0  # seconds a new connection has for the whole handshake
    max_pending_handshakes: int = 256  # connections in the handshake at once, all peers
    stage_chunk_bytes: int = 4 << 20  # device memory over tcp/shm: bytes per bounce buffer
    ports: PortRange = PortRange()  # where the data-plane server listens ([node] port_range)
    rdma: RdmaConfig = RdmaConfig()  # the [transfer] rdma_* keys

    @property
    def slice_io_timeout_s(self) -> float:
        """Seconds one socket operation may block before its slice counts as failed."""
        if self.io_timeout_s > 0:
            return self.io_timeout_s
        return max(0.05, self.timeout_s / (self.retry_budget + 1))

    @classmethod
    def from_config(cls, cfg: TransferConfig, **overrides: object) -> EngineOptions:
        """Options from the [transfer] section, with keyword `overrides` on top."""
        fields: dict[str, object] = {
            "protocol": cfg.protocol,
            "nics": tuple(cfg.nics),
            "slice_bytes": int(cfg.slice_bytes),
            "connections_per_peer": cfg.connections_per_peer,
            "retry_budget": cfg.retry_budget,
            "timeout_s": cfg.timeout_s,
            "spin_us": cfg.spin_us,
            "handshake_timeout_s": cfg.handshake_timeout_s,
            "max_pending_handshakes": cfg.max_pending_handshakes,
            "stage_chunk_bytes": int(cfg.stage_chunk_bytes),
            "rdma": RdmaConfig(**{k: getattr(cfg, k) for k in RdmaConfig.__struct_fields__}),
        }
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

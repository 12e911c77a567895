"""`TransferEngine` with upstream Mooncake's Python API (transfer_engine_py.cpp) over our
Transfer Engine (mooncake/transfer/): peers named "ip:port", memory named by raw address,
integer return codes.

Each buffer given to register_memory (or made by allocate_managed_buffer) becomes one
segment of the inner engine, wrapped where it lies (engine/pointers.py), and enters this
node's `AddressIndex`; the inner engine's server answers DESCRIBE_ADDRESS from it. To move
bytes to or from a peer's address, the engine asks the peer once which segment holds it
(the answer cached per peer, with the segment's token), then submits ordinary
(segment, offset) requests. A buffer the peer registered again since gets a new token: the
peer refuses the stale request, the cache is dropped and the transfer tried once more.

Return codes are upstream's (mooncake-transfer-engine/include/error.h; its Python layer
returns -1 for every failed transfer and 0 for a failed async submit); the reason of every
failure is logged at WARNING or above, as upstream logs it.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import itertools
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from mooncake.engine.metadata import BaseMetadata, connect_metadata
from mooncake.engine.pointers import memory_at
from mooncake.engine.secret import engine_secret
from mooncake.errors import MooncakeError, ProtocolError, TransferError
from mooncake.transfer import Batch, EngineOptions, TransferOp, TransferRequest, TransferState
from mooncake.transfer import TransferEngine as InnerEngine
from mooncake.transfer.addrindex import AddressDirectory, AddressIndex, AddressQuery, BufferDesc
from mooncake.transfer.tcp import control_call
from mooncake.transfer.types import EndpointDesc
from mooncake.transfer.wire import Op, Status, status_text

log = logging.getLogger(__name__)

# upstream's error codes (mooncake-transfer-engine/include/error.h)
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_METADATA = -200
PROTOCOLS = ("tcp", "rdma")  # upstream's protocols we serve (our_protocol maps them)
_FALSE = ("", "0", "false", "no", "off")
MAX_NOTIFIES = 65536  # received notifications kept until get_notifies(); oldest dropped
_encode = msgspec.msgpack.Encoder().encode
_decode_notify = msgspec.msgpack.Decoder(tuple[str, str]).decode


def force_tcp() -> bool:
    """MC_FORCE_TCP: upstream's switch to TCP whatever NICs the host has (its
    transfer_engine_impl.cpp); set to anything but a false value ("0", "false", ...)."""
    return os.environ.get("MC_FORCE_TCP", "").strip().lower() not in _FALSE


def our_protocol(protocol: str, nics: Sequence[str], pinned: bool) -> str:
    """Our transport for upstream's `protocol`: "tcp" stays tcp; "rdma" is RDMA where a NIC
    opens and TCP otherwise ("auto"), as upstream's auto-discovery picks, unless `pinned`
    with `nics` named (upstream's Store then installs RDMA on those NICs or fails: "rdma");
    MC_FORCE_TCP makes every protocol tcp."""
    if force_tcp() or protocol == "tcp":
        return "tcp"
    return "rdma" if pinned and nics else "auto"


class TransferOpcode(enum.IntEnum):
    """Direction of a transfer_sync / batch_transfer_sync / batch_transfer_async call."""

    Read = 0
    Write = 1
    READ = 0  # NOTE: upstream's docs spell them READ/WRITE, its binding Read/Write
    WRITE = 1


class TransferNotify:
    """A message delivered to the peer after a transfer (its get_notifies() returns it)."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class _Refused(Exception):
    """A call refused before anything moved: its return code and why."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


@dataclass
class _Peer:
    """A peer engine and the buffers of it learnt so far (by address)."""

    host: str
    port: int
    buffers: list[BufferDesc] = field(default_factory=list)

    def find(self, address: int, length: int) -> BufferDesc | None:
        k = bisect.bisect_right(self.buffers, address, key=lambda b: b.address) - 1
        return self.buffers[k] if k >= 0 and self.buffers[k].holds(address, length) else None

    def learn(self, found: BufferDesc) -> None:
        end = found.address + found.segment.num_bytes
        self.buffers = [
            b
            for b in self.buffers
            if b.address >= end or b.address + b.segment.num_bytes <= found.address
        ]
        bisect.insort(self.buffers, found, key=lambda b: b.address)


def _timeout_s(num_bytes: int) -> float:
    """Upstream's deadline of a synchronous transfer: MC_TRANSFER_TIMEOUT seconds (at least
    5, default 30) plus a second per GB."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT", "")
    base = max(5, int(raw)) if raw.strip().isdigit() else 30
    return base + num_bytes / 1e9


class TransferEngine:
    """Upstream's `mooncake.engine.TransferEngine`; see the table in mooncake/engine/__init__.py."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._inner: InnerEngine | None = None
        self._directory: AddressDirectory | None = None
        self._metadata: BaseMetadata = BaseMetadata()
        self._secret = b""
        self._name = ""  # this engine's name for peers: "ip:port", or local_hostname
        self._lock = threading.Lock()
        self._local = AddressIndex()  # registered and managed buffers of this process
        self._managed: dict[int, np.ndarray] = {}  # address -> memory of a managed buffer
        self._peers: dict[str, _Peer] = {}  # target_hostname -> what we know of it
        self._batches: dict[int, Batch] = {}  # batch id -> submitted batch
        self._batch_ids = itertools.count(1)  # NOTE: 0 is the failure value
        self._notifies: deque[TransferNotify] = deque(maxlen=MAX_NOTIFIES)

    # -- initialization ---------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Start the engine; 0, or a negative code (the reason logged). metadata_server:
        "P2PHANDSHAKE", "http://HOST:PORT/metadata", "etcd://HOST:PORT" or "HOST:PORT"."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """initialize() with the kind of metadata service named apart ("etcd", "http", "p2p")."""
        if self._inner is not None:
            log.error("TransferEngine.initialize: this engine is initialized already")
            return ERR_INVALID_ARGUMENT
        if protocol not in PROTOCOLS:
            log.error(
                "TransferEngine.initialize: protocol %r is not supported here; use %s",
                protocol,
                " or ".join(map(repr, PROTOCOLS)),
            )
            return ERR_INVALID_ARGUMENT
        try:
            self._secret = engine_secret()
            self._metadata = connect_metadata(metadata_server, metadata_type)
            self._start(local_hostname, protocol, device_name)
        except MooncakeError as e:
            log.error("TransferEngine.initialize failed: %s", e)
            self.close()
            return ERR_INVALID_ARGUMENT
        except OSError as e:
            log.error("TransferEngine.initialize: cannot listen on %r: %s", local_hostname, e)
            self.close()
            return ERR_INVALID_ARGUMENT
        try:
            self._metadata.publish(self._name, *self._advertised())
        except TransferError as e:
            log.error("TransferEngine.initialize: cannot publish %r: %s", self._name, e)
            self.close()
            return ERR_METADATA
        return 0

    def _start(self, local_hostname: str, protocol: str, device_name: str) -> None:
        host, _, port_text = local_hostname.rpartition(":")
        if not host or not port_text.isdigit():
            host, port_text = local_hostname, ""
        host = host.strip("[]") or "127.0.0.1"
        port = int(port_text) if port_text and os.environ.get("MC_LEGACY_RPC_PORT_BINDING") else 0
        nics = tuple(n.strip() for n in device_name.split(",") if n.strip())
        # NOTE: upstream's Python engine ignores `protocol`: it auto-discovers (RDMA if a
        # NIC of device_name opens, else TCP; transfer_engine_py.cpp builds it so)
        options = EngineOptions(
            protocol=our_protocol(protocol, nics, pinned=False),  # type: ignore[arg-type]
            nics=nics if protocol == "rdma" else (),
            timeout_s=_timeout_s(0),
        )
        self._directory = AddressDirectory(self._secret, options.handshake_timeout_s)
        bind = os.environ.get("MC_TCP_BIND_ADDRESS") or host
        advertised = host
        try:
            inner = self._make_inner(options, bind, port)
        except OSError:
            if bind != host:
                raise
            # a name, not an address of this host (upstream's local_hostname may be any
            # name with a metadata service): listen everywhere, tell peers our host name
            inner = self._make_inner(options, "0.0.0.0", port)
            advertised = socket.gethostname()
            log.info("%r is no address here: listening on all, advertising %r", host, advertised)
        inner.endpoints = [EndpointDesc("", advertised, inner.server.port)]
        inner.server.handlers[Op.DESCRIBE_ADDRESS] = self._local.handler(inner.describe)
        inner.server.handlers[Op.NOTIFY] = self._on_notify
        self._inner = inner
        p2p = type(self._metadata) is BaseMetadata
        self._name = f"{host}:{inner.server.port}" if p2p else local_hostname

    def _make_inner(self, options: EngineOptions, host: str, port: int) -> InnerEngine:
        assert self._directory is not None
        name = f"{host}:{port}"
        return InnerEngine(
            name, self._secret, options, host=host, port=port, directory=self._directory
        )

    def _advertised(self) -> tuple[str, int]:
        inner = self._engine()
        return inner.endpoints[0].host, inner.server.port

    def _engine(self) -> InnerEngine:
        if self._inner is None:
            raise _Refused(ERR_INVALID_ARGUMENT, "the engine is not initialized (initialize())")
        return self._inner

    def get_rpc_port(self) -> int:
        """The port peers name this engine by ("ip:port"); -1 before initialize()."""
        return self._inner.server.port if self._inner is not None else -1

    def get_engine(self) -> InnerEngine | None:
        """The inner engine (mooncake.transfer.TransferEngine), for a Store to share; None
        before initialize(). Upstream returns its C++ engine here."""
        return self._inner

    def close(self) -> None:
        """Withdraw from the metadata service and stop the engine (not in upstream's API,
        whose engine stops when the object is collected)."""
        inner, self._inner = self._inner, None
        if inner is not None:
            self._metadata.withdraw(self._name)
            inner.close()
        self._metadata.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.close()

    # -- memory -----------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register [buffer_addr, +capacity) (host or CUDA memory) for transfers; 0, or
        -7 when it overlaps registered memory, -1 for an address that is no memory here."""
        try:
            return self._register(buffer_addr, capacity, location)
        except _Refused as e:
            log.error("register_memory(%#x, %d): %s", buffer_addr, capacity, e)
            return e.code

    def _register(self, address: int, capacity: int, location: str) -> int:
        inner = self._engine()
        try:
            memory, where = memory_at(address, capacity)
        except ValueError as e:
            raise _Refused(ERR_INVALID_ARGUMENT, str(e)) from e
        if location.startswith("cpu:") and where.startswith("cpu"):
            where = location  # NOTE: upstream's "cpu:N" names the NUMA node
        return self._add(inner, address, capacity, f"mem-{address:x}", memory, where)

    def _add(
        self, inner: InnerEngine, address: int, num_bytes: int, name: str, memory: Any, where: str
    ) -> int:
        other = self._local.add(address, num_bytes, name)
        if other is not None:
            raise _Refused(
                ERR_ADDRESS_OVERLAPPED,
                f"overlaps the registered buffer [{other.address:#x}, {other.end:#x})",
            )
        try:
            inner.register(name, memory, where)
        except MooncakeError as e:
            self._local.remove(address)
            raise _Refused(ERR_INVALID_ARGUMENT, str(e)) from e
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregister the buffer registered at `buffer_addr`; 0, or -3 if none starts there."""
        try:
            return self._unregister(buffer_addr, managed=False)
        except _Refused as e:
            log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return e.code

    def _unregister(self, address: int, managed: bool) -> int:
        inner = self._engine()
        with self._lock:
            is_managed = address in self._managed
            if is_managed != managed:
                why = "use free_managed_buffer" if is_managed else "not a managed buffer"
                raise _Refused(ERR_ADDRESS_NOT_REGISTERED, f"{address:#x}: {why}")
            span = self._local.remove(address)
            self._managed.pop(address, None)
        if span is None:
            raise _Refused(ERR_ADDRESS_NOT_REGISTERED, "no buffer is registered at this address")
        inner.unregister(span.segment)
        return 0

    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*"
    ) -> int:
        """register_memory of each; 0, or the first failure's code (the ones before stay)."""
        if len(buffer_addresses) != len(capacities):
            log.error(
                "batch_register_memory: %d addresses but %d capacities",
                len(buffer_addresses),
                len(capacities),
            )
            return ERR_INVALID_ARGUMENT
        for address, capacity in zip(buffer_addresses, capacities, strict=True):
            rc = self.register_memory(address, capacity, location)
            if rc:
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """unregister_memory of each; 0, or the last failure's code (the others still go)."""
        rc = 0
        for address in buffer_addresses:
            rc = self.unregister_memory(address) or rc
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """A new registered, zero-filled host buffer of `length` bytes: its address, or 0."""
        try:
            inner = self._engine()
            if length <= 0:
                raise _Refused(ERR_INVALID_ARGUMENT, f"length must be > 0, got {length}")
            memory = np.zeros(length, dtype=np.uint8)
            address = memory.ctypes.data
            with self._lock:
                self._managed[address] = memory
            try:
                self._add(inner, address, length, f"managed-{address:x}", memory, "cpu:0")
            except _Refused:
                with self._lock:
                    self._managed.pop(address, None)
                raise
        except _Refused as e:
            log.error("allocate_managed_buffer(%d): %s", length, e)
            return 0
        return address

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Free a buffer of allocate_managed_buffer; 0, or -3 if it is not one."""
        try:
            return self._unregister(buffer_addr, managed=True)
        except _Refused as e:
            log.error("free_managed_buffer(%#x, %d): %s", buffer_addr, length, e)
            return e.code

    def _host_range(self, address: int, length: int) -> memoryview:
        span = self._local.find(address, length) if length >= 0 else None
        region = self._inner.segments.get(span.segment) if span and self._inner else None
        if span is None or region is None or region.view.mv is None:
            raise _Refused(
                ERR_ADDRESS_NOT_REGISTERED,
                f"[{address:#x}, +{length}) is not inside host memory registered with "
                "register_memory or allocate_managed_buffer",
            )
        start = address - span.address
        return region.view.mv[start : start + length]

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copy the first `length` bytes of `src_ptr` to `dest_address`; 0, or -1/-3 when
        `src_ptr` is shorter or the range is not registered host memory."""
        try:
            if len(src_ptr) < length:
                raise _Refused(ERR_INVALID_ARGUMENT, f"{len(src_ptr)} bytes given, {length} asked")
            self._host_range(dest_address, length)[:] = memoryview(src_ptr)[:length]
        except _Refused as e:
            log.error("write_bytes_to_buffer(%#x, %d): %s", dest_address, length, e)
            return e.code
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """A copy of `length` bytes at `source_address`. Raises ValueError unless the range
        is registered host memory (upstream reads any address)."""
        try:
            return bytes(self._host_range(source_address, length))
        except _Refused as e:
            raise ValueError(f"read_bytes_from_buffer: {e}") from None

    # -- peers ------------------------------------------------------------------------------

    def _peer(self, target: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(target)
        if peer is not None:
            return peer
        try:
            host, port = self._metadata.resolve(target)
        except TransferError as e:
            raise _Refused(ERR_INVALID_ARGUMENT, str(e)) from e
        with self._lock:
            return self._peers.setdefault(target, _Peer(host, port))

    def _ask(self, peer: _Peer, query: AddressQuery) -> BufferDesc | None:
        assert self._directory is not None
        found = self._directory.ask_address(peer.host, peer.port, query)
        if found is not None:
            with self._lock:
                peer.learn(found)
        return found

    def _remote(self, target: str, peer: _Peer, address: int, length: int) -> BufferDesc:
        with self._lock:
            found = peer.find(address, length)
        if found is None:
            found = self._ask(peer, AddressQuery(address, length))
        if found is None:
            raise _Refused(
                ERR_ADDRESS_NOT_REGISTERED,
                f"[{address:#x}, +{length}) is not inside memory {target} registered",
            )
        return found

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer answers an authenticated request, else -1."""
        try:
            self._engine()
            self._ask(self._peer(peer_server_name), AddressQuery(0, 0, first=True))
        except (_Refused, TransferError) as e:
            log.warning("send_probe(%r): %s", peer_server_name, e)
            return -1
        return 0

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer `segment_name` ("ip:port", or this engine's own
        name) registered, or 0 when it has none or cannot be reached."""
        if segment_name == self._name:
            first = self._local.first()
            return first.address if first is not None else 0
        try:
            self._engine()
            found = self._ask(self._peer(segment_name), AddressQuery(0, 0, first=True))
        except (_Refused, TransferError) as e:
            log.warning("get_first_buffer_address(%r): %s", segment_name, e)
            return 0
        return found.address if found is not None else 0

    # -- transfers --------------------------------------------------------------------------

    def _plan(
        self,
        target: str,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
    ) -> tuple[_Peer, list[TransferRequest]]:
        """The inner engine's requests for one call; raises _Refused, nothing moved."""
        self._engine()
        if not len(buffers) == len(peer_addresses) == len(lengths):
            raise _Refused(
                ERR_INVALID_ARGUMENT,
                f"{len(buffers)} buffers, {len(peer_addresses)} peer addresses and "
                f"{len(lengths)} lengths: need as many of each",
            )
        if opcode not in (TransferOpcode.Read, TransferOpcode.Write):
            raise _Refused(ERR_INVALID_ARGUMENT, f"opcode must be a TransferOpcode, got {opcode!r}")
        op = TransferOp.WRITE if opcode == TransferOpcode.Write else TransferOp.READ
        peer = self._peer(target)
        reqs = []
        for address, remote_address, length in zip(buffers, peer_addresses, lengths, strict=True):
            if length <= 0:
                raise _Refused(ERR_INVALID_ARGUMENT, f"length must be > 0, got {length}")
            span = self._local.find(address, length)
            if span is None:
                raise _Refused(
                    ERR_ADDRESS_NOT_REGISTERED,
                    f"local [{address:#x}, +{length}) is not inside memory registered with "
                    "register_memory or allocate_managed_buffer",
                )
            found = self._remote(target, peer, remote_address, length)
            remote = f"{found.segment.name}@{peer.host}:{peer.port}"
            offset = remote_address - found.address
            reqs.append(
                TransferRequest(
                    op,
                    span.segment,
                    address - span.address,
                    remote,
                    offset,
                    length,
                    found.segment.token,
                )
            )
        return peer, reqs

    def _run(
        self,
        what: str,
        target: str,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        notify: TransferNotify | None = None,
    ) -> int:
        """A synchronous transfer: 0 once every byte moved (and `notify` was delivered), -1
        otherwise. A failure after which the peer's buffers turn out to have changed (one
        re-registered: a new token) is tried once more with the fresh answers."""
        try:
            peer, reqs = self._plan(target, buffers, peer_addresses, lengths, opcode)
            inner = self._engine()
            for attempt in range(2):
                statuses = inner.transfer(reqs, _timeout_s(sum(lengths))).poll()
                bad = [s for s in statuses if s.state is not TransferState.DONE]
                if not bad:
                    break
                with self._lock:
                    peer.buffers = []
                _, fresh = self._plan(target, buffers, peer_addresses, lengths, opcode)
                if attempt or [r.remote_token for r in fresh] == [r.remote_token for r in reqs]:
                    raise _Refused(
                        -1, f"{len(bad)} of {len(reqs)} requests failed: {bad[0].reason}"
                    )
                log.info(
                    "%s: %s registered its buffers again; trying with the new ones", what, target
                )
                reqs = fresh
            if notify is not None:
                self._notify(peer, notify)
        except (_Refused, MooncakeError) as e:
            log.error("%s to %r failed: %s", what, target, e)
            return -1
        return 0

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Write `length` bytes at local `buffer` to the peer's address; 0 or -1."""
        return self._run(
            "transfer_sync_write",
            target_hostname,
            [buffer],
            [peer_buffer_address],
            [length],
            TransferOpcode.Write,
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Read `length` bytes at the peer's address into local `buffer`; 0 or -1."""
        return self._run(
            "transfer_sync_read",
            target_hostname,
            [buffer],
            [peer_buffer_address],
            [length],
            TransferOpcode.Read,
        )

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """transfer_sync_write or _read by `opcode`, then deliver `notify` to the peer."""
        return self._run(
            "transfer_sync",
            target_hostname,
            [buffer],
            [peer_buffer_address],
            [length],
            opcode,
            notify,
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Write each local buffer to its peer address; 0 once all moved, else -1."""
        return self._run(
            "batch_transfer_sync_write",
            target_hostname,
            buffers,
            peer_buffer_addresses,
            lengths,
            TransferOpcode.Write,
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Read each peer address into its local buffer; 0 once all moved, else -1."""
        return self._run(
            "batch_transfer_sync_read",
            target_hostname,
            buffers,
            peer_buffer_addresses,
            lengths,
            TransferOpcode.Read,
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """batch_transfer_sync_write or _read by `opcode`, then deliver `notify`."""
        return self._run(
            "batch_transfer_sync",
            target_hostname,
            buffers,
            peer_buffer_addresses,
            lengths,
            opcode,
            notify,
        )

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        transport_hint: str = "",
    ) -> int:
        """Start the transfers and return a batch id (> 0) for get_batch_transfer_status /
        transfer_check_status, or 0 when they cannot start (the reason logged)."""
        try:
            _, reqs = self._plan(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)
            batch = self._engine().submit(reqs, _timeout_s(sum(lengths)))
        except (_Refused, MooncakeError) as e:
            log.error("batch_transfer_async to %r failed: %s", target_hostname, e)
            return 0
        with self._lock:
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = batch
        return batch_id

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """batch_transfer_async of writes; a batch id, or 0."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, TransferOpcode.Write
        )

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """batch_transfer_async of reads; a batch id, or 0."""
        return self.batch_transfer_async(
            target_hostname, buffers, peer_buffer_addresses, lengths, TransferOpcode.Read
        )

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """One asynchronous write; a batch id for transfer_check_status, or 0."""
        return self.batch_transfer_async(
            target_hostname, [buffer], [peer_buffer_address], [length], TransferOpcode.Write
        )

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch; 0 if all moved every byte, -1 if one failed or timed out
        (or an id is unknown). The ids are spent either way."""
        with self._lock:
            batches = [self._batches.pop(i, None) for i in batch_ids]
        rc = 0
        for batch_id, batch in zip(batch_ids, batches, strict=True):
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %r", batch_id)
                rc = -1
                continue
            bad = [s for s in batch.wait() if s.state is not TransferState.DONE]
            if bad:
                log.error("batch %d: %d requests failed: %s", batch_id, len(bad), bad[0].reason)
                rc = -1
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done (the id is spent), 0 still moving, -1 failed or unknown, -2 timed out."""
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None:
            return -1
        statuses = batch.poll()
        if any(s.state is TransferState.PENDING for s in statuses):
            return 0
        with self._lock:
            self._batches.pop(batch_id, None)
        states = {s.state for s in statuses}
        if states == {TransferState.DONE}:
            return 1
        return -2 if TransferState.TIMED_OUT in states else -1

    # -- notifications ----------------------------------------------------------------------

    def _notify(self, peer: _Peer, notify: TransferNotify) -> None:
        payload = _encode((str(notify.name), str(notify.msg)))
        timeout = self._engine().options.handshake_timeout_s
        try:
            status, _ = control_call(
                peer.host, peer.port, self._secret, Op.NOTIFY, payload, timeout
            )
        except (OSError, MooncakeError) as e:
            raise TransferError(f"the notification did not reach the peer: {e}") from e
        if status != Status.OK:
            raise TransferError(f"the peer refused the notification: {status_text(status)}")

    def _on_notify(self, payload: bytes) -> tuple[Status, bytes]:
        try:
            name, msg = _decode_notify(payload)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed NOTIFY: {e}") from e
        self._notifies.append(TransferNotify(name, msg))
        return Status.OK, b""

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications peers sent with their transfers since the last call, in order."""
        out = []
        while self._notifies:
            out.append(self._notifies.popleft())
        return out

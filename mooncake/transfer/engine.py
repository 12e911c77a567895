"""The Transfer Engine: register -> submit -> poll.

    engine = TransferEngine("prefill-0", secret)
    kv = engine.allocate("kv", 1 << 30)                    # shm-backed, peers may map it
    engine.directory.add_peer("10.0.0.7", 7000)            # or name "pool@10.0.0.7:7000"
    batch = engine.submit([TransferRequest(TransferOp.READ, "kv", 0, "pool", 4096, 65536)])
    batch.check(timeout=5.0)                               # or poll() / wait() / cancel()

Requests are validated in full before anything moves (a bad one rejects the whole batch
with TransferError), cut into slices, spread over the preferred paths of the best transport
both ends support, and a failed slice is retried on another path within the retry budget.
submit() returns at once (the bytes move while the caller computes: a prefill's KV stream);
transfer() waits, moving what the calling thread can itself (tcp: one small request, or the
first group: no thread hand-offs for a Store put or get); move() waits for one request;
start() begins one small request to finish later (a read on a hint: store/client/grants.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from mooncake.errors import TransferError
from mooncake.native.shm import sweep_stale
from mooncake.transfer.batch import Batch, Slice
from mooncake.transfer.directory import BaseDirectory, PeerDirectory
from mooncake.transfer.inline import Finish, InlineMover
from mooncake.transfer.paths import PathSet, nic_preference_for
from mooncake.transfer.segment import Region, SegmentTable, range_error
from mooncake.transfer.server import TcpServer
from mooncake.transfer.staged import StagePath
from mooncake.transfer.staging import BaseStaging, Stager
from mooncake.transfer.tcp import TcpPath, TcpTransport
from mooncake.transfer.transport import (
    BaseTransport,
    CopyPool,
    LocalTransport,
    ShmTransport,
    Target,
    TargetCache,
    host_identity,
)
from mooncake.transfer.types import (
    EndpointDesc,
    EngineOptions,
    SegmentDesc,
    TransferOp,
    TransferRequest,
)
from mooncake.transfer.wire import Op, Status, check_secret

log = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode


class TransferEngine:
    """One node's Transfer Engine: its segments, its server, and its transports."""

    def __init__(
        self,
        name: str,
        secret: bytes | str,
        options: EngineOptions | None = None,
        *,
        host: str = "127.0.0.1",  # address the data-plane server binds
        port: int = 0,  # 0: the first free one of options.ports (any, by default)
        endpoints: list[EndpointDesc] | None = None,  # advertised; default: host:port
        directory: BaseDirectory | None = None,
        nic_preference: Mapping[str, Any] | None = None,  # Topology.nic_preference
        nic_addresses: Mapping[str, str] | None = None,  # local NIC -> source IP for tcp
        verbs: Any = None,  # pyverbs-like provider for rdma; None = load pyverbs if asked
        rdma_provider: str | int = "verbs",  # the RDMA C loop's verbs: "stub", a table's address
        staging: BaseStaging | None = None,  # device memory over tcp/shm; None = CUDA's
    ):
        self.name = name
        self.options = options or EngineOptions()
        self._secret = secret.encode() if isinstance(secret, str) else secret
        check_secret(self._secret)
        self.nic_preference = dict(nic_preference or {})
        self.host_id = host_identity()
        sweep_stale()  # arenas of this host's crashed nodes would otherwise hold memory
        self.segments = SegmentTable()
        self._staging = staging
        chunk, num = self.options.stage_chunk_bytes, self.options.copy_threads
        self.server = TcpServer(
            self.segments,
            self._secret,
            host,
            port or self.options.ports,
            handshake_timeout_s=self.options.handshake_timeout_s,
            max_pending_handshakes=self.options.max_pending_handshakes,
            stager=Stager(staging, chunk, num),
        )
        self.server.handlers[Op.DESCRIBE] = self._on_describe
        wildcard = host in ("0.0.0.0", "::", "")
        self.endpoints = endpoints or [
            EndpointDesc("", socket.gethostname() if wildcard else host, self.server.port)
        ]
        self.directory = directory or PeerDirectory(self._secret, self.options.slice_io_timeout_s)
        self.num_retries = 0  # slices re-dispatched after a failure
        self._bytes: dict[str, int] = {}  # transport -> bytes moved (both directions)
        self._bytes_lock = threading.Lock()
        self._io_timeout_s = self.options.slice_io_timeout_s
        self._pool = CopyPool(
            self._report, self._report_done, self.options.copy_threads, self.options.group_bytes
        )
        self._transports: dict[str, BaseTransport] = {
            "local": LocalTransport(self._report, self._pool, self.segments.get, name),
            "shm": ShmTransport(self._report, self._pool, self.host_id),
            "tcp": TcpTransport(
                self._report, self._report_done, self._secret, self.options, nic_addresses
            ),
        }
        self.stager = Stager(staging, chunk, num)  # this node's requests of device memory
        self._stage_path = StagePath(self.forget, self._pathset, self.options, self.stager, num)
        self._targets = TargetCache(
            self._transports,
            self.options.protocol,
            lambda name: self.describe(name) or self.directory.lookup(name),
        )
        self._inline = InlineMover(self._check, self._pathset, self._targets.peek, self.options)
        if self.options.protocol in ("rdma", "auto"):
            from mooncake.transfer.rdma import create_rdma_transport

            try:
                rdma = create_rdma_transport(
                    self._report,
                    self.name,
                    self._secret,
                    self.options,
                    verbs,
                    required=self.options.protocol == "rdma",
                    provider=rdma_provider,
                    report_done=self._report_done,
                )
            except BaseException:
                self.close()
                raise
            if rdma is not None:
                self.server.handlers[Op.RDMA_CONNECT] = rdma.on_connect
                self._transports["rdma"] = rdma

    def bytes_by_transport(self) -> dict[str, int]:
        """Bytes this engine moved, read or written, per transport since start."""
        with self._bytes_lock:
            return dict(self._bytes)

    def _count(self, target: Target | None, num_bytes: int) -> None:
        # NOTE: inline.py's moves record nothing; transfer(), move() and start() count them
        if target is not None:
            name = target.transport.name
            with self._bytes_lock:
                self._bytes[name] = self._bytes.get(name, 0) + num_bytes

    @property
    def transport_names(self) -> list[str]:
        """Transports this engine can use ("local", "shm", "tcp", and "rdma" if usable)."""
        return list(self._transports)

    # -- segments ---------------------------------------------------------------------------

    def register(self, name: str, buffer: Any, location: str | None = None) -> SegmentDesc:
        """Register `buffer` (numpy array, torch tensor, bytearray...) as segment `name`."""
        view = self._staging.device_view(buffer, location) if self._staging else None
        return self._publish(self.segments.register(name, buffer, location, view))

    def allocate(self, name: str, num_bytes: int, location: str | None = None) -> Any:
        """A new zero-filled shared-memory segment; returns its uint8 numpy array. A
        `location` "cpu:N" places it on NUMA node N; None: "cpu:0", pages where touched."""
        region = self.segments.allocate(name, num_bytes, location)
        self._publish(region)
        return region.array

    def _publish(self, region: Region) -> SegmentDesc:
        rdma = self._transports.get("rdma")
        if rdma is not None:
            try:
                rdma.register_region(region)  # type: ignore[attr-defined]
            except BaseException:
                self.segments.unregister(region.name)  # NOTE: the name is free again
                raise
        desc = self.describe(region.name)
        assert desc is not None, region.name
        self.directory.publish(desc)
        return desc

    def unregister(self, name: str) -> None:
        """Remove segment `name`; peers' requests for it fail from now on."""
        region = self.segments.unregister(name)
        rdma = self._transports.get("rdma")
        if rdma is not None:
            rdma.unregister_region(region)  # type: ignore[attr-defined]
        self.directory.withdraw(name)

    def describe(self, name: str) -> SegmentDesc | None:
        """The descriptor peers use to reach local segment `name` (None if not registered)."""
        region = self.segments.get(name)
        if region is None:
            return None
        pref = nic_preference_for(self.nic_preference, region.location)
        nics = list(getattr(pref, "preferred", []) or [])
        return region.describe(self.name, self.host_id, self.endpoints, nics)

    def _on_describe(self, payload: bytes) -> tuple[Status, bytes]:
        desc = self.describe(payload.decode("utf-8", "replace"))
        return (Status.OK, _encode(desc)) if desc is not None else (Status.NO_SEGMENT, b"")

    # -- transfers --------------------------------------------------------------------------

    def resolve(self, name: str) -> Target:
        """The remote segment `name`, resolved and cached; raises TransferError."""
        return self._targets.resolve(name)

    def forget(self, name: str) -> None:
        """Drop the cached resolution of `name` (next use asks the directory again)."""
        self._targets.forget(name)

    def submit(self, requests: Iterable[TransferRequest], timeout: float | None = None) -> Batch:
        """Validate every request, then start moving them; returns the Batch handle.

        Raises TransferError listing each bad request (unknown segment, range outside a
        segment, zero length) before anything is transferred. `timeout` (seconds, default
        options.timeout_s) sets the batch deadline.
        """
        batch, by_path = self._plan(requests, timeout)
        for path, slices in by_path.items():
            path.dispatch(slices)
        return batch

    def transfer(self, requests: Iterable[TransferRequest], timeout: float | None = None) -> Batch:
        """submit() and wait: returns the Batch once every request ended (check() or poll()
        it). The calling thread moves the first group of slices itself where the transport
        allows it (tcp), so a small transfer costs no thread hand-off; the rest go to the
        transport's threads as with submit(). Raises TransferError as submit() does."""
        reqs = list(requests)
        if len(reqs) == 1 and self._inline.move_now(reqs[0], timeout):
            self._count(self._targets.peek(reqs[0].remote_segment), reqs[0].length)
            return Batch.done(reqs)
        batch, by_path = self._plan(reqs, timeout)
        # NOTE: a stalled socket blocks its thread for up to slice_io_timeout_s: not the
        # caller's when that is past the batch deadline
        can_inline = (timeout or self.options.timeout_s) >= self._io_timeout_s
        here = None
        for path, slices in by_path.items():
            if here is None and can_inline and isinstance(path, TcpPath):
                here = path, slices
            else:
                path.dispatch(slices)
        if here is not None:
            here[0].run_inline(here[1])
        if batch.num_open:
            batch.wait()
        return batch

    def move(self, r: TransferRequest, timeout: float | None = None) -> None:
        """Move one request and wait for it; raises TransferError if it did not end DONE.
        transfer([r]).check() without building a Batch when the caller's thread moves it."""
        if self._inline.move_now(r, timeout):
            self._count(self._targets.peek(r.remote_segment), r.length)
        else:
            self.transfer([r], timeout).check()

    def start(self, r: TransferRequest, timeout: float | None = None) -> Finish | None:
        """Begin one small request on this thread; returns the call that ends it:
        finish() waits (True once moved, False if it failed: move() it then),
        finish(False) abandons it. None if it cannot begin that way (nothing sent).
        See transfer/inline.py."""
        finish = self._inline.start_move(r, timeout)
        if finish is None:
            return None

        def counted(wait: bool = True) -> bool:
            moved = finish(wait)
            if moved:
                self._count(self._targets.peek(r.remote_segment), r.length)
            return moved

        return counted

    def _plan(
        self, requests: Iterable[TransferRequest], timeout: float | None
    ) -> tuple[Batch, dict[Any, list[Slice]]]:
        """Validate `requests` (TransferError if any is bad), cut them into slices and
        choose each slice's path; returns the batch and path -> slices, nothing dispatched."""
        reqs = list(requests)
        plan, errors = [], []
        for i, r in enumerate(reqs):
            try:
                plan.append((r, *self._check(r)))
            except TransferError as e:
                errors.append(f"request {i}: {e}")
        if errors:
            more = f"\n  ... and {len(errors) - 8} more" if len(errors) > 8 else ""
            raise TransferError(
                "batch rejected, nothing was transferred:\n  " + "\n  ".join(errors[:8]) + more
            )
        batch = Batch(reqs, time.monotonic() + (timeout or self.options.timeout_s))
        by_path: dict[Any, list[Slice]] = {}
        for i, (r, local, target) in enumerate(plan):
            if local.view.mv is None and target.transport.name != "rdma":
                self._stage_path.add(batch, i, local, target, by_path)  # device: staged
            else:
                ps = self._pathset(target, local.location)
                target.transport.plan(
                    batch, i, local, r.local_offset, target, ps, self.options, by_path
                )
        return batch, by_path

    def _check(self, r: TransferRequest) -> tuple[Region, Target]:
        if not isinstance(r.op, TransferOp):
            raise TransferError(f"op must be TransferOp.READ or WRITE, got {r.op!r}")
        local = self.segments.get(r.local_segment)
        if local is None:
            raise TransferError(f"local segment {r.local_segment!r} is not registered here")
        length, offset = r.length, r.local_offset
        if length <= 0 or offset < 0 or offset + length > local.view.num_bytes:
            raise TransferError(local.bounds_error(offset, length))
        on_device = local.view.mv is None  # NOTE: the transport depends on where it lives
        target = self._targets.resolve(r.remote_segment, on_device)
        if r.remote_token and target.desc.token != r.remote_token:
            self.forget(r.remote_segment)  # our descriptor may be the stale one
            target = self._targets.resolve(r.remote_segment, on_device)
            if target.desc.token != r.remote_token:
                raise TransferError(
                    f"segment {r.remote_segment!r} was registered again since the request's "
                    "descriptor was issued (token mismatch); ask its owner for a fresh one"
                )
        desc, offset = target.desc, r.remote_offset
        if offset < 0 or offset + length > desc.num_bytes:
            raise TransferError(range_error(desc.name, desc.num_bytes, offset, length))
        return local, target

    def _pathset(self, target: Target, location: str) -> PathSet:
        ps = target.pathsets.get(location)
        if ps is None:
            pref = nic_preference_for(self.nic_preference, location)
            paths = target.transport.paths(target)
            ps = target.pathsets.setdefault(
                location, PathSet(paths, pref, target.desc.preferred_nics)
            )
        return ps

    def _report_done(self, slices: list[Slice]) -> None:
        """Successful completion of slices that all went over one path (a transport thread)."""
        self._count(slices[0].target, sum(s.length for s in slices))
        if len(slices) == 1:
            s = slices[0]
            s.path.record_success(s.length)
            s.batch.slices_done(slices)
            return
        slices[0].path.record_success(sum(s.length for s in slices), len(slices))
        batch, start = slices[0].batch, 0
        for k, s in enumerate(slices):
            if s.batch is not batch:
                batch.slices_done(slices[start:k])
                batch, start = s.batch, k
        batch.slices_done(slices[start:])

    def _report(self, s: Slice, error: str, retryable: bool, is_path_fault: bool = True) -> None:
        """Completion of one slice attempt, from a transport's thread. `is_path_fault`
        False: a consequence of a failure already counted (work flushed from a QP in error)."""
        if not error:
            self._report_done([s])
            return
        if retryable and is_path_fault and s.path.record_failure():
            log.warning("path %s paused after repeated failures (last: %s)", s.path.key, error)
        if not retryable or s.attempt >= self.options.retry_budget:
            tries = f" (after {s.attempt + 1} attempts)" if retryable else ""
            s.batch.fail(s.index, f"{error}{tries}")
            # the descriptor may be stale (segment re-registered, peer restarted elsewhere):
            # the next submit asks the directory again
            self.forget(s.batch.requests[s.index].remote_segment)
            return
        if not s.batch.is_live(s.index):
            return
        s.attempt += 1
        s.tried.append(s.path)
        path = self._pathset(s.target, s.local.location).retry(s)
        if path is None:
            s.batch.fail(s.index, f"{error}; every other path is paused")
            return
        self.num_retries += 1
        log.info("retrying %r on %s after: %s", s, path.key, error)
        s.path = path
        path.dispatch([s])

    def close(self) -> None:
        """Stop the server and every transport, and unregister every segment."""
        self.server.close()
        self._stage_path.close()
        for t in self._transports.values():
            t.close()
        self._pool.close()
        self._targets.close()
        self.segments.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The transport interface, the choice of transport per remote segment (`TargetCache`),
and the two copy transports: `local` (the segment is in this process) and `shm` (the
segment is in POSIX shared memory of a process on this host).

Copy transports need no socket on the data path: a pool of threads copies slices with
numpy, which releases the GIL for the memcpy, so two copies run on two cores at once.

How a remote segment's transport is chosen (`TargetCache.choose`), once per segment name
and kind of local buffer (host or device memory):
- `local` when the segment is host memory registered on this very engine;
- with `transfer.protocol = "auto"`: `shm` when the segment lives in POSIX shared memory
  and its owner has this engine's host id (same host name, boot id and /dev/shm device:
  processes in separate network namespaces still qualify, a container with its own
  /dev/shm does not); else `rdma` when this engine has a usable RDMA NIC and the segment
  is registered on one of the owner's NICs; else `tcp` to the owner's data-plane endpoint.
  A device-memory local buffer tries `rdma` first (the NIC reads it in place), then shm,
  tcp and local, which stage it through pinned host memory (transfer/staging.py);
- with any other protocol, that one, or a TransferError saying what the peer offers.
The first choice for each peer endpoint is logged at INFO with its reason; the engine
counts the bytes each transport moved (`TransferEngine.bytes_by_transport`).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mooncake.errors import TransferError
from mooncake.native.shm import ShmArena
from mooncake.transfer.batch import Batch, Slice, chunked, contiguous_runs
from mooncake.transfer.paths import Path, PathSet, cut
from mooncake.transfer.types import EngineOptions, SegmentDesc, TransferOp

log = logging.getLogger(__name__)


class Report(Protocol):
    """The engine's completion entry point: a slice attempt ended, `error` "" on success;
    `is_path_fault` False for work flushed after an error already counted (a QP in error),
    which must not count against its path again."""

    def __call__(
        self, s: Slice, error: str, retryable: bool, is_path_fault: bool = True
    ) -> None: ...


@dataclass(eq=False)
class Target:
    """A remote segment resolved for transfers: its descriptor and how to reach it."""

    desc: SegmentDesc
    transport: BaseTransport
    remote_array: np.ndarray | None = None  # copy transports: the segment's bytes
    pathsets: dict[str, PathSet] = field(default_factory=dict)  # local location -> paths
    handle: Any = None  # transport state (e.g. an attached ShmArena)


class BaseTransport:
    """Moves slices to and from one kind of peer memory."""

    name = "base"
    coalesces = False  # moves adjacent slices of one path as one operation

    def __init__(self, report: Report):
        self.report = report

    def slice_bytes(self, options: EngineOptions) -> int:
        """Bytes per slice on this transport (the unit of path choice and retry). Copies and
        TCP streams gain nothing from slices below group_bytes, only Python overhead; RDMA
        overrides this with slice_bytes, since every slice is a work request a NIC runs in
        parallel."""
        return max(options.slice_bytes, options.group_bytes)

    def can_reach(self, desc: SegmentDesc) -> bool:  # pragma: no cover - interface
        """Whether this transport can reach `desc` from this node."""
        raise NotImplementedError

    def open(self, desc: SegmentDesc) -> Target:  # pragma: no cover - interface
        """Prepare transfers to `desc` (map it, connect...); raises TransferError."""
        raise NotImplementedError

    def paths(self, target: Target) -> list[Path]:  # pragma: no cover - interface
        """Every path to `target`'s node."""
        raise NotImplementedError

    def plan(
        self,
        batch: Batch,
        i: int,
        local: Any,
        local_offset: int,
        target: Target,
        pathset: PathSet,
        options: EngineOptions,
        by_path: dict[Any, list[Slice]],
    ) -> None:
        """Add request `i` of `batch` to `by_path` (what the engine dispatches: anything
        with a `dispatch(slices)`): cut into slices of slice_bytes, one path each."""
        cut(batch, i, local, local_offset, target, pathset, options, by_path)

    def release(self, target: Target) -> None:
        """Forget `target` (its segment was re-registered or is no longer used)."""

    def close(self) -> None:
        """Stop threads and close connections."""


class TargetCache:
    """Remote segments resolved to the best transport both ends support, cached by the name
    the caller used ("pool" or "pool@host:port")."""

    def __init__(
        self,
        transports: dict[str, BaseTransport],
        protocol: str,
        lookup: Callable[[str], SegmentDesc | None],
    ):
        self._transports = transports  # "local", "shm", "tcp", maybe "rdma" (shared, live)
        self._protocol = protocol  # "auto" or the one to force
        self._lookup = lookup  # name -> descriptor (own segments, then the directory)
        self._targets: dict[tuple[str, bool], Target] = {}  # (name, local on device) ->
        self._logged: set[tuple[str, str, bool]] = set()  # (peer, transport, on device)
        self._lock = threading.Lock()

    def peek(self, name: str, on_device: bool = False) -> Target | None:
        """The target of `name` if already resolved (never asks anyone)."""
        return self._targets.get((name, on_device))

    def resolve(self, name: str, on_device: bool = False) -> Target:
        """`name` resolved for a local buffer in host (or, `on_device`, device) memory."""
        target = self._targets.get((name, on_device))
        if target is not None:
            return target
        desc = self._lookup(name)
        if desc is None:
            raise TransferError(
                f"no node has segment {name!r}: register it there, add its owner with "
                "engine.directory.add_peer(host, port), or name it as NAME@HOST:PORT"
            )
        transport = self.choose(desc, on_device)
        target = transport.open(desc)
        self._log_choice(desc, transport, on_device)
        with self._lock:
            self._drop_earlier_lives(desc)
            return self._targets.setdefault((name, on_device), target)

    def _drop_earlier_lives(self, desc: SegmentDesc) -> None:
        """Forget the targets of `desc`'s owner that name other endpoints: the owner was
        restarted under its name (a node's process SIGKILLed and started again), so they
        are dead, and a shm one keeps the dead process's arena mapped (its memory resident)
        here for good. Slices in flight keep theirs until they end. The caller holds the
        lock."""
        dead = [
            key
            for key, t in self._targets.items()
            if t.desc.node == desc.node and t.desc.endpoints != desc.endpoints
        ]
        for key in dead:
            del self._targets[key]

    def _log_choice(self, desc: SegmentDesc, transport: BaseTransport, on_device: bool) -> None:
        """Log, once per peer endpoint, transport and kind of local buffer, which transport
        reaches it and why."""
        if transport.name == "local":
            return
        ep = desc.endpoints[0] if desc.endpoints else None
        peer = f"{ep.host}:{ep.port}" if ep else desc.node
        with self._lock:
            if (peer, transport.name, on_device) in self._logged:
                return
            self._logged.add((peer, transport.name, on_device))
        why = self.reason(desc, transport.name)
        if on_device:
            how = "read in place" if transport.name == "rdma" else "staged through host memory"
            why = f"{why}; the local buffer is device memory, {how}"
        log.info("peer %s (%s): %s: %s", peer, desc.node, transport.name, why)

    def reason(self, desc: SegmentDesc, chosen: str) -> str:
        """Why `chosen` reaches `desc` (the rule in this module's docstring)."""
        if self._protocol != "auto":
            return f"transfer.protocol = {self._protocol!r}"
        if chosen == "shm":
            return f"same host and /dev/shm: its segment /dev/shm/{desc.shm_name} is mapped here"
        if not desc.shm_name:
            why = "its segment is not in shared memory"
        else:
            why = "another host or another /dev/shm"
        if chosen == "rdma":
            nics = ", ".join(k.nic for k in desc.rdma)
            return f"{why}; both ends have RDMA NICs (its: {nics})"
        if "rdma" not in self._transports:
            return f"{why}; no usable RDMA NIC here"
        return f"{why}; it offers no RDMA NIC"

    def choose(self, desc: SegmentDesc, on_device: bool = False) -> BaseTransport:
        """For a host buffer: local for this engine's own segments, else the forced
        protocol, else (auto) the first of shm, rdma, tcp that reaches `desc`. For a device
        buffer (`on_device`) auto tries rdma first, which needs no staging."""
        t = self._transports
        if self._protocol == "auto":
            order = (
                ["rdma", "local", "shm", "tcp"] if on_device else ["local", "shm", "rdma", "tcp"]
            )
        else:
            order = ["local", self._protocol]
        for proto in order:
            if proto in t and t[proto].can_reach(desc):
                return t[proto]
        raise TransferError(
            f"segment {desc.name!r} on node {desc.node!r} cannot be reached with protocol "
            f"{self._protocol!r}: it offers {desc.protocols or ['nothing']} "
            f"(shm needs a shm-backed segment on this host; rdma needs pyverbs and a NIC)"
        )

    def forget(self, name: str) -> None:
        """Drop `name`; slices in flight keep their target (and its mapping) alive."""
        with self._lock:
            self._targets.pop((name, False), None)
            self._targets.pop((name, True), None)

    def close(self) -> None:
        with self._lock:
            targets, self._targets = list(self._targets.values()), {}
        for target in targets:
            target.transport.release(target)


def copy(
    op: TransferOp,
    local: np.ndarray,
    local_offset: int,
    remote: np.ndarray,
    remote_offset: int,
    length: int,
) -> None:
    """One copy transport move: READ copies remote -> local, WRITE local -> remote."""
    mine = local[local_offset : local_offset + length]
    theirs = remote[remote_offset : remote_offset + length]
    np.copyto(*((mine, theirs) if op is TransferOp.READ else (theirs, mine)))


class CopyPool:
    """Threads that copy chunks of slices between host arrays; adjacent slices are copied
    as one run, and numpy releases the GIL during each copy."""

    def __init__(
        self,
        report: Report,
        report_done: Callable[[list[Slice]], None],
        num_threads: int,
        chunk_bytes: int,
    ):
        self.report = report
        self.report_done = report_done
        self.chunk_bytes = chunk_bytes  # bytes one thread takes at a time
        self._queue: queue.SimpleQueue[tuple[list[Slice], Path] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"te-copy-{i}", daemon=True)
            for i in range(max(1, num_threads))
        ]
        for t in self._threads:
            t.start()

    def put(self, slices: list[Slice], path: Path) -> None:
        for chunk in chunked(slices, self.chunk_bytes):
            self._queue.put((chunk, path))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            chunk, path = item
            for run in contiguous_runs([s for s in chunk if s.batch.is_live(s.index)]):
                first = run[0]
                length = sum(s.length for s in run)
                try:
                    copy(
                        first.op,
                        first.local.array,
                        first.local_offset,
                        first.target.remote_array,
                        first.remote_offset,
                        length,
                    )
                except Exception as e:  # a bug or an unmapped segment: fail the run, not the pool
                    log.exception("copy of %r failed", first)
                    for s in run:
                        self.report(s, f"{path.key}: copy failed: {e}", False)
                else:
                    self.report_done(run)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class CopyPath(Path):
    """The single path of a copy transport."""

    def __init__(self, key: str, pool: CopyPool):
        super().__init__(key, "", "")
        self._pool = pool

    def dispatch(self, slices: list[Slice]) -> None:
        self._pool.put(slices, self)


class LocalTransport(BaseTransport):
    """Segments registered on this very engine: a plain copy."""

    name = "local"

    def __init__(self, report: Report, pool: CopyPool, lookup: Callable[[str], Any], node: str):
        super().__init__(report)
        self._lookup = lookup  # segment name -> local Region or None
        self._node = node
        self._path = CopyPath("local copy", pool)

    def can_reach(self, desc: SegmentDesc) -> bool:
        region = self._lookup(desc.name) if desc.node == self._node else None
        return region is not None and region.array is not None  # NOTE: device: tcp stages

    def open(self, desc: SegmentDesc) -> Target:
        region = self._lookup(desc.name)
        if region is None or region.token != desc.token or region.array is None:
            raise TransferError(f"segment {desc.name!r} is no longer registered on this node")
        return Target(desc, self, remote_array=region.array)

    def paths(self, target: Target) -> list[Path]:
        return [self._path]


def host_identity() -> str:
    """Equal on two processes exactly when they share a host and its /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = 0
    return f"{socket.gethostname()}/{boot}/{shm_dev}"


class ShmTransport(BaseTransport):
    """Segments of another process on this host that live in POSIX shared memory: the
    arena is mapped here once and slices are copied straight into or out of it."""

    name = "shm"

    def __init__(self, report: Report, pool: CopyPool, host_id: str):
        super().__init__(report)
        self._host_id = host_id
        self._path = CopyPath("shm copy", pool)

    def can_reach(self, desc: SegmentDesc) -> bool:
        return bool(desc.shm_name) and desc.host_id == self._host_id

    def open(self, desc: SegmentDesc) -> Target:
        try:
            arena = ShmArena.attach(desc.shm_name, desc.num_bytes)
        except (OSError, ValueError) as e:
            raise TransferError(
                f"cannot map shared memory {desc.shm_name!r} of segment {desc.name!r}: {e}; "
                "is the peer on this host and alive?"
            ) from e
        return Target(desc, self, remote_array=arena.array, handle=arena)

    def paths(self, target: Target) -> list[Path]:
        return [self._path]

    def release(self, target: Target) -> None:
        if isinstance(target.handle, ShmArena):
            target.remote_array = None
            target.handle.close()

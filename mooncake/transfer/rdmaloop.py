"""The RDMA transport over the C data loop (native/rdmaloop.py): `transfer.rdma_data_loop`
"c", or "auto" when the loop is built and opens every NIC.

What stays as in the Python path (transfer/rdma.py, whose class this one extends):
discovery (pyverbs opens each device for its port, GID and limits only), the RDMA_CONNECT
exchange (GID, LID, QPN, PSN, MTU, read depth) and the responder's quota and reclaim of a
restarted initiator's QPs, the published keys (one (nic, address, rkey) per NIC, so peers
of either kind interoperate: the wire is the same RDMA READ/WRITE), path choice, pausing
and retries in the engine. What C does instead: the PD, CQ and QPs of every NIC, segment
registration (all NICs or none; GPU memory as a plain MR, else as a dma-buf), posting and
completing.

Data flow. `plan` hands the engine one `Slice` per request (not per slice); the engine
dispatches a target's requests of one submit to its `PathSetDispatch`, which submits them
as one C batch of arrays over the ready QPs of the path set's live paths (C cuts slices
and spreads them). A waiter thread waits for the batch (one wake-up per batch) and
reports: the requests that landed in bulk (`report_done`), and each failed slice as a new
`Slice` to the engine's `report`, which retries it on another path (a `LoopPath`: a C
batch over that path's QPs alone), pauses failing paths, and fails a request whose
segment is gone. A QP that failed leaves its slot (destroyed once C drained it) and the
slot is connected again when work needs it.

Unregistering a segment (`LoopRegion.close`) makes C refuse new batches naming it at once
(their requests fail, not retried) and deregister it once its last batch finished; it
waits up to slice_io_timeout_s for the batches in flight, as the Python path does.

Threads: `NUM_WAITERS` waiters block on C batches (the GIL released); connects run on the
transport's workers; C has one poller thread per NIC, pinned to the CPUs of the NIC's
NUMA node (sysfs) that this process may use. close() moves every QP to the error
state (its work flushes, so every waiter returns), joins waiters and workers, then closes
the loop (QPs, regions, CQs, PDs, devices).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake.errors import TransferError
from mooncake.native import cudadmabuf
from mooncake.native import rdmaloop as cloop
from mooncake.native.rdma import QpEndpoint, RdmaNic
from mooncake.native.sysfs import nic_numa_cpus
from mooncake.transfer.batch import Batch, Slice
from mooncake.transfer.paths import Path, PathSet
from mooncake.transfer.rdma import RdmaTransport
from mooncake.transfer.rdmamr import close_all
from mooncake.transfer.rdmapath import CONNECT_ERRORS
from mooncake.transfer.rdmaqp import Outcome, classify
from mooncake.transfer.segment import Region
from mooncake.transfer.transport import Report, Target
from mooncake.transfer.types import EngineOptions, RdmaKeyDesc, TransferOp

log = logging.getLogger(__name__)
NUM_WAITERS = 4  # threads waiting for C batches: batches of one target report in parallel
SERVED_QP_DEPTH = 1  # a QP opened for a peer posts nothing; its CQ share stays small


def why_not_loop() -> str:
    """Why the C loop cannot serve ("" when it can)."""
    if os.environ.get("MOONCAKE_NATIVE_RDMALOOP", "1") == "0":
        return "the C data loop is turned off (MOONCAKE_NATIVE_RDMALOOP=0)"
    if cloop.library() is None:
        return "the C data loop (_rdmaloop) is not built: libibverbs headers missing at install"
    return ""


class LoopQp:
    """A QP of the loop; close() moves it to error and destroys it once drained."""

    __slots__ = ("handle", "loop", "qp_num")

    def __init__(self, loop: cloop.RdmaLoop, handle: int, qp_num: int):
        self.loop, self.handle, self.qp_num = loop, handle, qp_num

    def close(self) -> None:
        self.loop.to_error(self.handle)
        if not self.loop.destroy_qp(self.handle):  # NOTE: still draining: loop.close() does
            log.debug("QP %d still drains; destroyed when the loop closes", self.handle)


def _pin_poller(loop: cloop.RdmaLoop, index: int, name: str) -> list[int]:
    """Pin NIC `name`'s poller to the CPUs of its NUMA node this process may use: the CPUs
    it pinned to, [] when sysfs does not say or none is allowed (it runs anywhere)."""
    cpus = sorted(set(nic_numa_cpus(name)) & os.sched_getaffinity(0))
    if cpus:
        try:
            loop.pin_poller(index, cpus)
        except TransferError as e:
            log.warning("RDMA %s: its poller runs on any CPU: %s", name, e)
            return []
    return cpus


class LoopNic:
    """One NIC in the loop: what discovery found (a discovery-only RdmaNic) and its index in
    the loop, with the RdmaNic calls the RDMA_CONNECT exchange makes."""

    def __init__(self, loop: cloop.RdmaLoop, found: RdmaNic):
        self.loop, self.found = loop, found
        self.name, self.verbs, self.port = found.name, found.verbs, found.port
        self.limits, self.settings = found.limits, found.settings
        self.queue_depth, self.cq_depth = found.queue_depth, found.cq_depth
        self.index = loop.open_nic(found.name, found.cq_depth)
        self.poller_cpus = _pin_poller(loop, self.index, found.name)

    def create_qp(self, depth: int = 0) -> LoopQp:
        """A new RC QP in INIT with `depth` send slots (0: the NIC's queue depth)."""
        depth = depth or self.queue_depth
        try:
            handle, qpn = self.loop.create_qp(self.index, depth, self.port.port_num)
        except TransferError as e:
            raise TransferError(
                f"RDMA {self.name}: {e}; each QP of the C loop reserves its send queue "
                f"({depth}) in one of the NIC's CQs of {self.cq_depth} entries (up to 64 "
                "CQs): raise transfer.rdma_cq_depth, lower rdma_queue_depth or "
                "connections_per_peer"
            ) from e
        return LoopQp(self.loop, handle, qpn)

    def endpoint(self, qp: LoopQp, psn: int) -> QpEndpoint:
        return QpEndpoint(
            self.found.gid,
            self.port.lid,
            qp.qp_num,
            psn,
            self.port.mtu,
            self.limits.max_dest_rd_atomic,
        )

    def connect(self, qp: LoopQp, remote: QpEndpoint, local_psn: int) -> None:
        self.loop.connect_qp(qp.handle, remote, local_psn, self.found.route_to(remote))

    def close(self) -> None:
        self.found.close()  # NOTE: the loop closes its own context of the device


class LoopRegion:
    """One segment registered through the loop (in `Region.rdma_handles`), and how many C
    batches naming it are in flight."""

    def __init__(self, name: str, handle: int):
        self.name, self.handle = name, handle
        self.num_batches = 0
        self._cond = threading.Condition()

    def hold(self) -> None:
        with self._cond:
            self.num_batches += 1

    def release(self) -> None:
        with self._cond:
            self.num_batches -= 1
            if not self.num_batches:
                self._cond.notify_all()

    def close(self, loop: cloop.RdmaLoop, wait_s: float) -> bool:
        """Refuse new batches now; True once no batch uses it (waiting up to `wait_s`),
        False when C deregisters it later, at its last batch's end."""
        if loop.close_region(self.handle):
            return True
        end = time.monotonic() + wait_s
        with self._cond:
            while self.num_batches and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            return not self.num_batches


class LoopPath(Path):
    """The QPs from one local NIC to one NIC of a peer, in the loop; connected on first use.
    dispatch() (the engine's retries) submits over this path alone."""

    def __init__(self, transport: LoopRdmaTransport, host: str, port: int, local: str, remote: str):
        opts = transport.options
        key = f"rdma {local}->{remote}@{host}:{port}"
        super().__init__(key, local, remote, opts.pause_after_failures, opts.pause_s)
        self.transport = transport
        self.host, self.port = host, port
        self.nic = transport.nics[local]
        self.path_id = secrets.randbits(62)  # the responder keys our QPs by it
        self.slots: list[LoopQp | None] = [None] * opts.connections_per_peer
        self.lock = threading.Lock()  # slots, retiring, the connect state
        self.closed = False
        self._retiring: list[LoopQp] = []  # failed QPs C still drains
        self._connect_lock = threading.Lock()  # one connect of this path at a time
        self._connecting = False
        self._connect_after = 0.0  # time.monotonic() before which no new connect is tried
        self.connect_error = ""  # why the last connect failed

    def dispatch(self, slices: list[Slice]) -> None:
        self.transport.submit(slices, [self])

    def ready_qps(self) -> list[int]:
        """Handles of the ready QPs; a failed QP leaves its slot (destroyed once drained),
        and an empty slot asks a worker to connect it."""
        loop = self.transport.loop
        out: list[int] = []
        with self.lock:
            for i, q in enumerate(self.slots):
                if q is None:
                    continue
                if loop.qp_state(q.handle) == "ready":
                    out.append(q.handle)
                else:
                    self.slots[i] = None
                    self._retiring.append(q)
            if self._retiring:
                self._retiring = [q for q in self._retiring if not self._destroyed(q)]
            wants = None in self.slots and not self.closed
        if wants:
            self.connect_later()
        return out

    def _destroyed(self, q: LoopQp) -> bool:
        if not self.transport.loop.destroy_qp(q.handle):
            return False
        self.transport.forget_handle(q.handle)
        return True

    def connect_later(self) -> None:
        with self.lock:
            if self._connecting or self.closed or time.monotonic() < self._connect_after:
                return
            self._connecting = True
        self.transport.later(self.connect_now)

    def connect_now(self) -> str:
        """Connect every empty slot, on a worker: "" or why not (the backoff after a failed
        connect is transfer.pause_s)."""
        with self._connect_lock:
            with self.lock:
                if time.monotonic() < self._connect_after:
                    self._connecting = False
                    return self.connect_error
                slots = [i for i, q in enumerate(self.slots) if q is None]
            try:
                made = self.transport.connect(self, slots) if slots else []
            except CONNECT_ERRORS as e:
                log.warning("%s: connect failed: %s", self.key, e)
                with self.lock:
                    self._connecting = False
                    self._connect_after = time.monotonic() + self.first_pause_s
                    self.connect_error = str(e)
                return self.connect_error
            with self.lock:
                self._connecting = False
                if self.closed:
                    close_all([qp for _, qp in made])
                    return "the path is closed"
                for slot, qp in made:
                    self.slots[slot] = qp
                    self.transport.adopt(self, qp)
            return ""

    def close(self) -> None:
        """Move every QP to error (their work flushes); the loop destroys them."""
        with self.lock:
            self.closed = True
            qps = [q for q in self.slots if q is not None] + self._retiring
        for q in qps:
            try:
                self.transport.loop.to_error(q.handle)
            except TransferError as e:  # pragma: no cover - a bug of ours
                log.warning("%s: %s", self.key, e)


class PathSetDispatch:
    """The first attempts of a target's requests (one submit): one C batch over every live
    path of the path set. The engine calls dispatch() as it does a path's."""

    def __init__(self, transport: LoopRdmaTransport, pathset: PathSet):
        self.transport, self.pathset = transport, pathset

    def dispatch(self, slices: list[Slice]) -> None:
        paths = self.pathset.live()
        for s in slices:
            s.path = paths[0] if paths else self.pathset.paths[0]
        self.transport.submit(slices, paths)  # type: ignore[arg-type]


class LoopRdmaTransport(RdmaTransport):
    """The rdma transport with its data plane in the C loop."""

    data_loop = "c"

    def __init__(
        self,
        report: Report,
        report_done: Callable[[list[Slice]], None] | None,
        node: str,
        secret: bytes,
        options: EngineOptions,
        loop: cloop.RdmaLoop,
        nics: dict[str, LoopNic],
    ):
        self.loop = loop
        super().__init__(report, node, secret, options, nics)
        self.report_done = report_done or self._report_each
        self._slice_bytes = self.slice_bytes(options)
        self._qp_path: dict[int, LoopPath] = {}  # QP handle -> its path (failures name QPs)
        self._dispatchers: weakref.WeakKeyDictionary[PathSet, PathSetDispatch] = (
            weakref.WeakKeyDictionary()
        )
        self._waiters = ThreadPoolExecutor(NUM_WAITERS, thread_name_prefix="te-rdma-wait")

    def _report_each(self, slices: list[Slice]) -> None:
        for s in slices:
            self.report(s, "", False)

    @classmethod
    def create(
        cls,
        report: Report,
        report_done: Callable[[list[Slice]], None] | None,
        node: str,
        secret: bytes,
        options: EngineOptions,
        found: dict[str, RdmaNic],
        provider: str | int,
    ) -> LoopRdmaTransport:
        """The transport over a new loop on `provider` with every NIC of `found` (discovery
        only) opened in it; TransferError when the loop cannot open them all."""
        loop = cloop.RdmaLoop.create(provider)
        if loop is None:
            raise TransferError(why_not_loop() or "the C data loop did not load")
        try:
            nics = {name: LoopNic(loop, nic) for name, nic in found.items()}
        except BaseException:
            loop.close()
            raise
        return cls(report, report_done, node, secret, options, loop, nics)

    def _start_pollers(self) -> list[threading.Thread]:
        return []  # NOTE: the loop's pollers are C threads, one per NIC

    def _served_qp(self, nic: Any) -> Any:
        return nic.create_qp(SERVED_QP_DEPTH)

    # -- registration -----------------------------------------------------------------------

    def register_region(self, region: Region) -> None:
        """Register `region` through the loop on every NIC, or on none (C rolls back)."""
        try:
            keys = self._register(region)
        except TransferError as e:
            raise TransferError(f"segment {region.name!r} not registered: {e}") from e
        for name, k in zip(self.nics, keys.keys, strict=True):
            region.rdma_keys.append(RdmaKeyDesc(name, k.base, k.rkey))
        region.rdma_handles.append(LoopRegion(region.name, keys.handle))

    def _register(self, region: Region) -> cloop.Region:
        address, num_bytes = region.view.address, region.num_bytes
        try:
            return self.loop.register(address, num_bytes)
        except TransferError as e:
            if not region.location.startswith("cuda"):
                raise TransferError(f"{e} (locked memory: raise `ulimit -l`?)") from e
            peermem = e
        fd, offset = cudadmabuf.export_dmabuf(address, num_bytes)
        try:
            keys = self.loop.register_dmabuf(fd, offset, num_bytes)
        finally:
            os.close(fd)
        log.info("GPU memory registered as dma-buf (no nvidia-peermem: %s)", peermem)
        return keys

    def unregister_region(self, region: Region) -> None:
        """Refuse new batches on `region` and wait (up to slice_io_timeout_s) for those in
        flight; C deregisters it after the last."""
        for r in region.rdma_handles:
            if not r.close(self.loop, self.options.slice_io_timeout_s):
                log.warning(
                    "segment %r unregistered with %d batches in flight: it is deregistered "
                    "when they finish",
                    region.name,
                    r.num_batches,
                )

    # -- initiator side ---------------------------------------------------------------------

    def _new_path(self, host: str, port: int, local_nic: str, remote_nic: str) -> Any:
        return LoopPath(self, host, port, local_nic, remote_nic)

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
        """One Slice for the whole request (C cuts it), dispatched with the target's other
        requests of this submit as one batch."""
        r = batch.requests[i]
        d = self._dispatchers.get(pathset)
        if d is None:
            d = self._dispatchers.setdefault(pathset, PathSetDispatch(self, pathset))
        slices = by_path.get(d)
        if slices is None:  # NOTE: the path set's first request of this submit checks it
            if not pathset.live():
                batch.fail(
                    i,
                    f"every path to node {target.desc.node!r} is paused after repeated "
                    "failures; retry in a moment",
                )
                return
            slices = by_path[d] = []
        batch.add_slices(i, 1)
        slices.append(Slice(batch, i, r.op, local, local_offset, target, r.remote_offset, r.length))

    def adopt(self, path: LoopPath, qp: LoopQp) -> None:
        with self._lock:
            self._qp_path[qp.handle] = path

    def forget_handle(self, handle: int) -> None:
        with self._lock:
            self._qp_path.pop(handle, None)

    def submit(self, slices: list[Slice], paths: list[LoopPath]) -> None:
        """Submit `slices` (each with its `path` set: where a failure counts) as C batches,
        one per target, over the ready QPs of `paths`; a waiter reports them."""
        if self._closed:
            for s in slices:
                self.report(s, "this node's transfer engine is closing", False, False)
            return
        by_target: dict[int, list[Slice]] = {}
        for s in slices:
            by_target.setdefault(id(s.target), []).append(s)
        for group in by_target.values():
            self._submit(group, paths)

    def _submit(self, group: list[Slice], paths: list[LoopPath], waited: bool = False) -> None:
        target = group[0].target
        qps: list[int] = []
        bases: list[int] = []
        rkeys: list[int] = []
        for p in paths:
            key: RdmaKeyDesc = target.handle[p.remote_nic]
            for handle in p.ready_qps():
                qps.append(handle)
                bases.append(key.address)
                rkeys.append(key.rkey)
        if not qps:
            if not waited:  # NOTE: a worker connects them, then submits
                self._run_on(self._workers, group, self._submit_connected, group, paths)
                return
            why = "; ".join(f"{p.key}: {p.connect_error or 'no ready QP'}" for p in paths)
            for s in group:
                self.report(s, f"not connected ({why or 'no live path'})", True)
            return
        regions = [s.local.rdma_handles[0] for s in group]
        requests = cloop.Requests(len(group))
        requests.op[:] = [
            cloop.OP_WRITE if s.op is TransferOp.WRITE else cloop.OP_READ for s in group
        ]
        requests.region[:] = [r.handle for r in regions]
        requests.local_offset[:] = [s.local_offset for s in group]
        requests.remote_offset[:] = [s.remote_offset for s in group]
        requests.length[:] = [s.length for s in group]
        held = list({id(r): r for r in regions}.values())
        for r in held:
            r.hold()
        try:
            batch = self.loop.submit(requests, cloop.Paths(qps, bases, rkeys), self._slice_bytes)
        except TransferError as e:  # pragma: no cover - a QP handle unknown to C: a bug
            for r in held:
                r.release()
            for s in group:
                self.report(s, f"{s.path.key}: {e}", True)
            return
        self._run_on(self._waiters, group, self._finish, batch, group, paths, held)

    def _run_on(
        self, pool: ThreadPoolExecutor, group: list[Slice], fn: Callable[..., object], *args: Any
    ) -> None:
        """fn(*args) on `pool`; `group` fails once the pool is shut down (closing)."""
        try:
            pool.submit(fn, *args)
        except RuntimeError:
            for s in group:
                self.report(s, "this node's transfer engine is closing", False, False)

    def _submit_connected(self, group: list[Slice], paths: list[LoopPath]) -> None:
        """On a worker: connect the paths that have no QP, then submit."""
        for p in paths:
            if not p.ready_qps():
                p.connect_now()
        self._submit(group, paths, waited=True)

    def _finish(
        self, batch: cloop.Batch, group: list[Slice], paths: list[LoopPath], held: list[LoopRegion]
    ) -> None:
        """On a waiter: wait for `batch` and report every request of it."""
        try:
            result = batch.wait()
        except TransferError as e:  # pragma: no cover - the eventfd failed
            for r in held:
                r.release()
            for s in group:
                self.report(s, f"{s.path.key}: {e}", True)
            return
        for r in held:
            r.release()
        assert result is not None, "a wait without a timeout returned none"
        try:
            self._report_result(result, group, paths)
        except Exception:  # NOTE: a bug of ours; the waiter must go on
            log.exception("rdma: reporting a C batch failed")

    def _report_result(
        self, result: cloop.BatchResult, group: list[Slice], paths: list[LoopPath]
    ) -> None:
        """Report `group` (entry j = request j of the C batch): what landed in bulk, each
        failed slice alone (the engine retries it)."""
        if result.is_ok:
            self._report_ok(group, paths, set())
            return
        pieces: dict[int, list[int]] = {}  # request -> its failed slices' indices
        for k, j in enumerate(result.slice_request.tolist()):
            pieces.setdefault(j, []).append(k)
        ok: list[Slice] = []
        failed: list[tuple[Slice, str, bool, bool]] = []
        failing: set[LoopPath] = set()
        statuses = result.status.tolist()
        for j, s in enumerate(group):
            if statuses[j] == 0:
                ok.append(s)
            elif statuses[j] == cloop.BAD_REGION:
                why = f"local segment {s.local.name!r} was unregistered while the transfer "
                why += "was in flight"
                failed.append((s, why, False, False))
            else:
                ok.append(self._split(s, pieces.get(j, []), result, failed, failing))
        self._report_ok(ok, paths, failing)
        for s, error, retryable, is_path_fault in failed:
            self.report(s, error, retryable, is_path_fault)

    def _split(
        self,
        s: Slice,
        ks: list[int],
        result: cloop.BatchResult,
        failed: list[tuple[Slice, str, bool, bool]],
        failing: set[LoopPath],
    ) -> Slice:
        """Request `s` with failed slices `ks`: each becomes a Slice in `failed` (counted in
        its batch first); returns the part that landed (its length what is left)."""
        s.batch.add_slices(s.index, len(ks))
        landed = s.length
        for k in ks:
            off, length = int(result.slice_offset[k]), int(result.slice_length[k])
            qp, status = int(result.slice_qp[k]), int(result.slice_status[k])
            landed -= length
            piece = Slice(
                s.batch,
                s.index,
                s.op,
                s.local,
                s.local_offset + off,
                s.target,
                s.remote_offset + off,
                length,
            )
            piece.attempt, piece.tried = s.attempt, list(s.tried)
            piece.path = self._qp_path.get(qp, s.path)
            error, retryable, is_path_fault = self._describe(piece.path, status)
            if is_path_fault:
                failing.add(piece.path)
            failed.append((piece, error, retryable, is_path_fault))
        rest = Slice(
            s.batch, s.index, s.op, s.local, s.local_offset, s.target, s.remote_offset, landed
        )
        rest.path = s.path
        return rest

    def _describe(self, path: Any, status: int) -> tuple[str, bool, bool]:
        """(error, retryable, is_path_fault) of a failed slice's status."""
        if status == cloop.NO_PATH:
            return f"{path.key}: no queue pair of the batch was left", True, False
        if status == cloop.POST_REFUSED:
            return f"{path.key}: post_send refused the work request", True, True
        outcome = classify(self.verbs, status)
        flushed = status == int(self.verbs.IBV_WC_WR_FLUSH_ERR)
        error = f"{path.key}: work completion status {status}"
        if not flushed:
            log.warning("%s (%s)", error, outcome.value)
        if outcome is Outcome.RESOLVE:
            error += ": the peer refused the key or range (segment registered again?); "
            error += "its descriptor is resolved again on the next submit"
        return error, outcome is Outcome.RETRY, not flushed

    def _report_ok(self, ok: list[Slice], paths: list[LoopPath], failing: set[LoopPath]) -> None:
        """Report landed requests in bulk, spread over the batch's paths that did not fail
        (a path's counts are its share of the batch: C does not say which QP moved what)."""
        if not ok:
            return
        good = [p for p in paths if p not in failing] or paths or [ok[0].path]
        if len(good) == 1:
            for s in ok:
                s.path = good[0]
            self.report_done(ok)
            return
        by_path: dict[int, list[Slice]] = {}
        for j, s in enumerate(ok):
            s.path = good[j % len(good)]
            by_path.setdefault(j % len(good), []).append(s)
        for share in by_path.values():
            self.report_done(share)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            paths, served = list(self._paths.values()), list(self._served.values())
        for p in paths:  # NOTE: their work flushes, so every waiter returns
            p.close()
        for sq in served:
            sq.qp.loop.to_error(sq.qp.handle)
        self._waiters.shutdown(wait=True)
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.loop.close()
        for nic in self.nics.values():
            nic.close()

"""The RDMA transport: one-sided RDMA READ/WRITE over RC queue pairs (pyverbs).

Every segment is registered as a memory region on every local NIC (all or none: any
failure, whatever pyverbs raised, closes the others again); its descriptor carries one
(nic, address, rkey) per NIC. The MRs of a segment are a `RegionMrs` (transfer/rdmamr.py):
unregistering refuses new work on them at once (slices still queued fail, not retried,
naming the segment) and closes them only once no posted work request names them.

A path (transfer/rdmapath.py) is a (local NIC, remote NIC) pair with `connections_per_peer`
queue pairs, connected by an RDMA_CONNECT exchange (GID, LID, QPN, PSN, MTU, read depth)
over the peer's authenticated TCP server. The responder keys the QPs it accepts by the
initiator's node, path id and slot, and refuses a peer past `transfer.rdma_max_qps_per_peer`.
An RDMA_CONNECT carries the initiator engine's incarnation (random, new on every start; 0
from peers that predate it, which still decode it and are decoded): a connect that would
pass the quota first reclaims the QPs other incarnations under the same node name hold
(a restarted engine's, left behind: a responder of one-sided work never sees its peer
die), least recently connected first. NOTE: two live engines under one name that together
pass the quota take each other's QPs in turn; give them distinct names.

Threads: one poller per NIC drains its CQ, reports successful slices and pumps the paths
of that NIC (an exception of ours is logged and counted, the poller goes on); anything
that may block (connecting, reporting failures, which re-dispatches slices) runs on the
transport's worker threads. close() stops and joins the pollers and workers before it
destroys QPs, CQs, PDs and devices.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgspec

from mooncake.errors import ConfigError, TransferError
from mooncake.native import rdma as verbs_api
from mooncake.native.rdma import QpEndpoint, RdmaNic
from mooncake.transfer.batch import Slice
from mooncake.transfer.paths import Path
from mooncake.transfer.rdmamr import RegionMrs, close_all
from mooncake.transfer.rdmapath import RdmaPath
from mooncake.transfer.rdmaqp import Credits, Outcome, QueuePair, classify, generation_of
from mooncake.transfer.segment import Region
from mooncake.transfer.tcp import control_call
from mooncake.transfer.transport import BaseTransport, Report, Target
from mooncake.transfer.types import EngineOptions, RdmaKeyDesc, SegmentDesc, TransferOp
from mooncake.transfer.wire import Op, Status, status_text

log = logging.getLogger(__name__)
MAX_QPS_PER_CONNECT = 64
NUM_WORKERS = 2  # connects and failure reports; a stalled peer's connect holds one


class QpInfo(msgspec.Struct, frozen=True):
    gid: str
    lid: int
    qpn: int
    psn: int
    mtu: int  # the sender's port active MTU (ibv_mtu)
    rd_atomic: int  # RDMA READs the sender accepts in flight per QP


class RdmaConnectMsg(msgspec.Struct, frozen=True):
    """RDMA_CONNECT request and reply: one QpInfo per queue pair, in `slots` order."""

    node: str  # initiator engine name
    initiator_nic: str
    target_nic: str
    path_id: int  # chosen by the initiator for one path
    slots: list[int]  # the path's QP slot of each entry of qps
    qps: list[QpInfo]
    # random id of the sender's engine, new on every start; 0: a peer from before the field
    incarnation: int = 0


class ServedQp(msgspec.Struct):
    """A QP this node opened for a peer's RDMA_CONNECT."""

    qp: Any  # the pyverbs QP
    incarnation: int  # the initiator engine's (RdmaConnectMsg.incarnation)
    connect_seq: int  # which accepted RDMA_CONNECT made it (larger: more recent)


_encode = msgspec.msgpack.Encoder().encode
_decode_connect = msgspec.msgpack.Decoder(RdmaConnectMsg).decode


def _info(ep: QpEndpoint) -> QpInfo:
    return QpInfo(ep.gid, ep.lid, ep.qpn, ep.psn, ep.mtu, ep.rd_atomic)


def _endpoint(info: QpInfo) -> QpEndpoint:
    return QpEndpoint(info.gid, info.lid, info.qpn, info.psn, info.mtu, info.rd_atomic)


def create_rdma_transport(
    report: Report,
    node: str,
    secret: bytes,
    options: EngineOptions,
    verbs: Any,
    required: bool,
    provider: str | int = "verbs",
    report_done: Callable[[list[Slice]], None] | None = None,
) -> RdmaTransport | None:
    """The rdma transport of engine `node` (its completion entry points, cluster secret and
    options), or None when RDMA is unusable and not `required` (then TransferError says
    why). `transfer.rdma_data_loop` chooses its data plane: the C loop over `provider`
    ("verbs", "stub", or a verbs table's address: transfer/rdmaloop.py), or pyverbs (this
    module); "c" raises ConfigError when the loop cannot serve. The engine routes its
    server's RDMA_CONNECT requests to `on_connect`."""
    from mooncake.transfer import rdmaloop

    why, nics = "", {}
    mode = options.rdma.rdma_data_loop
    no_loop = rdmaloop.why_not_loop() if mode != "python" else "transfer.rdma_data_loop = python"
    if mode == "c" and no_loop:
        raise ConfigError(f"transfer.rdma_data_loop = c: {no_loop}; set it to auto or python")
    try:
        verbs = verbs or verbs_api.load_pyverbs()
        names = [n for n in verbs_api.list_devices(verbs) if not options.nics or n in options.nics]
        nics = verbs_api.open_nics(verbs, names, options.rdma, data_plane=bool(no_loop))
        why = "" if nics else "no RDMA device found (or none of transfer.nics opened)"
    except ImportError as e:
        why = f"pyverbs is not importable ({e}); install python3-pyverbs (Debian) or pyverbs"
    if why:
        if required:
            raise TransferError(f"protocol rdma: {why}")
        log.info("rdma transport disabled: %s", why)
        return None
    if not no_loop:
        try:
            t = rdmaloop.LoopRdmaTransport.create(
                report, report_done, node, secret, options, nics, provider
            )
            log.info("rdma transport: the C data loop (%s) on %s", provider, ", ".join(nics))
            return t
        except TransferError as e:
            if mode == "c":
                raise ConfigError(f"transfer.rdma_data_loop = c: {e}") from e
            no_loop = f"the C data loop does not serve ({e})"
            for nic in nics.values():
                nic.close()
            nics = verbs_api.open_nics(verbs, list(nics), options.rdma)
    log.info("rdma transport: the Python data path (pyverbs): %s", no_loop)
    return RdmaTransport(report, node, secret, options, nics)


class PathEnds(Protocol):
    """What the RDMA_CONNECT exchange needs of a path (RdmaPath, transfer/rdmaloop.py's
    LoopPath): its ends, its local NIC and the id the responder keys its QPs by."""

    host: str
    port: int
    local_nic: str
    remote_nic: str
    path_id: int
    nic: Any  # RdmaNic or LoopNic: create_qp(), endpoint(), connect()


class RdmaTransport(BaseTransport):
    name = "rdma"
    data_loop = "python"  # who posts and completes: "python" (here) or "c" (rdmaloop.py)

    def __init__(
        self,
        report: Report,
        node: str,  # this engine's name: the peer keys our QPs by it
        secret: bytes,  # the cluster secret of RDMA_CONNECT exchanges
        options: EngineOptions,
        nics: dict[str, Any],  # RdmaNic by name (LoopNic for the C loop: rdmaloop.py)
    ):
        super().__init__(report)
        self.node = node
        self.options = options
        self._secret = secret
        self.nics = nics
        self.verbs = next(iter(nics.values())).verbs
        self.settings = options.rdma
        self.credits = {n: Credits(nic.cq_depth) for n, nic in nics.items()}
        self.num_stale = 0  # completions of QPs no longer known (ignored)
        self.num_poller_errors = 0  # exceptions a poller caught and logged (bugs of ours)
        self._by_gen: dict[int, tuple[RdmaPath, QueuePair]] = {}
        self._next_gen = 0
        self._paths: dict[tuple[str, int, str, str], RdmaPath] = {}
        self._nic_paths: dict[str, tuple[RdmaPath, ...]] = {n: () for n in nics}
        # the QPs peers opened here, by (initiator node, path id, slot)
        self._served: dict[tuple[str, int, int], ServedQp] = {}
        self._num_connects = 0  # RDMA_CONNECTs accepted (orders the incarnations)
        self.incarnation = secrets.randbits(63) | 1  # this engine, among those named `node`
        self._lock = threading.Lock()
        self._accept_lock = threading.Lock()
        self._closed = False
        self._workers = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="te-rdma-worker")
        self._pollers = self._start_pollers()

    def _start_pollers(self) -> list[threading.Thread]:
        """One completion poller per NIC (the C loop's transport has its own, in C)."""
        pollers = [
            threading.Thread(target=self._poll_loop, args=(n,), daemon=True, name=f"te-rdma-{n}")
            for n in self.nics
        ]
        for t in pollers:
            t.start()
        return pollers

    def later(self, fn: Callable[..., object], *args: Any) -> None:
        """Run fn(*args) on a worker thread (dropped once the transport is closing)."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # NOTE: shut down since the check
            self._workers.submit(fn, *args)

    # -- registration -----------------------------------------------------------------------

    def register_region(self, region: Region) -> None:
        """Register `region` on every NIC, or on none: any failure closes the MRs made
        (whatever pyverbs raised) and raises again."""
        done: list[tuple[str, Any, int]] = []  # (nic, MR, address of the region's byte 0)
        device = region.location.startswith("cuda")
        try:
            for name, nic in self.nics.items():
                done.append((name, *nic.register(region.view.address, region.num_bytes, device)))
        except BaseException as e:  # NOTE: not only ours: an older pyverbs raises TypeError
            close_all([mr for _, mr, _ in done])  # NOTE: the engine frees the name
            if isinstance(e, TransferError):
                raise TransferError(f"segment {region.name!r} not registered: {e}") from e
            raise
        for name, mr, base in done:
            region.rdma_keys.append(RdmaKeyDesc(name, base, int(mr.rkey)))
        region.rdma_handles.append(RegionMrs(region.name, done))

    def unregister_region(self, region: Region) -> None:
        """Refuse new work on `region`'s MRs and close them once no posted work request
        names them (waiting up to slice_io_timeout_s; later, the last completion does)."""
        for mrs in region.rdma_handles:
            if not mrs.close(self.options.slice_io_timeout_s):
                log.warning(
                    "segment %r unregistered with %d work requests in flight: its memory "
                    "regions close when they complete",
                    region.name,
                    mrs.num_posted,
                )

    # -- initiator side ---------------------------------------------------------------------

    def slice_bytes(self, options: EngineOptions) -> int:
        """One work request per slice, at most what every port's max_msg_sz allows."""
        return min(options.slice_bytes, *(n.port.max_msg_sz for n in self.nics.values()))

    def can_reach(self, desc: SegmentDesc) -> bool:
        return bool(desc.rdma and desc.endpoints)

    def open(self, desc: SegmentDesc) -> Target:
        return Target(desc, self, handle={k.nic: k for k in desc.rdma})

    def paths(self, target: Target) -> list[Path]:
        ep = target.desc.endpoints[0]
        out: list[Path] = []
        with self._lock:
            for local in self.nics:
                for key in target.desc.rdma:
                    k = (ep.host, ep.port, local, key.nic)
                    if k not in self._paths:
                        self._paths[k] = path = self._new_path(ep.host, ep.port, local, key.nic)
                        self._nic_paths[local] += (path,)
                    out.append(self._paths[k])
        return out

    def _new_path(self, host: str, port: int, local_nic: str, remote_nic: str) -> Any:
        """A path of this transport's kind (RdmaPath here; LoopPath over the C loop)."""
        return RdmaPath(self, host, port, local_nic, remote_nic)

    def post(self, nic: RdmaNic, qp: Any, wr_id: int, s: Slice, remote_nic: str) -> None:
        """Post slice `s` on `qp`, its local MR held until `unpost(s)`; raises SegmentGone
        (its segment was unregistered) or TransferError (the QP refused it)."""
        key: RdmaKeyDesc = s.target.handle[remote_nic]
        mrs: RegionMrs = s.local.rdma_handles[0]
        lkey, base = mrs.acquire(nic.name)
        try:
            nic.post(
                qp,
                wr_id,
                s.op is TransferOp.WRITE,
                base + s.local_offset,
                s.length,
                lkey,
                key.address + s.remote_offset,
                key.rkey,
            )
        except BaseException:
            mrs.release()
            raise

    def unpost(self, s: Slice) -> None:
        """The work request of `s` completed or its QP was destroyed: its MR may close."""
        s.local.rdma_handles[0].release()

    def connect(self, path: PathEnds, slots: list[int]) -> list[tuple[int, Any]]:
        """Create, exchange and connect one QP per slot of `path` (on a worker); every QP
        made is destroyed again if any step fails."""
        nic, opts = path.nic, self.options
        qps: list[Any] = []
        try:
            psns = [secrets.randbits(24) for _ in slots]
            for _ in slots:
                qps.append(nic.create_qp())
            mine = [_info(nic.endpoint(qp, p)) for qp, p in zip(qps, psns, strict=True)]
            msg = RdmaConnectMsg(
                self.node,
                path.local_nic,
                path.remote_nic,
                path.path_id,
                slots,
                mine,
                self.incarnation,
            )
            status, body = control_call(
                path.host,
                path.port,
                self._secret,
                Op.RDMA_CONNECT,
                _encode(msg),
                opts.slice_io_timeout_s,
            )
            if status != Status.OK:
                said = body[:300].decode(errors="replace")
                raise TransferError(f"peer refused RDMA_CONNECT: {status_text(status)} {said}")
            reply = _decode_connect(body)
            if len(reply.qps) != len(qps):
                raise TransferError(f"peer answered {len(reply.qps)} queue pairs, asked {len(qps)}")
            for qp, psn, r in zip(qps, psns, reply.qps, strict=True):
                nic.connect(qp, _endpoint(r), psn)
        except BaseException:
            close_all(qps)
            raise
        return list(zip(slots, qps, strict=True))

    def adopt_qp(self, path: RdmaPath, qp: Any, slot: int) -> QueuePair:
        """A connected QP of `path` with a new generation."""
        with self._lock:
            self._next_gen += 1
            q = QueuePair(qp, self._next_gen, slot, path.nic.queue_depth)
            self._by_gen[q.gen] = (path, q)
        return q

    def forget_qp(self, q: QueuePair) -> None:
        with self._lock:
            self._by_gen.pop(q.gen, None)

    def _poll_loop(self, name: str) -> None:
        nic, credits = self.nics[name], self.credits[name]
        spin_s = max(self.options.spin_us, 1.0) / 1e6
        idle_at = 0.0
        while not self._closed:
            if credits.used == 0:
                credits.wait_busy()
                continue
            try:
                done = nic.poll(64)
            except TransferError as e:  # pragma: no cover - the device went away
                log.error("%s", e)
                time.sleep(spin_s)
                continue
            if not done:
                now = time.monotonic()
                idle_at = idle_at or now
                time.sleep(0 if now - idle_at < spin_s else spin_s)  # yield, then back off
                continue
            idle_at = 0.0
            credits.give(len(done))
            try:
                self._complete(done)
                for path in self._nic_paths[name]:
                    if path.pending:
                        path.pump()
            except Exception:  # NOTE: a bug of ours; a dead poller would stall the NIC
                self.num_poller_errors += 1
                log.exception("rdma %s: poller error (the poller goes on)", name)

    def _complete(self, done: list[tuple[int, int, int]]) -> None:
        ok_status = int(self.verbs.IBV_WC_SUCCESS)
        flushed = int(self.verbs.IBV_WC_WR_FLUSH_ERR)
        for wr_id, status, vendor_err in done:
            path, q = self._by_gen.get(generation_of(wr_id), (None, None))
            s = path.completed(q, wr_id, status == ok_status) if path and q else None
            if s is None or path is None:
                self.num_stale += 1  # a QP destroyed since, or a wr_id it no longer has
                continue
            outcome = classify(self.verbs, status)
            if outcome is Outcome.OK:
                self.report(s, "", False)
                continue
            error = f"{path.key}: work completion status {status} (vendor_err {vendor_err:#x})"
            if status != flushed:
                log.warning("%s (%s)", error, outcome.value)
            if outcome is Outcome.RESOLVE:
                error += ": the peer refused the key or range (segment registered again?); "
                error += "its descriptor is resolved again on the next submit"
            # NOTE: one QP error flushes all its work: only the first failure is the path's
            self.later(self.report, s, error, outcome is Outcome.RETRY, status != flushed)

    # -- target side ------------------------------------------------------------------------

    def on_connect(self, payload: bytes) -> tuple[Status, bytes]:
        """RDMA_CONNECT from a peer: create and connect our half of its queue pairs."""
        with self._accept_lock:  # NOTE: one at a time, so the quota holds
            return self._accept(_decode_connect(payload))

    def _accept(self, msg: RdmaConnectMsg) -> tuple[Status, bytes]:
        nic = self.nics.get(msg.target_nic)
        if (
            nic is None
            or not msg.qps
            or len(msg.qps) > MAX_QPS_PER_CONNECT
            or (len(msg.slots) != len(msg.qps))
        ):
            raise TransferError(f"no usable RDMA NIC {msg.target_nic!r} for {len(msg.qps)} QPs")
        keys = [(msg.node, msg.path_id, slot) for slot in msg.slots]
        quota = self.settings.rdma_max_qps_per_peer
        with self._lock:
            held = [k for k in self._served if k[0] == msg.node and k not in keys]
            stale = self._reclaimable(msg, len(held) + len(keys) - quota)
        if len(held) - len(stale) + len(keys) > quota:
            raise TransferError(
                f"peer {msg.node!r} would hold {len(held) + len(keys)} queue pairs on this "
                f"node, over transfer.rdma_max_qps_per_peer = {quota}: raise it here, or lower "
                "transfer.connections_per_peer (or the NICs used) on the peer"
            )
        qps: list[Any] = []
        mine = []
        try:
            for remote in msg.qps:
                qps.append(self._served_qp(nic))
                psn = secrets.randbits(24)
                nic.connect(qps[-1], _endpoint(remote), psn)
                mine.append(_info(nic.endpoint(qps[-1], psn)))
        except BaseException:
            close_all(qps)
            raise
        with self._lock:
            if self._closed:
                close_all(qps)
                raise TransferError("this node's transfer engine is closing")
            old = [self._served.pop(k).qp for k in keys + stale if k in self._served]
            self._num_connects += 1
            self._served.update(
                {
                    k: ServedQp(qp, msg.incarnation, self._num_connects)
                    for k, qp in zip(keys, qps, strict=True)
                }
            )
        if stale:
            log.warning(
                "peer %r: %d queue pairs of earlier engines under its name (restarted) "
                "reclaimed for a new one, within transfer.rdma_max_qps_per_peer = %d",
                msg.node,
                len(stale),
                quota,
            )
        close_all(old)  # NOTE: the initiator reconnects a slot only once it drained it
        reply = RdmaConnectMsg(
            self.node,
            msg.initiator_nic,
            msg.target_nic,
            msg.path_id,
            msg.slots,
            mine,
            self.incarnation,
        )
        return Status.OK, _encode(reply)

    def _served_qp(self, nic: Any) -> Any:
        """A new QP in INIT for a peer's RDMA_CONNECT (it posts nothing: the peer does)."""
        return nic.create_qp()

    def _reclaimable(self, msg: RdmaConnectMsg, excess: int) -> list[tuple[str, int, int]]:
        """Under the lock: keys of the QPs that other incarnations of `msg.node` hold, whole
        incarnations, least recently connected first, until `excess` QPs are covered (none
        for an initiator that sends no incarnation)."""
        if excess <= 0 or not msg.incarnation:
            return []
        by_incarnation: dict[int, list[tuple[str, int, int]]] = {}
        last_connect: dict[int, int] = {}
        for k, served in self._served.items():
            if k[0] == msg.node and served.incarnation != msg.incarnation:
                by_incarnation.setdefault(served.incarnation, []).append(k)
                last = last_connect.get(served.incarnation, 0)
                last_connect[served.incarnation] = max(last, served.connect_seq)
        out: list[tuple[str, int, int]] = []
        for inc in sorted(by_incarnation, key=last_connect.__getitem__):
            if len(out) >= excess:
                break
            out += by_incarnation[inc]
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            paths, served = list(self._paths.values()), list(self._served.values())
        for c in self.credits.values():
            c.stop()
        for t in self._pollers:
            t.join()
        self._workers.shutdown(wait=True, cancel_futures=True)
        for p in paths:
            p.close()
        close_all([sq.qp for sq in served])
        for nic in self.nics.values():
            nic.close()

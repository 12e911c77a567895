"""The RDMA transport: one-sided RDMA READ/WRITE over RC queue pairs (pyverbs).

Every segment is registered as a memory region on every local NIC; its descriptor carries
one (nic, address, rkey) per NIC. A path is a (local NIC, remote NIC) pair with
`connections_per_peer` queue pairs, connected on first use by an RDMA_CONNECT exchange
(GID, LID, QPN, PSN) over the peer's authenticated TCP server. One poller thread per NIC
drains its completion queue; a failed completion fails its slice as retryable and resets
the path's queue pairs (an RC QP in error state must be re-created).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from mooncake.errors import MooncakeError, TransferError
from mooncake.native import rdma as verbs_api
from mooncake.native.rdma import QpEndpoint, RdmaNic
from mooncake.transfer.batch import Slice
from mooncake.transfer.paths import Path
from mooncake.transfer.segment import Region
from mooncake.transfer.tcp import control_call
from mooncake.transfer.transport import BaseTransport, Target
from mooncake.transfer.types import EngineOptions, RdmaKeyDesc, SegmentDesc, TransferOp
from mooncake.transfer.wire import Op, Status, status_text

if TYPE_CHECKING:
    from mooncake.transfer.engine import TransferEngine

log = logging.getLogger(__name__)
MAX_SEND_WR = 256  # outstanding work requests per queue pair


class QpInfo(msgspec.Struct, frozen=True):
    gid: str
    lid: int
    qpn: int
    psn: int


class RdmaConnectMsg(msgspec.Struct, frozen=True):
    """RDMA_CONNECT request and reply: one QpInfo per queue pair, in pairing order."""

    node: str  # initiator engine name
    initiator_nic: str
    target_nic: str
    qps: list[QpInfo]


_encode = msgspec.msgpack.Encoder().encode
_decode_connect = msgspec.msgpack.Decoder(RdmaConnectMsg).decode


def create_rdma_transport(
    engine: TransferEngine, verbs: Any, required: bool
) -> RdmaTransport | None:
    """The rdma transport of `engine`, or None when RDMA is unusable and not `required`
    (then TransferError says why)."""
    why = ""
    try:
        verbs = verbs or verbs_api.load_pyverbs()
        names = [
            n
            for n in verbs_api.list_devices(verbs)
            if not engine.options.nics or n in engine.options.nics
        ]
        why = "" if names else "no RDMA device found (or none of transfer.nics)"
    except ImportError as e:
        why = f"pyverbs is not importable ({e}); install python3-pyverbs (Debian) or pyverbs"
    if why:
        if required:
            raise TransferError(f"protocol rdma: {why}")
        log.info("rdma transport disabled: %s", why)
        return None
    transport = RdmaTransport(engine, {n: RdmaNic(verbs, n) for n in names})
    engine.server.handlers[Op.RDMA_CONNECT] = transport.on_connect
    return transport


class RdmaTransport(BaseTransport):
    name = "rdma"

    def __init__(self, engine: TransferEngine, nics: dict[str, RdmaNic]):
        super().__init__(engine._report)
        self.engine = engine
        self.nics = nics
        self.inflight: dict[int, tuple[Slice, RdmaPath]] = {}  # wr_id -> slice
        self._wr_ids = itertools.count(1)
        self._paths: dict[tuple[str, int, str, str], RdmaPath] = {}
        self._served: dict[tuple[str, str, str], list[Any]] = {}  # peer's QPs we accepted
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._pollers = [
            threading.Thread(target=self._poll_loop, args=(nic,), daemon=True, name=f"te-rdma-{n}")
            for n, nic in nics.items()
        ]
        for t in self._pollers:
            t.start()

    # -- registration -----------------------------------------------------------------------

    def register_region(self, region: Region) -> None:
        for name, nic in self.nics.items():
            mr = nic.register(region.view.address, region.num_bytes)
            region.rdma_keys.append(RdmaKeyDesc(name, region.view.address, int(mr.rkey)))
            region.rdma_handles.append((name, mr))

    def unregister_region(self, region: Region) -> None:
        for _, mr in region.rdma_handles:
            mr.close()
        region.rdma_handles.clear()

    # -- initiator side ---------------------------------------------------------------------

    def slice_bytes(self, options: EngineOptions) -> int:
        return options.slice_bytes  # one work request per slice, spread over QPs and NICs

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
                        self._paths[k] = RdmaPath(self, ep.host, ep.port, local, key.nic)
                    out.append(self._paths[k])
        return out

    def post(self, s: Slice, path: RdmaPath, qp: Any) -> None:
        key: RdmaKeyDesc = s.target.handle[path.remote_nic]
        lkey = next(mr.lkey for n, mr in s.local.rdma_handles if n == path.local_nic)
        wr_id = next(self._wr_ids)
        with self._lock:
            self.inflight[wr_id] = (s, path)
            self._wake.notify_all()  # every NIC poller: the WR may be on any CQ
        try:
            self.nics[path.local_nic].post(
                qp, wr_id, s.op is TransferOp.WRITE, s.local.view.address + s.local_offset,
                s.length, int(lkey), key.address + s.remote_offset, key.rkey,
            )  # fmt: skip
        except Exception as e:
            with self._lock:
                self.inflight.pop(wr_id, None)
            path.reset()
            self.report(s, f"{path.key}: post_send failed: {e}", True)

    def _poll_loop(self, nic: RdmaNic) -> None:
        idle = 0
        ok = int(nic.verbs.IBV_WC_SUCCESS)
        while not self._closed:
            with self._lock:
                while not self.inflight and not self._closed:
                    self._wake.wait(1.0)
            done = nic.poll(64)
            if not done:
                idle += 1
                time.sleep(0 if idle < 64 else 0.0002)  # yield, then back off (2 cores)
                continue
            idle = 0
            for wr_id, status in done:
                with self._lock:
                    item = self.inflight.pop(wr_id, None)
                if item is None:
                    continue
                s, path = item
                if status == ok:
                    self.report(s, "", False)
                else:
                    path.reset()
                    self.report(s, f"{path.key}: work completion status {status}", True)

    # -- target side ------------------------------------------------------------------------

    def on_connect(self, payload: bytes) -> tuple[Status, bytes]:
        """RDMA_CONNECT from a peer: create and connect our half of its queue pairs."""
        msg = _decode_connect(payload)
        nic = self.nics.get(msg.target_nic)
        if nic is None or not msg.qps or len(msg.qps) > 64:
            raise TransferError(f"no usable RDMA NIC {msg.target_nic!r} for {len(msg.qps)} QPs")
        mine = []
        qps = []
        for remote in msg.qps:
            qp = nic.create_qp(MAX_SEND_WR)
            psn = secrets.randbits(24)
            nic.connect(qp, QpEndpoint(remote.gid, remote.lid, remote.qpn, remote.psn), psn)
            qps.append(qp)
            mine.append(QpInfo(nic.gid, nic.lid, int(qp.qp_num), psn))
        key = (msg.node, msg.initiator_nic, msg.target_nic)
        with self._lock:
            old, self._served[key] = self._served.get(key, []), qps
        _close_all(old)
        return Status.OK, _encode(
            RdmaConnectMsg(self.engine.name, msg.initiator_nic, msg.target_nic, mine)
        )

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._wake.notify_all()
            paths, served = list(self._paths.values()), list(self._served.values())
        for p in paths:
            p.reset()
        for qps in served:
            _close_all(qps)
        for nic in self.nics.values():
            nic.close()


def _close_all(objs: list[Any]) -> None:
    for o in objs:
        try:
            o.close()
        except Exception as e:  # pragma: no cover - device already gone
            log.debug("closing %r: %s", o, e)


class RdmaPath(Path):
    """Queue pairs from one local NIC to one NIC of a peer; connected on first use."""

    def __init__(
        self, transport: RdmaTransport, host: str, port: int, local_nic: str, remote_nic: str
    ):
        opts = transport.engine.options
        super().__init__(f"rdma {local_nic}->{remote_nic}@{host}:{port}", local_nic, remote_nic,
                         opts.pause_after_failures, opts.pause_s)  # fmt: skip
        self.transport = transport
        self.host, self.port = host, port
        self._qps: list[Any] = []
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def _connect(self) -> list[Any]:
        t, opts = self.transport, self.transport.engine.options
        nic = t.nics[self.local_nic]
        qps = [nic.create_qp(MAX_SEND_WR) for _ in range(opts.connections_per_peer)]
        psns = [secrets.randbits(24) for _ in qps]
        mine = [
            QpInfo(nic.gid, nic.lid, int(qp.qp_num), p) for qp, p in zip(qps, psns, strict=True)
        ]
        msg = RdmaConnectMsg(t.engine.name, self.local_nic, self.remote_nic, mine)
        status, body = control_call(self.host, self.port, t.engine._secret, Op.RDMA_CONNECT,
                                    _encode(msg), opts.slice_io_timeout_s)  # fmt: skip
        if status != Status.OK:
            _close_all(qps)
            raise TransferError(f"peer refused RDMA_CONNECT: {status_text(status)} {body[:200]!r}")
        reply = _decode_connect(body)
        if len(reply.qps) != len(qps):
            _close_all(qps)
            raise TransferError(f"peer answered {len(reply.qps)} queue pairs, asked {len(qps)}")
        for qp, psn, r in zip(qps, psns, reply.qps, strict=True):
            nic.connect(qp, QpEndpoint(r.gid, r.lid, r.qpn, r.psn), psn)
        return qps

    def dispatch(self, slices: list[Slice]) -> None:
        with self._lock:
            if not self._qps:
                try:
                    self._qps = self._connect()
                except (OSError, MooncakeError, msgspec.DecodeError) as e:
                    for s in slices:
                        self.transport.report(s, f"{self.key}: connect failed: {e}", True)
                    return
            qps = self._qps
        for s in slices:
            self.transport.post(s, self, qps[next(self._rr) % len(qps)])

    def reset(self) -> None:
        """Forget the queue pairs (an RC QP in error state is useless); reconnect on next use."""
        with self._lock:
            old, self._qps = self._qps, []
        _close_all(old)

    def close(self) -> None:
        self.reset()

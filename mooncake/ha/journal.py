"""`EtcdJournal`: the pool's committed state in etcd, written only while this master leads.

Keys: `<prefix>/pool/s/<segment name>` and `<prefix>/pool/o/<object key>`, each holding its
entry as msgpack (store/metadata/poolstate.py). A write is one transaction per at most 128 changes
(etcd's limit), each guarded by "the leader key still holds this master": a master that
lost its leadership cannot change the pool any more (its write fails, and it stops). A put
answered ok is therefore in etcd (a quorum of it), and a new leader reads it back.

Each entry is sealed with the cluster secret over its key (ha/sealed.py): a new leader
leaves out, and reports critically, every entry no master wrote, instead of trusting it or
refusing the whole pool. A write whose fence fails on a forged leader record puts this
master's record back (`Election.reclaim`) and is tried once more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from mooncake.config.etcd import COMMIT_WINDOW_S, COMMITS_IN_FLIGHT
from mooncake.ha.etcd import MAX_TXN_OPS, Compare, Delete, Etcd, EtcdError, KeyValue, Put
from mooncake.ha.sealed import ForgedRecord, Sealer
from mooncake.store.metadata.journal import BaseJournal, JournalError
from mooncake.store.metadata.poolstate import ObjectEntry, PoolChanges, PoolState, SegmentEntry

log = logging.getLogger(__name__)
SHOWN_KEYS = 5  # forged keys named in the report of a load


class EtcdJournal(BaseJournal):
    is_grouped = True  # a transaction is a network round trip and a disk sync in etcd
    max_group_ops = MAX_TXN_OPS
    # NOTE: etcd's --max-request-bytes is 1.5 MiB by default: a group stays well below it
    max_group_bytes = 1 << 20

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        fence_key: str,
        fence_value: bytes,
        sealer: Sealer,
        reclaim: Callable[[KeyValue | None], bool],  # Election.reclaim: True = fence holds
        *,
        window_s: float = COMMIT_WINDOW_S,  # group commit: s a group waits for more
        in_flight: int = COMMITS_IN_FLIGHT,  # groups written at once
    ):
        self.etcd, self.sealer, self.reclaim = etcd, sealer, reclaim
        self.group_window_s, self.max_groups_in_flight = window_s, in_flight
        self.seg_prefix, self.obj_prefix = f"{prefix}/pool/s/", f"{prefix}/pool/o/"
        self.fence_key, self.fence = fence_key, Compare.equals(fence_key, fence_value)
        self._encoder = msgspec.msgpack.Encoder()

    def load(self) -> PoolState:
        try:
            segs = self.etcd.get_prefix(self.seg_prefix)
            objs = self.etcd.get_prefix(self.obj_prefix)
        except EtcdError as e:
            raise JournalError(f"cannot read the pool's state from etcd: {e}") from e
        forged: list[str] = []
        try:
            return PoolState(
                segments=tuple(
                    msgspec.msgpack.decode(v, type=SegmentEntry) for v in self._open(segs, forged)
                ),
                objects=tuple(
                    msgspec.msgpack.decode(v, type=ObjectEntry) for v in self._open(objs, forged)
                ),
            )
        except msgspec.DecodeError as e:
            raise JournalError(
                f"the pool's state in etcd under {self.seg_prefix.rsplit('/pool/', 1)[0]} is "
                f"damaged ({e}); delete that prefix to start with an empty pool"
            ) from e
        finally:
            if forged:
                log.critical(
                    "pool journal: left out %d etcd entries no master of this cluster wrote "
                    "(forged, or written with another cluster.secret): %s; etcd must not be "
                    "writable without credentials (docs/ha.md)",
                    len(forged),
                    ", ".join(forged[:SHOWN_KEYS]) + (", ..." if len(forged) > SHOWN_KEYS else ""),
                )

    def _open(self, kvs: list[KeyValue], forged: list[str]) -> list[bytes]:
        """The payloads of the genuine entries of `kvs`; the keys of the others to `forged`."""
        out = []
        for kv in kvs:
            try:
                out.append(self.sealer.open(kv))
            except ForgedRecord:
                forged.append(kv.key)
        return out

    def write(self, changes: PoolChanges) -> None:
        ops: list[Put | Delete] = []
        for name, seg in changes.segments.items():
            key = self.seg_prefix + name
            ops.append(Delete(key) if seg is None else self._put(key, seg))
        for name, obj in changes.objects.items():
            key = self.obj_prefix + name
            ops.append(Delete(key) if obj is None else self._put(key, obj))
        for i in range(0, len(ops), MAX_TXN_OPS):
            try:
                ok = self._fenced(ops[i : i + MAX_TXN_OPS])
            except EtcdError as e:
                raise JournalError(f"cannot journal the pool's changes in etcd: {e}") from e
            if not ok:
                raise JournalError(
                    "this master no longer leads the cluster (etcd's leader key "
                    "names another): it must not change the pool"
                )

    def _put(self, key: str, entry: SegmentEntry | ObjectEntry) -> Put:
        return Put(key, self.sealer.seal(key, self._encoder.encode(entry)))

    def _fenced(self, ops: list[Put | Delete]) -> bool:
        """Apply `ops` if this master leads; once more after reclaiming a forged leader key."""
        ok, current = self.etcd.txn([self.fence], ops, read=self.fence_key)
        if not ok and self.reclaim(current):
            ok, _ = self.etcd.txn([self.fence], ops)
        return ok

"""`EtcdJournal`: the pool's committed state in etcd, written only while this master leads.

Keys: `<prefix>/pool/s/<segment name>` and `<prefix>/pool/o/<object key>`, each holding its
entry as msgpack (store/poolstate.py). A write is one transaction per at most 128 changes
(etcd's limit), each guarded by "the leader key still holds this master": a master that
lost its leadership cannot change the pool any more (its write fails, and it stops). A put
answered ok is therefore in etcd (a quorum of it), and a new leader reads it back.
"""

from __future__ import annotations

import msgspec

from mooncake.ha.etcd import MAX_TXN_OPS, Compare, Delete, Etcd, EtcdError, Put
from mooncake.store.journal import BaseJournal, JournalError
from mooncake.store.poolstate import ObjectEntry, PoolChanges, PoolState, SegmentEntry


class EtcdJournal(BaseJournal):
    def __init__(self, etcd: Etcd, prefix: str, fence_key: str, fence_value: bytes):
        self.etcd = etcd
        self.seg_prefix, self.obj_prefix = f"{prefix}/pool/s/", f"{prefix}/pool/o/"
        self.fence = Compare.equals(fence_key, fence_value)
        self._encoder = msgspec.msgpack.Encoder()

    def load(self) -> PoolState:
        try:
            segs = self.etcd.get_prefix(self.seg_prefix)
            objs = self.etcd.get_prefix(self.obj_prefix)
        except EtcdError as e:
            raise JournalError(f"cannot read the pool's state from etcd: {e}") from e
        try:
            return PoolState(
                segments=tuple(msgspec.msgpack.decode(kv.value, type=SegmentEntry) for kv in segs),
                objects=tuple(msgspec.msgpack.decode(kv.value, type=ObjectEntry) for kv in objs),
            )
        except msgspec.DecodeError as e:
            raise JournalError(
                f"the pool's state in etcd under {self.seg_prefix.rsplit('/pool/', 1)[0]} is "
                f"damaged ({e}); delete that prefix to start with an empty pool"
            ) from e

    def write(self, changes: PoolChanges) -> None:
        ops: list[Put | Delete] = []
        for name, seg in changes.segments.items():
            key = self.seg_prefix + name
            ops.append(Delete(key) if seg is None else Put(key, self._encoder.encode(seg)))
        for name, obj in changes.objects.items():
            key = self.obj_prefix + name
            ops.append(Delete(key) if obj is None else Put(key, self._encoder.encode(obj)))
        for i in range(0, len(ops), MAX_TXN_OPS):
            try:
                ok, _ = self.etcd.txn([self.fence], ops[i : i + MAX_TXN_OPS])
            except EtcdError as e:
                raise JournalError(f"cannot journal the pool's changes in etcd: {e}") from e
            if not ok:
                raise JournalError(
                    "this master no longer leads the cluster (etcd's leader key "
                    "names another): it must not change the pool"
                )

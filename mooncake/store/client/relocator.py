"""What a writer does for the objects the master relocated to make its put room on its own
node (store/metadata/eviction.py, `room_on_writer`): each `Relocation` in a put_start answer is
copied from where the object was to where it goes, before the put's value is written
(the value may take the object's old range); the put's end makes it readable there.

The bytes pass through one registered buffer of this client, grown as needed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from mooncake.errors import TransferError
from mooncake.store.client.datapath import DataPath
from mooncake.store.metadata.objects import PutStartResult
from mooncake.transfer.engine import TransferEngine


class Relocator:
    """Copies relocated objects for one client (`engine`, its `data` path)."""

    def __init__(self, engine: TransferEngine, data: DataPath, buffer_name: str):
        self.engine, self.data, self.buffer_name = engine, data, buffer_name
        self._lock = threading.Lock()  # NOTE: guards the buffer; taken after the client's
        self._buffer: np.ndarray | None = None  # registered as buffer_name

    def copy(self, starts: Sequence[PutStartResult]) -> dict[str, str]:
        """Copy every relocation of the "ok" answers in `starts`; returns key of the put ->
        why one of its copies failed (the caller revokes that put, which drops the objects
        it carried)."""
        failed: dict[str, str] = {}
        moves = [(r.key, rel) for r in starts if r.status == "ok" for rel in r.relocations]
        if not moves:
            return failed
        with self._lock:
            name = self.buffer_name
            need = max(rel.src.size for _, rel in moves)
            if self._buffer is None or len(self._buffer) < need:
                if self._buffer is not None:
                    self.engine.unregister(name)
                self._buffer = self.engine.allocate(name, need)
            for key, rel in moves:
                if key in failed:
                    continue
                try:
                    self.data.read_one(rel.src, name, 0, rel.src.size)
                except TransferError as e:
                    failed[key] = f"relocating {rel.key!r} for the put: {e}"
                    continue
                why = self.data.write([(rel.key, (rel.dst,), name, 0)])
                if why:
                    failed[key] = f"relocating {rel.key!r} for the put: {why[rel.key]}"
        return failed

"""Where the pool's committed state is kept durable, so a new master rebuilds it.

The master's Store service writes each locked operation's `PoolChanges` (poolstate.py) to
its journal before it answers and before the lock is released: a put_end answered "ok" is
in the journal, and a range freed by an eviction or a removal is journaled as free before
any later put can be given it. Two journals:

- `FileJournal`: an append-only file of length-prefixed msgpack batches beside the master
  (a master restarted on the same host reads it back; rewritten compacted on load and when
  it grows to several times the live state). A torn last batch (the master died while
  writing it) was never answered, and is ignored.
- `EtcdJournal` (mooncake/ha/journal.py): one etcd key per segment and per object, written
  in transactions fenced on this master's leadership (several masters on etcd).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import msgspec

from mooncake.errors import MooncakeError
from mooncake.store.metadata.poolstate import ObjectEntry, PoolChanges, PoolState, SegmentEntry

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")  # bytes of the batch that follows
COMPACT_MIN_RECORDS = 10_000  # records appended before a rewrite is considered


class JournalError(MooncakeError):
    """The pool's journal could not be read or written."""


class JournalBatch(msgspec.Struct, frozen=True, array_like=True):
    segments: list[tuple[str, SegmentEntry | None]]  # name -> entry (None: unmounted)
    objects: list[tuple[str, ObjectEntry | None]]  # key -> entry (None: gone)


class BaseJournal:
    """Durable storage of the pool's committed state."""

    # NOTE: a journal whose write is cheap (a file append: no fsync, no network) is written
    # at once under the Store's lock; a slow one (etcd) in groups, off it (groupcommit.py)
    is_grouped = False
    # one write's bounds and how long it waits to fill
    max_group_ops = 4096  # distinct keys
    max_group_bytes = 4 << 20  # bytes, estimated
    group_window_s = 0.0  # s; 0 = take what is queued
    max_groups_in_flight = 1  # writes at once (groupcommit.py, rule 1: independent ones)

    def load(self) -> PoolState:
        """The state as last written (empty when there is none)."""
        raise NotImplementedError

    def write(self, changes: PoolChanges) -> None:
        """Make `changes` durable before returning; raises JournalError."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def apply(
    segments: dict[str, SegmentEntry], objects: dict[str, ObjectEntry], batch: JournalBatch
) -> None:
    for name, seg in batch.segments:
        if seg is None:
            segments.pop(name, None)
        else:
            segments[name] = seg
    for key, obj in batch.objects:
        if obj is None:
            objects.pop(key, None)
        else:
            objects[key] = obj


class FileJournal(BaseJournal):
    """The journal as one file (see the module docstring); a mirror of it stays in memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._segments: dict[str, SegmentEntry] = {}
        self._objects: dict[str, ObjectEntry] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._num_appended = 0  # records since the last rewrite
        self._fd = -1
        self._is_loaded = False

    def load(self) -> PoolState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            raise JournalError(f"cannot read the pool journal {self.path}: {e}") from e
        self._is_loaded = True
        decoder = msgspec.msgpack.Decoder(JournalBatch)
        pos = 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if pos + _LEN.size + n > len(data):
                break  # NOTE: a torn last batch: never answered
            try:
                batch = decoder.decode(data[pos + _LEN.size : pos + _LEN.size + n])
            except msgspec.DecodeError as e:
                raise JournalError(
                    f"the pool journal {self.path} is damaged at byte {pos}: {e}; move it "
                    "away to start with an empty pool"
                ) from e
            apply(self._segments, self._objects, batch)
            pos += _LEN.size + n
        if data:
            log.info(
                "pool journal %s: %d segments, %d objects",
                self.path,
                len(self._segments),
                len(self._objects),
            )
        self._rewrite()
        return PoolState(
            segments=tuple(self._segments.values()), objects=tuple(self._objects.values())
        )

    def write(self, changes: PoolChanges) -> None:
        assert self._is_loaded, f"{self.path}: written before load() (it would lose the pool)"
        batch = JournalBatch(list(changes.segments.items()), list(changes.objects.items()))
        apply(self._segments, self._objects, batch)
        if self._fd < 0:
            self._rewrite()
            return
        payload = self._encoder.encode(batch)
        self._append(_LEN.pack(len(payload)) + payload)
        self._num_appended += len(batch.segments) + len(batch.objects)
        live = len(self._segments) + len(self._objects)
        if self._num_appended > max(COMPACT_MIN_RECORDS, 4 * live):
            self._rewrite()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise JournalError(f"cannot write the pool journal {self.path}: {e}") from e

    def _rewrite(self) -> None:
        """Write the live state as one batch to a new file and put it in place."""
        batch = JournalBatch(list(self._segments.items()), list(self._objects.items()))
        payload = self._encoder.encode(batch)
        tmp = self.path.with_name(self.path.name + ".new")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, _LEN.pack(len(payload)) + payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:
            raise JournalError(f"cannot write the pool journal {self.path}: {e}") from e
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._num_appended = 0

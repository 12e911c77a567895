"""Group commit: the Store's journal writes batched, and taken off the Store's lock.

A committing call drains its `PoolChanges` under the Store's lock and queues them here
(`submit`, which returns its ticket); it releases the lock, and replies once `wait(ticket)`
returns. A writer thread takes what is queued, oldest first, merges it into one group and
writes the group as one journal write (one etcd transaction): while a transaction is in
flight the next calls queue, and the next group carries them all. Up to the journal's
`max_groups_in_flight` writers do this at once (etcd: a transaction's wall time is mostly
waiting, for the round trip and for etcd's apply, so one writer at a time leaves the
commit rate at group size / latency), each group held back while an older group it
depends on is in flight (rule 1). A journal whose write is
cheap (`is_grouped` False: the file journal appends to the page cache, without fsync) is
written at once in `submit`, under the lock, as before: a hand-off to a thread costs more
than the append (measured: mooncake/bench/commits.py).

A group is bounded by the journal's `max_group_ops` (distinct keys: etcd's --max-txn-ops)
and `max_group_bytes` (its request size limit, with room for the seals and the encoding),
and waits at most `window_s` after its first entry for more (0: take what is queued).
An entry alone over the bound is written alone (split over transactions, as before).

The rule kept (docs/ha.md, "Consistency argument"): **no reply leaves the master before
every change queued before its call left the lock is durable**.

1. Queue order is lock order: `submit` runs under the Store's lock, so the journal takes
   the changes in the order memory made them. Groups are formed in queue order and each is
   written all or nothing. A group is written while an older one is in flight only if the
   two are independent: neither changes a segment, they change no object key in common,
   and no replica range of the newer overlaps a range the older freed. So whatever subset
   of the in-flight groups a crash leaves in the journal, each key holds its entry of some
   moment of the lock's history, and no two entries claim one range ("journaled free
   before journaled taken"); with one writer (the default) the journal holds a prefix of
   the queue.
2. A call waits for a ticket: the sequence number of the newest entry its reply can tell
   of. A call that changed something waits for its own entry (so for all before it); one
   that did not waits for the last entry of each key it read (`get_replicas`, `exists`),
   and when it hands out ranges (`put_start`, write slots) also, for each range, for the
   entry queued last when a range overlapping it (or its whole segment) was freed, if that
   is not durable yet; any other call waits for every entry queued. Other
   calls may see a change in memory before it is durable (that is what takes the lock off
   the network), but nothing they answer leaves before it is: a `put_end` answered ok is
   journaled, a reader is never told of an object whose commit may be lost, and a range
   freed by a removal, an eviction or a move reaches a new writer only after its free is
   durable, so "journaled free before journaled taken" still holds for every range a
   client can write.
3. Failure is sticky: once a group fails (etcd unreachable, or the fence: this master no
   longer leads) nothing more is sent; every call still waiting raises JournalError,
   `on_error` is told once (the master exits, status 75), and calls whose groups were
   durable before it were answered. Memory is then ahead of the journal, so nothing more is
   answered from it. A group already in flight beside the failed one may still land (a
   fenced one only while this master leads): its callers were told it failed, the outcome
   a reply lost on the network gives too, and rule 1 keeps the journal consistent.

Not held back: the events the Store hands its listeners under the lock (the Conductor's
prefix index, the KV event feed). They are hints: a block whose commit is lost with a
failed group is a miss on the new leader, which rebuilds its index from the journal.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from mooncake.store.metadata.journal import BaseJournal, JournalError
from mooncake.store.metadata.poolstate import PoolChanges
from mooncake.store.metadata.segments import Range

log = logging.getLogger(__name__)
KEY_SEQ_MIN = 4096  # keys remembered before the durable ones are forgotten


class GroupCommit:
    """Writes queued `PoolChanges` to `journal` in groups, on a thread of its own."""

    def __init__(
        self,
        journal: BaseJournal,
        *,
        window_s: float | None = None,  # s a group waits for more; None: the journal's
        on_error: Callable[[JournalError], None] | None = None,  # the first failure, once
        max_in_flight: int = 0,  # groups written at once; 0: the journal's
    ):
        self.journal = journal
        self.is_grouped = journal.is_grouped  # False: written at once, in `submit`
        self.window_s = journal.group_window_s if window_s is None else window_s
        self.max_ops = journal.max_group_ops  # distinct keys in one group
        self.max_bytes = journal.max_group_bytes  # estimated bytes of one group
        self.on_error = on_error
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # writers wait for entries
        self._landed = threading.Condition(self._lock)  # writers wait for older groups
        # callers waiting for their group: (ticket, arrival, a lock held until woken); the
        # writer wakes exactly those its group made durable (a notify_all woke them all)
        self._waiters: list[tuple[int, int, threading.Lock]] = []  # a heap
        self._arrivals = itertools.count()
        self._stopped = False  # the writer ended (closed, failed, or a bug)
        # (seq, changes, ranges the entry freed), oldest first
        self._queue: deque[tuple[int, PoolChanges, Sequence[Range]]] = deque()
        self.last_seq = 0  # of the newest entry queued
        self.durable_seq = 0  # every entry up to this one is in the journal
        self.error: JournalError | None = None  # the failure that stopped the writer
        self._key_seq: dict[str, int] = {}  # object key -> seq of its last queued entry
        self._key_seq_mark = KEY_SEQ_MIN  # size of _key_seq at which durable ones go
        # segment -> (start, end, seq queued last when freed), oldest first: frees that
        # may not be durable yet (a range handed out waits for an overlapping one)
        self._frees: dict[str, deque[tuple[int, int, int]]] = {}
        self._num_frees = 0  # entries in _frees
        self._frees_mark = KEY_SEQ_MIN  # _num_frees at which the durable ones go
        self.num_groups = 0  # groups written
        self.num_entries = 0  # entries written in them
        self._is_closing = False
        # groups formed and not yet written, oldest first (the writers' shared view)
        self._pending: deque[_Group] = deque()
        num_writers = (max_in_flight or journal.max_groups_in_flight) if self.is_grouped else 0
        self._threads = [
            threading.Thread(target=self._run, name=f"group-commit-{i}", daemon=True)
            for i in range(num_writers)
        ]
        self._num_running = len(self._threads)
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        changes: PoolChanges,
        *,
        frees: Sequence[Range] = (),
        reads: Iterable[str] | None = None,
        takes: Sequence[Range] = (),
    ) -> int:
        """Queue `changes` (nothing when empty); returns the ticket to `wait` on. Call it
        under the lock that orders the changes (the Store's), once per call.

        `frees`: the ranges the call released (their release may still be queued). The
        ticket of a call that changed nothing (rule 2 of the module docstring): `reads`:
        the only keys its reply tells of (None: it may tell of anything: every queued
        change); `takes`: the ranges its reply hands out (each may overlap a range whose
        free is queued)."""
        with self._lock:
            if changes and not self.is_grouped:
                return self._write_now(changes)
            if changes:
                self.last_seq += 1
                self._queue.append((self.last_seq, changes, frees))
                self._work.notify()
                self._note_keys(changes)
            if frees and self.is_grouped:
                self._note_frees(frees)
            if changes or reads is None:
                return self.last_seq
            ticket = self._taken_ticket(takes) if takes else 0
            key_seq = self._key_seq
            for key in reads:
                ticket = max(ticket, key_seq.get(key, 0))
            return ticket if ticket > self.durable_seq else 0

    def _write_now(self, changes: PoolChanges) -> int:
        """A journal not grouped: write `changes` here (lock held), as a group of one."""
        self.last_seq += 1
        if self.error is None:
            try:
                self.journal.write(changes)
            except JournalError as e:
                self.error = e
                if self.on_error is not None:
                    self.on_error(e)
                return self.last_seq
            self.durable_seq = self.last_seq
            self.num_groups += 1
            self.num_entries += 1
        return self.last_seq

    def _note_keys(self, changes: PoolChanges) -> None:
        """NOTE: what a reply may tell of a key is durable once its last entry is"""
        key_seq, seq = self._key_seq, self.last_seq
        if len(key_seq) >= self._key_seq_mark:  # forget the durable ones, amortized
            durable = self.durable_seq
            self._key_seq = key_seq = {k: s for k, s in key_seq.items() if s > durable}
            self._key_seq_mark = max(KEY_SEQ_MIN, 2 * len(key_seq))
        for key in changes.objects:
            key_seq[key] = seq

    def _note_frees(self, frees: Sequence[Range]) -> None:
        """NOTE: a range handed out is safe to write once the frees it overlaps are durable"""
        if self._num_frees >= self._frees_mark:  # forget the durable ones, amortized
            durable = self.durable_seq
            kept = {seg: deque(f for f in fs if f[2] > durable) for seg, fs in self._frees.items()}
            self._frees = {seg: fs for seg, fs in kept.items() if fs}
            self._num_frees = sum(len(fs) for fs in self._frees.values())
            self._frees_mark = max(KEY_SEQ_MIN, 2 * self._num_frees)
        seq = self.last_seq
        for seg, start, end in frees:
            self._frees.setdefault(seg, deque()).append((start, end, seq))
        self._num_frees += len(frees)

    def _taken_ticket(self, takes: Sequence[Range]) -> int:
        """The newest seq of a free not yet durable that overlaps one of `takes`; 0: none."""
        durable, ticket = self.durable_seq, 0
        for seg, start, end in takes:
            pending = self._frees.get(seg)
            while pending and pending[0][2] <= durable:
                pending.popleft()
                self._num_frees -= 1
            if pending:
                for free_start, free_end, seq in pending:
                    if free_start < end and start < free_end and seq > ticket:
                        ticket = seq
        return ticket

    def wait(self, ticket: int) -> None:
        """Return once every entry up to `ticket` is durable; raises JournalError if a
        group holding one of them failed (or none can be written any more)."""
        if self.durable_seq >= ticket:  # NOTE: an int read: no lock on the common path
            return
        with self._lock:
            woken = None
            if self.durable_seq < ticket and self.error is None and not self._is_stopped():
                woken = threading.Lock()
                woken.acquire()
                heapq.heappush(self._waiters, (ticket, next(self._arrivals), woken))
        if woken is not None:
            woken.acquire()  # NOTE: released by the writer: durable, failed or stopped
        with self._lock:
            if self.durable_seq >= ticket:
                return
            why = self.error or JournalError("the journal was closed")
        raise JournalError(f"this change was not journaled ({why}); it is not applied") from why

    def _wake(self, everyone: bool = False) -> None:
        """Wake the waiters whose tickets are durable (lock held); `everyone`: all."""
        waiters, durable = self._waiters, self.durable_seq
        while waiters and (everyone or waiters[0][0] <= durable):
            heapq.heappop(waiters)[2].release()

    def close(self) -> None:
        """Write what is queued, then stop the writers."""
        with self._lock:
            self._is_closing = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join()

    def _is_stopped(self) -> bool:
        return self.is_grouped and self._stopped

    def _run(self) -> None:
        try:
            while (group := self._next_group()) is not None:
                try:
                    self.journal.write(group.changes)
                except JournalError as e:
                    self._fail(e)
                    return
                with self._lock:
                    group.is_written = True
                    self._land()
        except Exception as e:  # a bug of ours: nothing more can be made durable
            log.exception("group commit: the journal writer failed")
            self._fail(JournalError(f"the journal writer failed: {type(e).__name__}: {e}"))
        finally:
            with self._lock:
                self._num_running -= 1
                if self._num_running == 0:  # NOTE: what is still queued stays unwritten
                    self._stopped = True
                    self._wake(everyone=True)

    def _land(self) -> None:
        """The oldest groups written are durable, up to the first one still in flight
        (lock held): wake their waiters and the writers holding groups back for them."""
        pending = self._pending
        while pending and pending[0].is_written:
            group = pending.popleft()
            self.durable_seq = group.last
            self.num_groups += 1
            self.num_entries += group.num
        self._wake()
        self._landed.notify_all()

    def _fail(self, e: JournalError) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = e
            self._landed.notify_all()
            self._wake(everyone=True)
        if not first:
            return
        log.critical("group commit: a group of changes failed (%s); nothing more is written", e)
        if self.on_error is not None:
            self.on_error(e)

    def _next_group(self) -> _Group | None:
        """The oldest queued entries that fit one group, merged, once every older group it
        depends on is durable; None once closing with nothing queued, or failed."""
        with self._lock:
            while True:
                while not self._queue:
                    if self._is_closing or self.error is not None:
                        return None
                    self._work.wait()
                if self.window_s > 0 and not self._is_closing:
                    deadline = time.monotonic() + self.window_s
                    while not self._is_full() and (left := deadline - time.monotonic()) > 0:
                        self._work.wait(left)
                if self.error is not None:
                    return None
                if self._queue:  # NOTE: another writer may have taken them meanwhile
                    break
            group = self._take_group()
            older = [g for g in self._pending if group.depends_on(g)]
            self._pending.append(group)
            # NOTE: a group waits only for older ones, which never wait for it: no deadlock
            while self.error is None and any(not g.is_written for g in older):
                self._landed.wait()
            return group if self.error is None else None

    def _take_group(self) -> _Group:
        """Pop the oldest entries that fit one group (lock held)."""
        group = _Group()
        changes, queue = group.changes, self._queue
        num_ops = num_bytes = 0
        while queue:
            seq, entry, frees = queue[0]
            ops, size = _added(changes, entry)
            if group.num and (num_ops + ops > self.max_ops or num_bytes + size > self.max_bytes):
                break
            queue.popleft()
            changes.segments.update(entry.segments)
            changes.objects.update(entry.objects)
            group.frees.extend(frees)
            num_ops, num_bytes = num_ops + ops, num_bytes + size
            group.num, group.last = group.num + 1, seq
        return group

    def _is_full(self) -> bool:
        """NOTE: a cheap upper bound (keys counted with repeats): enough to stop waiting."""
        n = sum(len(c.segments) + len(c.objects) for _, c, _ in self._queue)
        return n >= self.max_ops


class _Group:
    """Queued entries merged into one journal write."""

    __slots__ = ("changes", "frees", "last", "num", "is_written")

    def __init__(self) -> None:
        self.changes = PoolChanges()
        self.frees: list[Range] = []  # ranges its entries freed
        self.last = 0  # seq of its newest entry
        self.num = 0  # entries
        self.is_written = False

    def depends_on(self, older: _Group) -> bool:
        """Whether this group may land only after `older` (rule 1 of the module docstring):
        either changes a segment, they share an object key, or one of this group's
        replicas lies in a range `older` freed."""
        mine, theirs = self.changes, older.changes
        if mine.segments or theirs.segments:
            return True
        small, large = sorted((mine.objects, theirs.objects), key=len)
        if any(key in large for key in small):
            return True
        if not older.frees:
            return False
        for obj in mine.objects.values():
            if obj is None:
                continue
            for r in obj.replicas:
                for seg, start, end in older.frees:
                    if seg == r.segment and start < r.offset + r.size and r.offset < end:
                        return True
        return False


def _added(group: PoolChanges, changes: PoolChanges) -> tuple[int, int]:
    """Keys `changes` adds to `group` (a key already there is overwritten: no new op), and
    an upper bound of their bytes in one journal write."""
    ops = sum(name not in group.segments for name in changes.segments)
    ops += sum(key not in group.objects for key in changes.objects)
    size = 0
    for name, seg in changes.segments.items():
        size += ENTRY_BYTES + 2 * len(name)
        if seg is not None:
            size += len(seg.node_id) + len(seg.endpoint)
    for key, obj in changes.objects.items():
        size += ENTRY_BYTES + 2 * len(key)
        if obj is not None:
            size += sum(REPLICA_BYTES + len(r.segment) for r in obj.replicas)
    return ops, size


# NOTE: bounds of the fixed part of an entry (its etcd key prefix, seal, msgpack fields and
# the transaction's framing) and of a replica's; the variable parts are counted as they are
ENTRY_BYTES = 192
REPLICA_BYTES = 48

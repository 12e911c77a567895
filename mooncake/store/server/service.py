"""The master's side of the Store: a MetadataService served over RPC, kept tidy by a loop.

    service = StoreService(secret, MetadataConfig(), address="tcp://127.0.0.1:0")
    service.start()            # service.address has the real port
    ...
    service.stop()

The same handlers also answer on the direct channel (store/server/direct.py: a TCP port beside
the RPC address, for the clients' hot calls), on that server's connection threads. Every
handler and the housekeeping thread (node expiry, stale puts, watermark eviction) take the
same lock, so the service never sees two callers. A handler queues its journal changes
under the lock and replies once they are durable, off the lock
(store/metadata/groupcommit.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncake.rpc.server import RpcServer
from mooncake.rpc.wire import Msg
from mooncake.store.metadata import audit
from mooncake.store.metadata.groupcommit import GroupCommit
from mooncake.store.metadata.journal import BaseJournal, JournalError
from mooncake.store.metadata.objects import StoreEvent, StoreStats
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.server import messages as m
from mooncake.store.server.direct import DirectServer
from mooncake.store.server.messages import DirectPortMsg, DirectPortReplyMsg, register

if TYPE_CHECKING:
    from mooncake.config.portrange import PortRange
    from mooncake.store.server.metrics import MetricsServer

log = logging.getLogger(__name__)
# NOTE: requests whose replies tell only of their keys and of the ranges they hand out:
# they wait only for those (store/metadata/groupcommit.py, rule 2); others for everything
# (any other request that hands out ranges has reads None: it waits for everything)
_ONE_KEY = (m.GetReplicasMsg, m.ExistsMsg, m.PutStartMsg)
_KEYS = (m.BatchGetReplicasMsg, m.BatchExistsMsg, m.BatchPutStartMsg, m.BatchPutSlotMsg)
_ALLOCATES = (m.PutStartMsg, m.BatchPutStartMsg, m.BatchPutSlotMsg)


def _read_keys(msg: Msg | None) -> list[str] | tuple[str, ...] | None:
    if isinstance(msg, _ONE_KEY):
        return [msg.key]
    if isinstance(msg, _KEYS):
        return msg.keys
    return None


class StoreService:
    """Owns a MetadataService, the RpcServer that serves it, and its housekeeping loop."""

    def __init__(
        self,
        secret: bytes | str | None,
        config: MetadataConfig | None = None,
        *,
        address: str = "tcp://127.0.0.1:0",
        tick_s: float = 0.0,  # s between housekeeping passes; 0 = a quarter of the lease
        metrics_port: int | None = None,  # serve /metrics on 127.0.0.1:port (0 = any free)
        on_events: Callable[[list[StoreEvent]], None] | None = None,  # the Conductor's index
        # also answer store.* calls on a direct port (store/server/direct.py)
        direct: bool = True,
        direct_port: int | PortRange = 0,  # its TCP port on the RPC host; 0 = any, or a range
        journal: BaseJournal
        | None = None,  # where committed state is kept (store/metadata/journal.py)
    ):
        self.metadata = MetadataService(config)
        self.journal = journal
        self._is_restored = False  # the journal was loaded (restore)
        self.commits: GroupCommit | None = None  # writes to `journal` (made by restore)
        # a journal write failed: this master can no longer promise durability (default: raise)
        self.on_journal_error: Callable[[JournalError], None] | None = None
        self.on_events = on_events  # called under the lock, before a change's reply goes
        self.lock = threading.Lock()
        key = secret.encode() if isinstance(secret, str) else secret
        self.server = RpcServer(address, key, name="store")
        register(
            self.server,
            self.metadata,
            time.monotonic,
            lock=self.lock,
            after=self.flush,
            wait=self.wait_durable,
        )
        self._key = key if direct else None  # None: no direct channel
        self._direct_port = direct_port
        self.direct: DirectServer | None = None
        self.server.register(DirectPortMsg, self._direct_port_reply)
        cfg = self.metadata.config
        self.tick_s = tick_s or max(0.05, min(cfg.lease_ttl_s, cfg.heartbeat_ttl_s) / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="store-service", daemon=True)
        self.metrics: MetricsServer | None = None
        if metrics_port is not None:
            from mooncake.store.server.metrics import MetricsServer

            self.metrics = MetricsServer(self.stats, port=metrics_port)

    @property
    def address(self) -> str:
        """The RPC address clients and store nodes connect to (real port after start)."""
        return self.server.address

    @property
    def direct_port(self) -> int:
        """Port of the direct channel on the RPC address's host (0 = none)."""
        return self.direct.port if self.direct is not None else 0

    def _direct_port_reply(self, msg: DirectPortMsg, peer: object) -> DirectPortReplyMsg:
        host = self.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        return DirectPortReplyMsg(self.direct_port, host if host not in ("*", "0.0.0.0") else "")

    def start(self) -> None:
        """Rebuild the pool from the journal (if any), serve requests and start
        housekeeping; returns once the server is bound."""
        self.restore()
        self.server.start()
        if self._key is not None:
            host = self.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
            try:
                self.direct = DirectServer(self.server, self._key, host, self._direct_port)
            except OSError as e:  # e.g. an IPv6 wildcard: clients keep using the RPC
                log.warning("store: no direct channel on %s (%s); RPC only", host, e)
        self._thread.start()
        if self.metrics is not None:
            self.metrics.start()

    def restore(self) -> int:
        """Rebuild the metadata from the journal (start does it if not done); the objects
        restored. Raises JournalError when the journal cannot be read."""
        if self.journal is None or self._is_restored:
            return 0
        self._is_restored = True
        state = self.journal.load()
        with self.lock:
            num = self.metadata.restore(state, time.monotonic())
            self._committer()
        log.info(
            "store: rebuilt %d segments and %d of %d objects from the journal",
            len(state.segments),
            num,
            len(state.objects),
        )
        return num

    def flush(self, msg: Msg | None = None) -> int:
        """Queue what the last operation (`msg`, if a request) changed for the journal and
        hand its events to the listener (lock held); returns the ticket its reply waits on
        (`wait_durable`; 0: nothing to wait for).

        NOTE: so a put's commit is in the Conductor's index before the writer hears it is
        done: a request placed after that sees the block (a tick later, it might not)."""
        md = self.metadata
        ticket = 0
        freed, taken = md.space.drain_ranges()
        if self.journal is None:
            md.pool.changed_keys.clear()
            md.pool.changed_segments.clear()
        else:
            ticket = self._committer().submit(
                md.pool.drain_changes(),
                frees=freed,
                reads=_read_keys(msg),
                takes=taken if isinstance(msg, _ALLOCATES) else (),
            )
        self._deliver_events()
        return ticket

    def wait_durable(self, ticket: int) -> None:
        """Return once the journal holds everything queued up to `ticket` (not under the
        lock); raises JournalError when it cannot."""
        if self.commits is not None:
            self.commits.wait(ticket)

    def _committer(self) -> GroupCommit:
        assert self.journal is not None
        if self.commits is None:
            self.commits = GroupCommit(self.journal, on_error=self._journal_failed)
        assert self.commits.journal is self.journal, "the journal was replaced after use"
        return self.commits

    def _journal_failed(self, e: JournalError) -> None:
        """NOTE: memory is ahead of the journal now: every later call fails its wait"""
        if self.on_journal_error is not None:
            self.on_journal_error(e)

    def stats(self) -> StoreStats:
        """A snapshot of the metadata service's counters (taken under the lock)."""
        with self.lock:
            return audit.stats(self.metadata.pool)

    def replicate(self, keys: list[str], dst_node: str) -> int:
        """Start hot-spot copies of `keys` to `dst_node` (see MetadataService.replicate)."""
        with self.lock:
            started = self.metadata.replicate(keys, dst_node, time.monotonic())
            self.flush()
            return started

    def drop_stale_segments(self, node_id: str, before: float) -> None:
        """A node restarted: drop the segments its old process mounted before `before`
        (time.monotonic(); `MetadataService.drop_stale_segments`), so that puts are no
        longer placed in dead memory while the old registration's heartbeats run out."""
        with self.lock:
            if n := self.metadata.drop_stale_segments(node_id, before, time.monotonic()):
                log.warning("node %s restarted: %d segments of its old process dropped", node_id, n)
            self.flush()

    def tick(self) -> None:
        """One housekeeping pass: drop silent nodes and stale puts, evict above watermark."""
        with self.lock:
            now = time.monotonic()
            gone = self.metadata.expire(now)
            num_evicted = self.metadata.evictor.run(now)
            self.flush()
        if gone:
            log.warning("store nodes expired (no heartbeat): %s", ", ".join(gone))
        if num_evicted:
            log.info("evicted %d replicas above the high watermark", num_evicted)

    def _deliver_events(self) -> None:
        events = self.metadata.pool.drain_events()  # NOTE: drained even unheard: memory flat
        if self.on_events is not None and events:
            self.on_events(events)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # a bug must not stop expiry for good
                log.exception("store housekeeping failed")

    def stop(self) -> None:
        """Stop housekeeping and the RPC server."""
        if self.metrics is not None:
            self.metrics.stop()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.direct is not None:
            self.direct.close()
        self.server.stop()
        if self.commits is not None:
            self.commits.close()

    def __enter__(self) -> StoreService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Leader election of the masters on etcd.

Each master holds an etcd lease of `leader_ttl_s`, renewed every third of it, and under it
a member key `<prefix>/masters/<id>` (who it is: `MasterInfo`). It campaigns with one
transaction: if `<prefix>/leader` does not exist, create it, holding its `MasterInfo`, under
its lease. The winner leads until its lease ends; the others stand by, reading the leader
key every `election_poll_s` (and campaigning whenever it is gone). When the leader dies its
lease runs out after at most `leader_ttl_s` and its key goes with it, so a standby leads
within `leader_ttl_s + election_poll_s`.

A leader that could not renew its lease for most of its TTL (etcd unreachable, the process
stalled) steps down (`on_lost`) a margin before the lease can end (a quarter of the TTL, at
least two polls): another master may win once it ends, and two masters must never serve
the pool. Every journal write is fenced as well
(ha/journal.py): it applies only while the leader key still holds this master.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from mooncake.ha.etcd import Compare, Etcd, EtcdError, Put

log = logging.getLogger(__name__)


class MasterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One master process, as the others and `mooncake status` see it."""

    id: str
    rpc: str  # host:port of its control plane (listened on only while it leads)
    api: str  # base URL of its HTTP API
    pid: int


def leader_key(prefix: str) -> str:
    return f"{prefix}/leader"


def members_prefix(prefix: str) -> str:
    return f"{prefix}/masters/"


def find_masters(endpoints: Sequence[str], prefix: str, timeout_s: float) -> list[MasterInfo]:
    """The masters registered in etcd now (raises EtcdError when etcd does not answer)."""
    etcd = Etcd(endpoints, timeout_s)
    try:
        kvs = etcd.get_prefix(members_prefix(prefix))
    finally:
        etcd.close()
    return [msgspec.json.decode(kv.value, type=MasterInfo) for kv in kvs]


class Election:
    """One master's campaign; `on_elected` runs on a thread of its own, `on_lost` on the
    election's."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,  # every key of this cluster starts with it
        me: MasterInfo,
        ttl_s: float,  # s: the lease; a dead leader is replaced within about this long
        poll_s: float,  # s between reads of the leader key by a standby
        on_elected: Callable[[], None],
        on_lost: Callable[[str], None],  # why; the process must stop serving the pool
    ):
        self.etcd, self.prefix, self.me = etcd, prefix, me
        self.ttl_s, self.poll_s = ttl_s, poll_s
        self.on_elected, self.on_lost = on_elected, on_lost
        self.value = msgspec.json.encode(me)  # NOTE: the fence: the leader key's exact value
        self.is_leader = False
        self.leader: MasterInfo | None = None  # as last read
        self.lease = 0
        self._renewed = 0.0  # time.monotonic() when the last renewal that took was sent
        # s before the lease could end at which a leader that could not renew it steps down
        self.margin_s = max(ttl_s / 4, 2 * poll_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="election", daemon=True)

    def start(self) -> None:
        """Take a lease and register as a member (raises EtcdError when etcd does not
        answer), then campaign on a thread."""
        self._take_lease()
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning and give up the lease (a standby then leads at once)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.lease:
            self.etcd.revoke(self.lease)
            self.lease = 0

    def members(self) -> list[MasterInfo]:
        """Every master holding a live lease, by id."""
        kvs = self.etcd.get_prefix(members_prefix(self.prefix))
        return sorted(
            (msgspec.json.decode(kv.value, type=MasterInfo) for kv in kvs), key=lambda m: m.id
        )

    def _take_lease(self) -> None:
        sent = time.monotonic()
        self.lease = self.etcd.grant(self.ttl_s)
        self._renewed = sent
        self.etcd.put(members_prefix(self.prefix) + self.me.id, self.value, self.lease)

    def _loop(self) -> None:
        renew_s = self.ttl_s / 3
        next_renewal = time.monotonic() + renew_s
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_renewal:
                    next_renewal = now + renew_s
                    self._renew()
                if not self.is_leader:
                    self._campaign()
            except EtcdError as e:
                log.warning("election: %s", e)
            if self.is_leader and time.monotonic() - self._renewed > self.ttl_s - self.margin_s:
                self._step_down(
                    f"its etcd lease may run out (no renewal for {self.ttl_s - self.margin_s:g} s)"
                )
                return
            self._stop.wait(min(self.poll_s, max(next_renewal - time.monotonic(), 0.0)))

    def _renew(self) -> None:
        sent = time.monotonic()  # NOTE: etcd counts the lease from when it got this, or later
        if self.etcd.keepalive(self.lease):
            self._renewed = sent
            return
        if self.is_leader:
            self._step_down("its etcd lease expired")
            return
        log.warning("election: lease %x expired; taking a new one", self.lease)
        self._take_lease()

    def _campaign(self) -> None:
        key = leader_key(self.prefix)
        won, current = self.etcd.txn(
            [Compare.absent(key)], [Put(key, self.value, self.lease)], read=key
        )
        if won:
            self.is_leader, self.leader = True, self.me
            log.info("master %s leads the cluster (etcd lease %x)", self.me.id, self.lease)
            # NOTE: on its own thread: renewals go on while the pool is rebuilt
            threading.Thread(target=self.on_elected, name="takeover", daemon=True).start()
            return
        leader = msgspec.json.decode(current.value, type=MasterInfo) if current else None
        if leader != self.leader:
            log.info("master %s stands by; leader: %s", self.me.id, leader.id if leader else "none")
        self.leader = leader

    def _step_down(self, why: str) -> None:
        self.is_leader = False
        self._stop.set()
        log.critical("master %s steps down: %s", self.me.id, why)
        self.on_lost(why)

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

Every record is sealed with the cluster secret (ha/sealed.py) over its key and lease. A
leader record that is not (someone else who reached etcd wrote it) names no leader: a
standby forwards nothing to it and logs it once, critically. The leader checks its key
after each renewal (whenever a read can take all of `etcd.timeout_s` and leave its
step-down on time) and puts its own record back over a forged one (as its journal does when a
write's fence fails on one); a forged record nobody reclaims within `leader_ttl_s` is
replaced by a standby's campaign, so a forgery with no lease cannot block the election.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from mooncake.ha.etcd import Compare, Etcd, EtcdError, KeyValue, Put
from mooncake.ha.sealed import ForgedRecord, Sealer

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


def find_masters(etcd: Etcd, prefix: str, sealer: Sealer) -> list[MasterInfo]:
    """The masters registered in etcd now, by id; forged records are left out (and logged).
    Raises EtcdError when etcd does not answer."""
    out = []
    for kv in etcd.get_prefix(members_prefix(prefix)):
        try:
            out.append(msgspec.json.decode(sealer.open(kv), type=MasterInfo))
        except ForgedRecord as e:
            log.critical("election: ignored: %s", e)
    return sorted(out, key=lambda m: m.id)


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
        sealer: Sealer,  # the cluster secret's: seals this master's records, checks others'
    ):
        self.etcd, self.prefix, self.me, self.sealer = etcd, prefix, me, sealer
        self.key = leader_key(prefix)
        self.ttl_s, self.poll_s = ttl_s, poll_s
        self.on_elected, self.on_lost = on_elected, on_lost
        self.value = b""  # NOTE: the fence: the leader key's exact value (set with the lease)
        self._forged: bytes | None = None  # the forged leader record seen last
        self._forged_since = 0.0  # time.monotonic() when it was first seen
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
        return find_masters(self.etcd, self.prefix, self.sealer)

    def _take_lease(self) -> None:
        sent = time.monotonic()
        self.lease = self.etcd.grant(self.ttl_s)
        self._renewed = sent
        info = msgspec.json.encode(self.me)
        self.value = self.sealer.seal(self.key, info, self.lease)
        member = members_prefix(self.prefix) + self.me.id
        self.etcd.put(member, self.sealer.seal(member, info, self.lease), self.lease)

    def read_leader(self, kv: KeyValue | None) -> MasterInfo | None:
        """Who the leader record `kv` names; None when there is none or it is forged (a
        forgery is logged, critically, when it appears)."""
        if kv is None:
            return None
        try:
            info = msgspec.json.decode(self.sealer.open(kv), type=MasterInfo)
            self._forged = None
            return info
        except ForgedRecord as e:
            if kv.value != self._forged:
                self._forged, self._forged_since = kv.value, time.monotonic()
                log.critical("election: a forged leader record, ignored: %s", e)
            return None

    def reclaim(self, current: KeyValue | None) -> bool:
        """While leading: put this master's record back in the leader key if `current`, what
        it holds now, is forged or gone; True if the key holds this master's record now.
        Another master's genuine record is left alone (False)."""
        if current is not None and current.value == self.value and current.lease == self.lease:
            return True
        if current is None:
            cond = Compare.absent(self.key)
        elif self.read_leader(current) is None:
            cond = Compare.equals(self.key, current.value)
        else:
            return False
        if not self.is_leader:
            return False
        ok, _ = self.etcd.txn([cond], [Put(self.key, self.value, self.lease)])
        if ok:
            what = "a forged one" if current else "nothing (it was deleted)"
            log.critical("master %s put its leader record back over %s", self.me.id, what)
        return ok

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
                elif self._has_time_for_a_call() and not self.reclaim(self.etcd.get(self.key)):
                    self._step_down("the leader key names another master")
                    return
            except EtcdError as e:
                log.warning("election: %s", e)
            if self.is_leader and time.monotonic() - self._renewed > self.ttl_s - self.margin_s:
                self._step_down(
                    f"its etcd lease may run out (no renewal for {self.ttl_s - self.margin_s:g} s)"
                )
                return
            self._stop.wait(min(self.poll_s, max(next_renewal - time.monotonic(), 0.0)))

    def _has_time_for_a_call(self) -> bool:
        """NOTE: whether a read that takes all of its timeout still leaves the step-down on
        time: a leader reads its key only then (at each renewal when etcd answers)."""
        deadline = self.ttl_s - self.margin_s
        return time.monotonic() - self._renewed + self.etcd.timeout_s < deadline

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
        won, current = self.etcd.txn(
            [Compare.absent(self.key)], [Put(self.key, self.value, self.lease)], read=self.key
        )
        leader = self.read_leader(current)
        # NOTE: a live leader reclaims its key within a poll; a forgery left longer has no
        # leader behind it (or one that cannot write etcd): campaign over it
        is_stale = time.monotonic() - self._forged_since > self.ttl_s
        if current is not None and leader is None and not won and is_stale:
            forged = Compare.equals(self.key, current.value)
            won, _ = self.etcd.txn([forged], [Put(self.key, self.value, self.lease)])
        if won:
            self.is_leader, self.leader = True, self.me
            log.info("master %s leads the cluster (etcd lease %x)", self.me.id, self.lease)
            # NOTE: on its own thread: renewals go on while the pool is rebuilt
            threading.Thread(target=self.on_elected, name="takeover", daemon=True).start()
            return
        if leader != self.leader:
            log.info("master %s stands by; leader: %s", self.me.id, leader.id if leader else "none")
        self.leader = leader

    def _step_down(self, why: str) -> None:
        self.is_leader = False
        self._stop.set()
        log.critical("master %s steps down: %s", self.me.id, why)
        self.on_lost(why)

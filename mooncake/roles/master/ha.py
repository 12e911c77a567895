"""What makes a master survive: the pool's journal, and on etcd the election (docs/ha.md).

Without etcd one master runs as always; with `cluster.state_dir` set it journals the pool's
committed state to a file there, and a restart rebuilds the pool from it.

With `cluster.etcd` every master process starts as a standby: it serves the HTTP API by
forwarding to the leader (`ha/forward.py`) and does not listen on its control-plane port.
When it wins the election it takes over: it rebuilds the Store's metadata from the pool's
state in etcd (the Conductor's prefix index follows from the rebuilt objects' events),
listens on its control plane (nodes dial every master and so reach it; they register again
with it), and serves the API itself. A leader that loses its lease, or cannot journal a
change, exits at once (status 75) for its supervisor to restart it as a standby: two
masters must never serve the pool.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake.api.status import MasterStatus
from mooncake.config.settings import Config
from mooncake.errors import ConfigError
from mooncake.ha.election import Election, MasterInfo
from mooncake.ha.etcd import EtcdError
from mooncake.ha.etcdaccess import create_etcd
from mooncake.ha.forward import Forwarder, LeaderSwitch
from mooncake.ha.journal import EtcdJournal
from mooncake.ha.sealed import Sealer
from mooncake.store.metadata.journal import FileJournal, JournalError
from mooncake.store.server.service import StoreService

log = logging.getLogger(__name__)
EXIT_RESTART = 75  # EX_TEMPFAIL: restart me (as a standby)


def file_journal(config: Config) -> FileJournal | None:
    """The journal of a master without etcd: `<state_dir>/pool-<name>-<port>.journal`, or
    None when state_dir is unset or the port is 0 (a restart could not find it again)."""
    c = config.cluster
    port = c.master.rpartition(":")[2]
    if not c.state_dir or c.etcd or port == "0":
        return None
    return FileJournal(Path(c.state_dir).expanduser() / f"pool-{c.name}-{port}.journal")


def exit_to_restart(why: str) -> None:
    """End this process now (status 75): it must not serve the pool any more (it lost its
    leadership, or its journal failed); its supervisor starts it again."""
    log.critical("master exits: %s", why)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(EXIT_RESTART)


class MasterHa:
    """A master's part in the election; `take_control` starts serving the pool."""

    def __init__(self, config: Config, store: StoreService, take_control: Callable[[], None]):
        c = config.cluster
        if c.masters and c.master not in c.masters:
            raise ConfigError(
                f"cluster.masters ({', '.join(c.masters)}) does not list this master's own "
                f"cluster.master {c.master}: nodes would never reach it when it leads"
            )
        self.config, self.store, self.take_control = config, store, take_control
        self.etcd = create_etcd(c)
        self.sealer = Sealer(c.require_secret().encode())
        self.prefix = c.etcd_key_prefix
        self.forwarder = Forwarder(self.leader_url, c.etcd_timeout_s, c.election_poll_s)
        self.switch: LeaderSwitch | None = None
        self.election: Election | None = None

    def wrap(self, app: Any) -> LeaderSwitch:
        """The app to serve: forwarding while standing by, `app` once leading."""
        self.switch = LeaderSwitch(self.forwarder, app)
        return self.switch

    def leader_url(self) -> str | None:
        e = self.election
        leader = e.leader if e is not None else None
        if leader is None or (e is not None and leader.id == e.me.id):
            return None  # NOTE: ourselves, still taking over: 503, retry
        return leader.api

    def start(self, api_url: str) -> None:
        """Join the election (raises EtcdError when etcd does not answer)."""
        c = self.config.cluster
        node_id = self.config.node.id or f"{socket.gethostname()}-master-{os.getpid()}"
        me = MasterInfo(id=node_id, rpc=c.master, api=api_url, pid=os.getpid())
        self.election = Election(
            self.etcd,
            self.prefix,
            me,
            c.leader_ttl_s,
            c.election_poll_s,
            self._on_elected,
            exit_to_restart,
            self.sealer,
        )
        self.election.start()
        log.info(
            "master %s joined the election under %s on %s", me.id, self.prefix, ", ".join(c.etcd)
        )

    def _on_elected(self) -> None:
        e = self.election
        assert e is not None and self.switch is not None
        try:
            c = self.config.cluster
            self.store.journal = EtcdJournal(
                self.etcd,
                self.prefix,
                e.key,
                e.value,
                self.sealer,
                e.reclaim,
                window_s=c.etcd_commit_window_s,
                in_flight=c.etcd_commits_in_flight,
            )
            self.take_control()
        except (JournalError, EtcdError, OSError) as err:
            exit_to_restart(f"taking over failed: {err}")
        self.switch.lead()
        log.info("master %s serves the pool and the API", e.me.id)

    def masters(self) -> list[MasterStatus]:
        """Every master in the election, the leader marked (a blocking etcd read)."""
        e = self.election
        if e is None:
            return []
        try:
            members = e.members()
        except EtcdError as err:
            log.warning("status: masters from etcd: %s", err)
            members = [e.me]
        leader = e.me.id if e.is_leader else (e.leader.id if e.leader else "")
        return [
            MasterStatus(id=m.id, address=m.rpc, is_leader=m.id == leader, pid=m.pid, api=m.api)
            for m in members
        ]

    def stop(self) -> None:
        if self.election is not None:
            self.election.stop()
        self.etcd.close()

"""A pipeline leader's link to stage 1 of its group.

A leader of a group of 2+ holds a link to stage 1 (`NextStage.keep`, on its own thread).
When it breaks (stage 1 died, or stayed silent past `[prefill] stage_timeout_s` per chunk:
stopped, or its network dark), the leader reports "starting" at once, so the master stops
placing on the group, and only then reports the tasks in flight as failed before any KV
reached a decode node (the master may place them again). It asks the master where stage 1
listens now and dials it, backing off, until the restarted stage answers: then it is
ready again.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

from mooncake.errors import MooncakeError
from mooncake.roles.node.common import MasterLink, NodeContext
from mooncake.roles.node.messages import GroupMsg, GroupQueryMsg
from mooncake.roles.prefill.group.link import TcpStageLink
from mooncake.roles.prefill.group.pipeline import Answers

log = logging.getLogger(__name__)


class NextStage:
    """The leader's side of its group: the link to stage 1 and the answers coming up it."""

    def __init__(self, ctx: NodeContext, master: MasterLink, group: GroupMsg, later_layers: int):
        self.ctx, self.master, self.group, self.later_layers = ctx, master, group, later_layers
        self.link: TcpStageLink | None = None  # the link to stage 1, if up
        self.answers: Answers | None = None  # the answers coming up that link
        self.formed = threading.Event()  # set while it holds that link
        # NOTE: held while the master is told the group's state, so that a task reported
        # for re-placement reaches it after the leader left the schedulable set
        self._lock = threading.Lock()

    def keep(self) -> None:
        """Hold a link to stage 1. Without one the group takes no requests; the leader
        asks the master where stage 1 listens now and dials it, pausing from a tenth of
        [prefill] stage_retry_s up to it between attempts."""
        retry_s = self.ctx.config.prefill.stage_retry_s
        gid, pause_s = self.group.group_id, 0.0
        while not self.ctx.stop.is_set():
            link = self.link
            if link is not None:
                if link.ended.wait(retry_s):  # NOTE: a timeout only looks at `stop` again
                    log.warning("pipeline group %s: the link to stage 1 broke", gid)
                    self.lose(link)
                continue
            try:
                link = self._dial()
            except MooncakeError as e:
                log.info("pipeline group %s: stage 1 does not answer yet: %s", gid, e)
            if link is not None:
                self._hold(link)
                pause_s = 0.0
                continue
            pause_s = min(retry_s, max(retry_s / 10, 2 * pause_s))
            self.ctx.stop.wait(pause_s)

    def _dial(self) -> TcpStageLink | None:
        """A link to stage 1 where the master says it listens now (None: not known yet)."""
        group = self.master.client.call(GroupQueryMsg(self.ctx.node_id), GroupMsg)
        if not group.next_stage_address:
            return None
        host, _, port = group.next_stage_address.rpartition(":")
        timeout_s = self.ctx.config.transfer.handshake_timeout_s
        link = TcpStageLink.connect(host, int(port), self.ctx.secret, timeout_s)
        log.info("pipeline group %s: stage 1 at %s", group.group_id, group.next_stage_address)
        return link

    def _hold(self, link: TcpStageLink) -> None:
        with self._lock:
            self.link = link
            timeout_s = self.ctx.config.prefill.stage_timeout_s
            self.answers = Answers(link, self.later_layers, timeout_s)
            self.formed.set()
            self._tell_master("ready")

    def lose(self, link: TcpStageLink | None) -> None:
        """`link` broke: not ready until another is up. Returns once the master knows (for
        None, once a report under way is done), so that tasks reported after this call
        are placed elsewhere."""
        with self._lock:
            if link is None or self.link is not link:
                return  # already reported, or a new link is up
            self.link = None
            self.formed.clear()
            self._tell_master("starting")
        link.abort()

    def _tell_master(self, state: Literal["ready", "starting"]) -> None:
        if self.master.state in ("ready", "starting"):  # NOTE: never undoes draining or failed
            self.master.state = state
            self.master.beat()  # at once, not at the next heartbeat

    def close(self) -> None:
        if self.link is not None:  # NOTE: a stopped stage 1 must not hold up our exit
            self.link.close(self.ctx.config.prefill.stage_timeout_s)

"""The node's link to the master: heartbeat cadence around a lost master.

After a heartbeat the master did not answer, the next goes out `register_retry_s` later
rather than a whole heartbeat interval, so that a failover's new leader sees the node
as soon as it serves (the soak found nodes back 1.1-1.7 s after the new leader, past the
5 s the HA design allows when the election took 4 s); and after registering again with a
master that forgot it, the node's state goes at once: a registered node counts as starting
until the master hears it is ready."""

from __future__ import annotations

import threading

import pytest

from mooncake.config.load import load_config
from mooncake.errors import MooncakeError
from mooncake.hw.topology import Topology
from mooncake.roles.node.common import HEARTBEAT_S, MasterLink, NodeContext
from mooncake.roles.node.messages import (
    NodeHeartbeatMsg,
    NodeHeartbeatReplyMsg,
    NodeInfoMsg,
    RegisterMsg,
    RegisterReplyMsg,
)
from mooncake.rpc.server import Peer, RpcServer
from tests.store.cluster import SECRET

RETRY_S = 0.05
TOPOLOGY = Topology("node", 2, 1 << 30, 1 << 30, [], [], [], [], [], [], {}, [])


class Master:
    """A real RPC server answering the node link's messages from a script: heartbeats fail
    (the handler raises, the node gets an error reply) while `down` is set."""

    def __init__(self) -> None:
        self.server = RpcServer("tcp://127.0.0.1:0", SECRET.encode(), name="test-master")
        self.down = False
        self.known = True
        self.log: list[str] = []
        self.server.register(RegisterMsg, self._register)
        self.server.register(NodeHeartbeatMsg, self._heartbeat)
        self.server.start()

    def _register(self, msg: RegisterMsg, peer: Peer) -> RegisterReplyMsg:
        self.log.append("register")
        self.known = True
        return RegisterReplyMsg(is_accepted=True)

    def _heartbeat(self, msg: NodeHeartbeatMsg, peer: Peer) -> NodeHeartbeatReplyMsg:
        if self.down:
            self.log.append("lost")
            raise MooncakeError("the master is failing over")
        self.log.append("beat")
        return NodeHeartbeatReplyMsg(is_known=self.known)


class Script(threading.Event):
    """The link's halt event: records each pause the loop asks for, and plays the master's
    state for the next heartbeat instead of sleeping, then halts the loop."""

    def __init__(self, master: Master, states: list[str]) -> None:
        super().__init__()
        self.master, self.states, self.pauses = master, list(states), []

    def wait(self, timeout: float | None = None) -> bool:
        self.pauses.append(timeout)
        if not self.states:
            return True  # halt
        state = self.states.pop(0)
        self.master.down = state == "down"
        if state == "new-leader":  # the new leader does not know the node yet
            self.master.known = False
        return False


@pytest.fixture
def master() -> Master:
    m = Master()
    yield m
    m.server.stop()


def _link(master: Master) -> MasterLink:
    address = master.server.address.removeprefix("tcp://")
    values = {
        "cluster.master": address,
        "cluster.secret": SECRET,
        "cluster.register_retry_s": RETRY_S,
        "cluster.heartbeat_timeout_s": 5.0,
    }
    config = load_config(None, env={}, overrides=values).config
    ctx = NodeContext(config, "decode-0", "127.0.0.1", SECRET.encode(), TOPOLOGY)
    return MasterLink(
        ctx, NodeInfoMsg(node_id="decode-0", role="decode", rpc_address="127.0.0.1:1")
    )


def test_after_a_lost_heartbeat_the_link_retries_at_the_register_pause(master: Master) -> None:
    link = _link(master)
    link.register(timeout_s=5)
    script = Script(master, ["up", "down", "down", "down", "new-leader", "up"])
    link._halt = script
    link._loop()
    # after registering again, its state goes at once (it registered as starting)
    assert master.log == [
        "register",
        "beat",
        "lost",
        "lost",
        "lost",
        "beat",
        "register",
        "beat",
        "beat",
    ]
    # one pause before each heartbeat: whole intervals while answered, short after a loss
    assert script.pauses == [
        HEARTBEAT_S,
        HEARTBEAT_S,
        RETRY_S,
        RETRY_S,
        RETRY_S,
        HEARTBEAT_S,
        HEARTBEAT_S,
    ]
    link.client.close()


def test_the_retry_pause_never_exceeds_the_heartbeat_interval(master: Master) -> None:
    link = _link(master)
    link.cluster = load_config(
        None, env={}, overrides={"cluster.secret": SECRET, "cluster.register_retry_s": 3.0}
    ).config.cluster
    link.register(timeout_s=5)
    script = Script(master, ["down", "up"])
    link._halt = script
    link._loop()
    assert script.pauses == [HEARTBEAT_S, HEARTBEAT_S, HEARTBEAT_S]
    link.client.close()

"""The master's registry: pipeline groups, liveness, and a master restart under running
nodes (pure bookkeeping; time is passed in)."""

from __future__ import annotations

import msgspec
import pytest

from mooncake.roles.master.registry import Registry
from mooncake.roles.node.messages import NodeInfoMsg, NodeLoadMsg


def _prefill(node_id: str, group: str = "", stage: int = -1, addr: str = "") -> NodeInfoMsg:
    return NodeInfoMsg(
        node_id, "prefill", f"tcp://{node_id}:1", stage_address=addr, group_id=group, stage=stage
    )


def test_prefill_nodes_fill_groups_in_registration_order_with_layer_ranges() -> None:
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    for i, name in enumerate(["a", "b", "c"]):
        reg.register(_prefill(name), now=float(i))
    a, b, c = (reg.group_msg(n) for n in "abc")
    assert (a.group_id, a.stage, a.first_layer, a.end_layer) == ("pg1", 0, 0, 2)
    assert (b.group_id, b.stage, b.first_layer, b.end_layer) == ("pg1", 1, 2, 4)
    assert (c.group_id, c.stage, c.group_size) == ("pg2", 0, 2)
    assert a.next_stage_address == ""  # stage 1 has not told its address yet
    reg.register(_prefill("b", "pg1", 1, "b:7000"), now=3.0)
    assert reg.group_msg("a").next_stage_address == "b:7000"


def test_a_group_is_schedulable_only_when_every_stage_is_ready() -> None:
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(_prefill("a"), 0.0)
    reg.register(_prefill("b"), 0.0)
    reg.heartbeat("a", NodeLoadMsg(), "ready", 1.0)
    assert reg.schedulable_leaders() == set()
    reg.heartbeat("b", NodeLoadMsg(), "starting", 1.0)
    assert reg.schedulable_leaders() == set()
    reg.heartbeat("b", NodeLoadMsg(), "ready", 1.5)
    assert reg.schedulable_leaders() == {"a"}


def test_silent_nodes_go_down_and_their_group_stops_being_schedulable() -> None:
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    for n in "ab":
        reg.register(_prefill(n), 0.0)
        reg.heartbeat(n, NodeLoadMsg(), "ready", 1.0)
    reg.heartbeat("a", NodeLoadMsg(), "ready", 5.5)
    gone = reg.expire(6.5)
    assert [r.node_id for r in gone] == ["b"]
    assert reg.schedulable_leaders() == set()
    assert not reg.heartbeat("b", NodeLoadMsg(), "ready", 7.0)  # it must register again
    reg.register(_prefill("b", "pg1", 1), 7.0)
    assert reg.group_msg("b").stage == 1  # back in its place, layers unchanged
    reg.heartbeat("b", NodeLoadMsg(), "ready", 7.5)
    assert reg.schedulable_leaders() == {"a"}


def test_a_restarted_master_puts_nodes_back_in_the_groups_they_serve() -> None:
    """Nodes re-register in any order after a master restart; each keeps its loaded stage."""
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(_prefill("b", "pg1", 1), 0.0)  # stage 1 comes back first
    reg.register(_prefill("new"), 0.0)  # an unplaced node must not take pg1's stage 0
    reg.register(_prefill("a", "pg1", 0), 0.1)
    assert reg.group_msg("a").stage == 0 and reg.group_msg("b").stage == 1
    assert reg.group_msg("new").group_id == "pg2"


def test_a_stage_whose_node_never_came_back_goes_to_the_next_new_node() -> None:
    """A restarted master awaits pg1's stage 0 for ttl_s (its node may still register
    again); after that a new node takes it instead of waiting in a group of its own."""
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(_prefill("b", "pg1", 1), 10.0)
    reg.register(_prefill("early"), 14.0)
    assert reg.group_msg("early").group_id == "pg2"
    reg.register(_prefill("a"), 15.5)  # a restarted: no place of its own, pg1/0 awaited 5.5 s
    assert (reg.group_msg("a").group_id, reg.group_msg("a").stage) == ("pg1", 0)
    assert reg.groups["pg1"].members == ["a", "b"]


def test_automatic_groups_split_weights_over_half_of_device_memory() -> None:
    """group_size 0: 140 GB of weights on 80 GB GPUs -> 4 stages (35 GB each <= 40 GB)."""
    reg = Registry(num_layers=80, group_size=0, ttl_s=5, weight_bytes=140 * 10**9)
    info = NodeInfoMsg("a", "prefill", "tcp://a:1", device_memory_bytes=80 * 10**9)
    reg.register(info, 0.0)
    g = reg.group_msg("a")
    assert (g.group_size, g.first_layer, g.end_layer) == (4, 0, 20)
    small = Registry(num_layers=4, group_size=0, ttl_s=5, weight_bytes=10**6)
    small.register(NodeInfoMsg("b", "prefill", "tcp://b:1", device_memory_bytes=10**9), 0.0)
    assert small.group_msg("b").group_size == 1


def test_a_node_stopped_cleanly_takes_its_old_stage_when_it_comes_back() -> None:
    """Deregistered (SIGTERM) and started again under its id: stage 1 of its old group, not
    the leader of a new one; its leader learns the new address it listens on."""
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(_prefill("a"), 0.0)
    reg.register(_prefill("b", addr="b:7000"), 0.0)
    reg.remove("b")
    assert reg.group_msg("a").next_stage_address == ""  # no stage 1 to dial meanwhile
    reg.register(_prefill("b"), 1.0)  # a fresh process: it knows no group yet
    got = reg.group_msg("b")
    assert (got.group_id, got.stage, got.first_layer, got.end_layer) == ("pg1", 1, 2, 4)
    reg.register(_prefill("b", "pg1", 1, "b:7001"), 2.0)  # listening, after loading
    assert reg.group_msg("a").next_stage_address == "b:7001"


def test_a_group_missing_a_stage_names_that_stage_not_its_waiting_leader() -> None:
    """A stopped (or silent) stage 1 is what pg1 waits for, though its leader, having lost
    its link to stage 1, reports itself starting."""
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(_prefill("a"), 0.0)
    reg.register(_prefill("b"), 0.0)
    reg.heartbeat("a", NodeLoadMsg(), "starting", 0.5)
    assert "pg1 waits for stage 0 (a, starting)" in reg.missing()  # b too is starting: a first
    reg.heartbeat("b", NodeLoadMsg(), "ready", 1.0)
    reg.remove("b")  # a clean stop
    reg.heartbeat("a", NodeLoadMsg(), "starting", 1.5)  # it dials b again
    assert "pg1 waits for stage 1 (b, stopped)" in reg.missing()
    reg.register(_prefill("b"), 2.0)
    reg.heartbeat("a", NodeLoadMsg(), "starting", 7.0)
    assert reg.expire(7.5) == [reg.nodes["b"]]  # killed: silent past ttl_s
    assert "pg1 waits for stage 1 (b, down)" in reg.missing()
    reg2 = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg2.register(_prefill("a"), 0.0)
    reg2.heartbeat("a", NodeLoadMsg(), "starting", 0.5)
    assert "pg1 waits for stage 1 to register" in reg2.missing()


def test_kv_capacity_is_the_largest_ready_node_or_group() -> None:
    """A group holds what its smallest stage holds; the API's limit is the largest ready
    group or decode node; a node that did not say (an older one) leaves it unknown."""
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    for name, cap in [("a", 900), ("b", 600), ("c", 800), ("d", 700)]:
        reg.register(NodeInfoMsg(name, "prefill", f"tcp://{name}:1", kv_capacity_tokens=cap), 0.0)
    for name, cap in [("x", 5000), ("y", 9000)]:
        reg.register(NodeInfoMsg(name, "decode", f"tcp://{name}:1", kv_capacity_tokens=cap), 0.0)
    assert reg.kv_capacity_tokens("prefill") is None and reg.kv_capacity_tokens("decode") is None
    for name in "abcdxy":
        reg.heartbeat(name, NodeLoadMsg(), "ready", 1.0)
    assert reg.kv_capacity_tokens("prefill") == 700  # pg1 = min(900, 600), pg2 = min(800, 700)
    assert reg.kv_capacity_tokens("decode") == 9000
    reg.heartbeat("y", NodeLoadMsg(), "draining", 2.0)
    assert reg.kv_capacity_tokens("decode") == 5000  # only ready nodes count
    reg.register(NodeInfoMsg("z", "decode", "tcp://z:1"), 2.0)
    reg.heartbeat("z", NodeLoadMsg(), "ready", 2.0)
    assert reg.kv_capacity_tokens("decode") is None


def test_kv_capacity_on_the_wire_defaults_to_unknown_and_is_never_negative() -> None:
    """An older node's registration (no kv_capacity_tokens) decodes as 0, not told; a
    negative one is refused by the decoder."""
    info = {"type": "node.info", "node_id": "n", "role": "decode", "rpc_address": ""}
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=NodeInfoMsg)
    assert old.kv_capacity_tokens == 0
    bad = msgspec.msgpack.encode({**info, "kv_capacity_tokens": -1})
    with pytest.raises(msgspec.ValidationError, match="kv_capacity_tokens"):
        msgspec.msgpack.decode(bad, type=NodeInfoMsg)

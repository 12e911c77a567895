"""A store node silent for longer than heartbeat_ttl_s (here: stopped with SIGSTOP) is
dropped by the master; once it runs again it mounts its segments again by itself, so the
pool's capacity comes back to what it was (the objects that were in them are gone).

After a real link outage the node's heartbeats queued during it reach the master at once
when the link returns: the first re-registers the node, and its reply (is_known False)
arrives after the node's call timed out, so the node drops it. The test sends that
heartbeat itself while the node is stopped."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from mooncake.rpc.client import RpcClient
from mooncake.store.metadata.objects import StoreStats
from mooncake.store.server.messages import HeartbeatMsg, HeartbeatReplyMsg, StatsMsg, StatsReplyMsg
from tests.store.cluster import SECRET, start_master, start_node

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]
MIB = 1 << 20
TTL_S = 1.0  # the test master's heartbeat_ttl_s (tests/store/procs.py)


def _stats(client: RpcClient) -> StoreStats:
    return client.call(StatsMsg(), StatsReplyMsg).stats


def _wait_for(
    client: RpcClient, pred: Callable[[StoreStats], bool], deadline_s: float
) -> StoreStats:
    """The master's stats once `pred` holds of them, or as they are at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        stats = _stats(client)
        if pred(stats) or time.monotonic() > end:
            return stats
        time.sleep(0.05)


@pytest.mark.parametrize("lost_reply", [False, True])
def test_node_back_after_expiry_mounts_its_segments_again(lost_reply: bool) -> None:
    master = start_master()
    nodes = [start_node("stay", master, 4 * MIB), start_node("rejoin", master, 2 * MIB)]
    client = RpcClient(master.address, SECRET.encode(), timeout_s=5.0)
    try:
        before = _stats(client)
        assert before.num_segments == 2
        dram = before.tier_capacity_bytes["dram"]
        assert before.node_capacity_bytes["rejoin"] == {"dram": 2 * MIB}
        os.kill(nodes[1].proc.pid, signal.SIGSTOP)
        try:
            gone = _wait_for(client, lambda s: s.num_segments == 1, 5 * TTL_S)
            assert gone.num_segments == 1, "the master never expired the stopped node"
            assert gone.tier_capacity_bytes["dram"] == dram - 2 * MIB
            time.sleep(TTL_S)  # NOTE: well past the TTL, as after a long outage
            if lost_reply:  # the queued heartbeat, answered to no one
                client.call(HeartbeatMsg("rejoin"), HeartbeatReplyMsg)
        finally:
            os.kill(nodes[1].proc.pid, signal.SIGCONT)
        back = _wait_for(client, lambda s: s.tier_capacity_bytes["dram"] == dram, 5 * TTL_S)
        assert back.tier_capacity_bytes["dram"] == dram, "the node's segment was not re-mounted"
        assert back.num_segments == 2 and back.node_capacity_bytes["rejoin"] == {"dram": 2 * MIB}
    finally:
        client.close()
        for c in [*nodes, master]:
            c.stop()

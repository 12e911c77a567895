"""`[node] port_range`: every port a node listens on lies in the range (firewall rules)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil
import pytest

from mooncake.config.portrange import PortRange
from mooncake.errors import MooncakeError
from mooncake.roles.prefill.group.listener import StageListener
from mooncake.rpc import Msg, RpcClient, RpcServer
from tests.roles.cluster import local_cluster

pytestmark = pytest.mark.timeout(180)


def free_block(size: int) -> PortRange:
    """`size` free ports on 127.0.0.1 below Linux's ephemeral range (32768+), so no client
    socket of this host takes one of them while a test runs."""
    for low in range(21000, 32000, 500):
        with ExitStack() as held:
            try:
                for port in range(low, low + size):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return PortRange(low, low + size - 1)
    pytest.skip("no block of free ports below 32000")


def _listening_ports(pid: int) -> set[int]:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return {
        c.laddr.port
        for p in procs
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.cluster
def test_every_listener_of_every_node_binds_in_the_range(tmp_path: Path, cost_cache: Path):
    """Two prefill nodes (one pipeline group: stage 1 has a stage listener), a decode node
    and a store node, each giving DRAM to the pool; the master's direct channel and its KV
    event sockets (PUB and replay) too (its control plane and API keep their configured
    ports)."""
    rng = free_block(40)  # the five processes need about a dozen
    extra = {"node.port_range": f"{rng.low}-{rng.high}"}
    with local_cluster(tmp_path, cost_cache, extra=extra) as cluster:  # all ready
        seen = {c.node_id: _listening_ports(c.proc.pid) for c in cluster.children}
        master = next(c.node_id for c in cluster.children if c.role == "master")
        api_port = int(cluster.url.rpartition(":")[2])
    fixed = seen.pop(master)
    direct = {p for p in fixed if rng.low <= p <= rng.high}
    assert len(direct) == 3 and api_port in fixed - direct and len(fixed) == 5, (fixed, rng)
    assert set(seen) == {"prefill-0", "prefill-1", "decode-0", "store-0"}, seen
    for node_id, ports in seen.items():
        outside = {p for p in ports if not rng.low <= p <= rng.high}
        assert not outside, f"{node_id} listens outside {rng}: {sorted(outside)}"
        # RPC server (not a store node) and the pool's data plane, at least
        assert len(ports) >= (1 if node_id.startswith("store") else 2), (node_id, ports)
    # the stage-1 prefill node also listens for its stage 0: three listeners
    assert max(len(p) for n, p in seen.items() if n.startswith("prefill")) >= 3, seen
    # each process takes the lowest free ports, in order: the range can be sized tightly
    every = sorted(set().union(direct, *seen.values()))
    assert every == list(range(rng.low, rng.low + len(every))), every


@contextmanager
def _held(rng: PortRange) -> Iterator[None]:
    """Every port of `rng` on 127.0.0.1 taken by a listener of this process."""
    with ExitStack() as held:
        for port in rng.ports():
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", port))
            s.listen()
        yield


@pytest.mark.cluster
def test_a_cluster_whose_range_is_taken_fails_naming_the_key(
    tmp_path: Path, cost_cache: Path, capfd: pytest.CaptureFixture[str]
):
    low = free_block(2).low
    rng = PortRange(low, low + 1)
    extra = {"node.port_range": f"{low}-{low + 1}", "store.dram_bytes": "16MiB"}
    with (
        _held(rng),
        pytest.raises(MooncakeError),  # the master and the store node fail to start
        local_cluster(tmp_path, cost_cache, num_prefill=0, num_decode=0, extra=extra),
    ):
        pass
    err = capfd.readouterr().err  # the node's own error, on its stderr
    assert f"node.port_range: every port in {low}-{low + 1} is in use" in err, err[-2000:]


SECRET = b"port-range-test-secret-0123"


class _EchoMsg(Msg, frozen=True, tag="test.port_range_echo"):
    text: str


def test_rpc_server_and_stage_listener_take_the_lowest_free_ports_in_order() -> None:
    rng = free_block(3)
    rpc = RpcServer("tcp://127.0.0.1:0", SECRET, ports=rng)
    rpc.register(_EchoMsg, lambda msg, peer: msg)
    with _held(PortRange(rng.low, rng.low)):  # someone else holds the first port
        rpc.start()
        listener = StageListener(SECRET, "127.0.0.1", rng)
    try:
        assert rpc.address == f"tcp://127.0.0.1:{rng.low + 1}"
        assert listener.port == rng.low + 2
        with RpcClient(rpc.address, SECRET, timeout_s=5.0) as client:  # it serves there
            assert client.call(_EchoMsg("hi"), _EchoMsg).text == "hi"
    finally:
        listener.close()
        rpc.stop()


def test_rpc_server_and_stage_listener_fail_naming_the_key_when_the_range_is_taken() -> None:
    rng = free_block(2)
    with _held(rng):
        rpc = RpcServer("tcp://127.0.0.1:0", SECRET, name="decode", ports=rng)
        taken = f"node.port_range: every port in {rng} is in use on 127.0.0.1"
        with pytest.raises(MooncakeError, match=taken):
            rpc.start()
        with pytest.raises(MooncakeError, match=taken):
            StageListener(SECRET, "127.0.0.1", rng)


def test_without_a_range_a_fixed_rpc_address_is_bound_as_given() -> None:
    port = free_block(1).low
    rpc = RpcServer(f"tcp://127.0.0.1:{port}", SECRET, ports=PortRange(1, 1))
    rpc.start()
    try:
        assert rpc.address == f"tcp://127.0.0.1:{port}"
    finally:
        rpc.stop()

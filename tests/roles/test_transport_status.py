"""What an operator sees of the data plane and of an unplaceable request: the transport
each peer is reached by (logged with its reason) and the bytes each node moved per
transport in `/v1/status`; store nodes' data-plane addresses; addresses as host:port;
and a 503 that names the role that is missing."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from mooncake.api.status import decode_status
from mooncake.conductor.conductor import create_conductor
from mooncake.config.settings import Config
from mooncake.model.info import load_model_info
from mooncake.model.tokenizer import create_tokenizer
from mooncake.roles.master.cluster import ClusterBackend, NoInstance
from mooncake.roles.master.registry import Registry
from mooncake.roles.node.messages import NodeInfoMsg, NodeLoadMsg
from mooncake.transfer import EngineOptions, TransferEngine, TransferOp, TransferRequest
from tests.roles.cluster import local_cluster


@pytest.mark.parametrize("protocol", ["auto", "tcp"])
def test_the_engine_logs_each_peers_transport_once_and_counts_its_bytes(
    protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret, options = b"k" * 32, EngineOptions(protocol=protocol)  # type: ignore[arg-type]
    with (
        TransferEngine("target", secret) as target,
        TransferEngine("initiator", secret, options) as initiator,
    ):
        target.allocate("pool", 1 << 20)
        initiator.allocate("buf", 1 << 20)
        initiator.directory.add_peer("127.0.0.1", target.server.port)  # type: ignore[attr-defined]
        caplog.set_level("INFO", logger="mooncake.transfer.transport")
        for length in (4096, 1 << 20):  # one moved on the caller's thread, one in slices
            req = TransferRequest(TransferOp.WRITE, "buf", 0, "pool", 0, length)
            initiator.transfer([req]).check()
        initiator.forget("pool")  # resolved again: the same peer is not logged again
        initiator.move(TransferRequest(TransferOp.READ, "buf", 0, "pool", 0, 4096))
        finish = initiator.start(TransferRequest(TransferOp.READ, "buf", 0, "pool", 0, 4096))
        assert finish is not None and finish()
    chosen = "shm" if protocol == "auto" else "tcp"
    assert initiator.bytes_by_transport() == {chosen: 4096 + (1 << 20) + 2 * 4096}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    peer = f"peer 127.0.0.1:{target.server.port} (target): {chosen}: "
    why = {
        "shm": "same host and /dev/shm: its segment /dev/shm/",
        "tcp": "transfer.protocol = 'tcp'",
    }[chosen]
    assert lines[0].startswith(peer + why), lines


def _backend(registry: Registry) -> ClusterBackend:
    cfg, info = Config(), load_model_info("dummy:tiny")
    return ClusterBackend(
        create_conductor(cfg, info),
        registry,
        create_tokenizer("dummy:tiny"),
        "dummy:tiny",
        1024,
        b"s" * 32,
        32,
        threading.Lock(),
    )


def test_no_instance_names_the_missing_role() -> None:
    reg = Registry(num_layers=4, group_size=2, ttl_s=5)
    reg.register(NodeInfoMsg("decode-0", "decode", "tcp://d:1"), 0.0)
    reg.heartbeat("decode-0", NodeLoadMsg(), "ready", 0.5)
    backend = _backend(reg)
    with pytest.raises(NoInstance) as e:
        asyncio.run(backend._place(1, 64, []))
    assert str(e.value) == "no prefill group is ready (0 prefill nodes registered); retry shortly"

    # one stage of a two-stage group: it says which stage the group waits for
    reg.register(NodeInfoMsg("prefill-0", "prefill", "tcp://p:1"), 1.0)
    reg.heartbeat("prefill-0", NodeLoadMsg(), "ready", 1.5)
    with pytest.raises(NoInstance, match=r"1 prefill node registered; pg1 waits for stage 1 "):
        asyncio.run(backend._place(2, 64, []))
    reg.register(NodeInfoMsg("prefill-1", "prefill", "tcp://p:2"), 2.0)
    with pytest.raises(NoInstance, match=r"pg1 waits for stage 1 \(prefill-1, starting\)\);"):
        asyncio.run(backend._place(3, 64, []))

    # a ready group and no decode node: it names the decode role only
    reg.heartbeat("prefill-1", NodeLoadMsg(), "ready", 2.5)
    reg.remove("decode-0")
    with pytest.raises(NoInstance) as e:
        asyncio.run(backend._place(4, 64, []))
    assert str(e.value) == "no decode node is ready (0 registered); retry shortly"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_local_cluster_moves_kv_over_shm_and_status_says_so(
    tmp_path: Path,
    cost_cache: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MOONCAKE_LOG_LEVEL", "info")  # the nodes inherit it
    with local_cluster(tmp_path, cost_cache) as cluster:
        prompt = [(i * 7 + 5) % 250 + 1 for i in range(300)]
        body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while True:  # NOTE: the counters reach the master with the next heartbeat
            status = decode_status(httpx.get(cluster.url + "/v1/status", timeout=10).content)
            moved = {n.node_id: n.transfer_bytes for n in status.nodes}
            engines = [n for n in status.nodes if n.role in ("prefill", "decode")]
            # NOTE: the last prefill stage writes the KV (to the decode node and the pool)
            if any(n.transfer_bytes.get("shm", 0) > 0 for n in engines if n.role == "prefill"):
                break
            assert time.monotonic() < deadline, moved
            time.sleep(0.2)
        # one host, one /dev/shm: KV between nodes never took the network
        for n in engines:
            assert n.transfer_bytes.get("tcp", 0) == 0, moved
            assert n.transfer_bytes.get("rdma", 0) == 0, moved
        for n in status.nodes:  # every address host:port, store nodes' too (data plane)
            assert n.address and "://" not in n.address, n
            host, _, port = n.address.rpartition(":")
            assert host and port.isdigit(), n
    err = capfd.readouterr().err
    logged = [ln for ln in err.splitlines() if "mooncake.transfer.transport: peer " in ln]
    assert logged and all(": shm: same host and /dev/shm: its segment" in ln for ln in logged)

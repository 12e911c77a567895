"""The HTTP metadata server (upstream's protocol, mooncake-wheel/mooncake/http_metadata_server.py)
and engines that find each other through it by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from mooncake.engine import TransferEngine
from mooncake.engine.httpmeta import MetadataServer
from tests.engine.peer import Peer, pattern


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    s = MetadataServer(0, "127.0.0.1").start()
    yield s
    s.close()


def test_get_put_delete_follow_upstreams_protocol(server):
    """GET/PUT/DELETE of /metadata?key=K: 200 with the value, 404 when absent, 400 for a
    missing or blank key and for a second PUT of an rpc_meta key; keys are stripped."""
    url = server.url
    with httpx.Client() as http:
        for method in ("GET", "PUT", "DELETE"):
            assert http.request(method, url).status_code == 400
            assert http.request(method, url, params={"key": "  "}).status_code == 400
        assert http.get(url, params={"key": "a"}).status_code == 404
        assert http.put(url, params={"key": " a "}, content=b'{"x": 1}').status_code == 200
        r = http.get(url, params={"key": "a"})
        assert (r.status_code, r.content) == (200, b'{"x": 1}')
        assert r.headers["content-type"] == "application/json"
        assert http.put(url, params={"key": "a"}, content=b"2").status_code == 200  # overwrite
        assert http.get(url, params={"key": "a"}).content == b"2"
        key = {"key": "mooncake/rpc_meta/n"}
        assert http.put(url, params=key, content=b"1").status_code == 200
        assert http.put(url, params=key, content=b"2").status_code == 400
        assert http.delete(url, params={"key": "a"}).status_code == 200
        assert http.delete(url, params={"key": "a"}).status_code == 404
        assert http.get(url.replace("/metadata", "/other"), params={"key": "n"}).status_code == 404
    assert server.store == {"mooncake/rpc_meta/n": b"1"}


@pytest.mark.cluster
def test_console_script_serves_until_sigterm():
    """`mooncake_http_metadata_server --port 0 --host 127.0.0.1` (its main) says where it
    listens, serves, and exits 0 on SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake.engine.httpmeta", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        port = int(line.rsplit(":", 1)[1])
        url = f"http://127.0.0.1:{port}/metadata"
        assert httpx.put(url, params={"key": "k"}, content=b"v").status_code == 200
        assert httpx.get(url, params={"key": "k"}).content == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.cluster
def test_engines_find_each_other_by_name(server, secret_env):
    """With http:// metadata an engine publishes its name (upstream's rpc_meta entry) and
    peers transfer to it by that name; an unknown name is -1, a name held by a live engine
    is refused (-200), and close() withdraws the entry."""
    peer = Peer.start(secret_env, 64 * 1024, metadata=server.url, name="node-b")
    te = TransferEngine()
    try:
        assert te.initialize("node-a", server.url, "tcp", "") == 0
        assert set(server.store) == {"mooncake/rpc_meta/node-a", "mooncake/rpc_meta/node-b"}
        src = pattern(4096, 9)
        assert te.register_memory(src.ctypes.data, src.nbytes) == 0
        assert te.transfer_sync_write("node-b", src.ctypes.data, peer.address + 4096, 4096) == 0
        remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
        assert np.array_equal(remote[4096:8192], src)
        assert te.get_first_buffer_address("node-b") == peer.address
        assert te.transfer_sync_write("node-c", src.ctypes.data, peer.address, 4096) == -1
        twin = TransferEngine()
        assert twin.initialize("node-b", server.url, "tcp", "") == -200
        assert twin.get_rpc_port() == -1
    finally:
        te.close()
        peer.stop()
    assert server.store == {}


@pytest.mark.cluster
def test_a_target_named_ip_port_is_reached_by_that_name(server, secret_env):
    """upstream's transfer_engine_target.py and its initiator (mooncake-wheel/tests): with
    http:// metadata, "IP:PORT" is a name (the engine listens elsewhere unless
    MC_LEGACY_RPC_PORT_BINDING); a target with no buffer answers 0 for its own first
    address, allocates a managed one, and the initiator finds that buffer and probes the
    target by the name."""
    target, initiator = TransferEngine(), TransferEngine()
    try:
        assert target.initialize("127.0.0.1:1", server.url, "tcp", "") == 0
        assert target.get_rpc_port() != 1
        assert target.get_first_buffer_address("127.0.0.1:1") == 0
        buffer = target.allocate_managed_buffer(1 << 20)
        assert buffer != 0
        assert initiator.initialize("127.0.0.1:2", server.url, "tcp", "") == 0
        assert initiator.send_probe("127.0.0.1:1") == 0
        assert initiator.get_first_buffer_address("127.0.0.1:1") == buffer
        src = initiator.allocate_managed_buffer(4096)
        assert initiator.write_bytes_to_buffer(src, b"hello", 5) == 0
        assert initiator.transfer_sync_write("127.0.0.1:1", src, buffer, 5) == 0
        assert target.read_bytes_from_buffer(buffer, 5) == b"hello"
    finally:
        initiator.close()
        target.close()


def test_unreachable_metadata_server_is_a_metadata_error(secret_env):
    """initialize with an http:// metadata server nobody answers returns ERR_METADATA
    (-200) and leaves nothing listening."""
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "") == -200
    assert te.get_rpc_port() == -1

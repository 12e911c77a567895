"""The etcd client's own HTTP/1.1 against a real HTTP server on loopback: replies with a
length, chunked, or closing the connection; a connection the server dropped while idle is
replaced without failing the call; bad replies and bad URLs get clear errors."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mooncake.ha.etcd import Etcd, EtcdError


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        how = self.server.how
        if how == "not json":
            self.send_response(404)
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"not found")
            return
        value = base64.b64encode(b"v" * 3000).decode()
        reply = json.dumps({"kvs": [{"key": body["key"], "value": value, "lease": "7"}]}).encode()
        self.send_response(200)
        if how == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(reply), 1000):
                part = reply[i : i + 1000]
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(reply)))
        if how == "close":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(reply)
        if how in ("close", "drop when idle"):
            self.close_connection = True  # "drop when idle": without saying so


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    how = "length"
    requests: list[tuple[str, dict[str, str]]]


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.requests = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _etcd(srv: _Server) -> Etcd:
    return Etcd([f"http://127.0.0.1:{srv.server_address[1]}"], timeout_s=5.0)


@pytest.mark.parametrize("how", ["length", "chunked"])
def test_replies_with_a_length_or_chunked_reuse_one_connection(server: _Server, how: str):
    server.how = how
    etcd = _etcd(server)
    for _ in range(3):
        kv = etcd.get("some/key")
        assert kv is not None and kv.key == "some/key" and kv.value == b"v" * 3000
        assert kv.lease == 7
    assert server.connections == 1
    assert server.requests[0] == ("/v3/kv/range", {"key": base64.b64encode(b"some/key").decode()})
    etcd.close()


@pytest.mark.parametrize("how", ["close", "drop when idle"])
def test_a_connection_the_server_closes_is_replaced_and_no_call_fails(server: _Server, how: str):
    server.how = how
    etcd = _etcd(server)
    for i in range(3):
        assert etcd.get(f"k{i}") is not None
        time.sleep(0.05)  # NOTE: lets the server's close arrive (the case under test)
    assert server.connections == 3 and len(server.requests) == 3  # each sent once
    etcd.close()


def test_a_reply_that_is_not_json_is_an_error_naming_the_endpoint(server: _Server):
    server.how = "not json"
    etcd = _etcd(server)
    with pytest.raises(EtcdError, match=r"etcd http://127\.0\.0\.1:\d+/v3/kv/range: not found"):
        etcd.get("k")
    etcd.close()


def test_an_endpoint_that_does_not_answer_is_named_and_the_next_one_used(server: _Server):
    etcd = Etcd(["http://127.0.0.1:1", f"http://127.0.0.1:{server.server_address[1]}"], 5.0)
    assert etcd.get("k") is not None
    dead = Etcd(["http://127.0.0.1:1"], timeout_s=1.0)
    with pytest.raises(EtcdError, match=r"no etcd endpoint answered \(http://127\.0\.0\.1:1: "):
        dead.get("k")


@pytest.mark.parametrize("url", ["127.0.0.1:2379", "ftp://h:1", "http://h:port", "http://:1"])
def test_an_endpoint_that_is_not_an_http_url_is_refused(url: str):
    with pytest.raises(EtcdError, match="expected a client URL http://host:port"):
        Etcd([url], timeout_s=1.0)

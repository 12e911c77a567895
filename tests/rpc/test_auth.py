"""Cluster-secret authentication: derived keys, and peers without the secret can call nothing."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import zmq

from mooncake.errors import AuthError, ConfigError, RpcError
from mooncake.rpc import RpcClient, derive_keypair

from .conftest import SECRET, EchoMsg, Served, raw_dealer, raw_exchange, request_frame, start_server

_PRINT_KEYS = (
    "import sys; from mooncake.rpc import derive_keypair; s = sys.argv[1].encode(); "
    "print(*[k.decode() for r in ('server', 'client') "
    "for k in (derive_keypair(s, r).public, derive_keypair(s, r).secret)])"
)


@pytest.mark.cluster
def test_keys_from_the_same_secret_are_identical_across_processes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PRINT_KEYS, SECRET.decode()],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    here = [
        k.decode()
        for role in ("server", "client")
        for k in (derive_keypair(SECRET, role).public, derive_keypair(SECRET, role).secret)
    ]
    assert out == here


def test_keys_differ_by_role_and_by_secret() -> None:
    keys = {
        derive_keypair(SECRET, "server").public,
        derive_keypair(SECRET, "client").public,
        derive_keypair(SECRET + b"x", "server").public,
        derive_keypair(SECRET + b"x", "client").public,
    }
    assert len(keys) == 4
    assert all(len(k) == 40 for k in keys)  # Z85 form of 32 bytes


def test_a_short_secret_is_a_config_error_that_says_how_to_make_one() -> None:
    with pytest.raises(ConfigError, match="openssl rand"):
        RpcClient("tcp://127.0.0.1:1", b"short")


def test_a_client_with_the_wrong_secret_gets_auth_error_and_no_handler_runs(
    served: Served,
) -> None:
    with RpcClient(served.address, b"another-cluster-secret-xyz", timeout_s=5.0) as bad:
        with pytest.raises(AuthError, match="cluster secret"):
            bad.call(EchoMsg("let me in"), EchoMsg)
        with pytest.raises(AuthError):
            bad.send_event(EchoMsg("let me in"))
    assert served.calls == []


@pytest.mark.parametrize("keys", ["none", "foreign"])
def test_a_peer_without_the_cluster_key_gets_no_reply_and_no_handler_runs(
    served: Served, zctx: zmq.Context[Any], keys: str
) -> None:
    """No CURVE at all, or CURVE with the server key but its own client key (ZAP refuses)."""
    sock = raw_dealer(zctx, served.address, keys)
    assert raw_exchange(sock, request_frame(EchoMsg("let me in")), wait_ms=500) is None
    assert served.calls == []
    good = RpcClient(served.address, SECRET)
    assert good.call(EchoMsg("member"), EchoMsg).text == "member"
    good.close()


def test_a_curve_client_cannot_talk_to_a_server_without_auth() -> None:
    plain = start_server(secret=None)
    try:
        with RpcClient(plain.address, SECRET, timeout_s=2.0) as c, pytest.raises(RpcError):
            c.call(EchoMsg("x"), EchoMsg)
        assert plain.calls == []
    finally:
        plain.server.stop()

"""Where an engine of upstream's API gets the cluster secret, and what it does without one:
refuse to initialize, naming the ways to give one; or, when opted in, use a secret made for
this user on this host (a 0600 file)."""

from __future__ import annotations

import logging
import stat

import numpy as np
import pytest

from mooncake.engine import TransferEngine
from mooncake.engine.secret import engine_secret, local_secret_path

SECRET_VARS = ("MOONCAKE_CLUSTER_SECRET", "MOONCAKE_CLUSTER_SECRET_FILE", "MOONCAKE_CONFIG")


@pytest.fixture
def no_secret(monkeypatch, tmp_path):
    for var in (*SECRET_VARS, "MOONCAKE_LOCAL_SECRET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


def test_without_a_secret_initialize_refuses_and_says_how(no_secret, caplog):
    """No secret anywhere: initialize returns a negative code and the log names
    MOONCAKE_CLUSTER_SECRET and the local opt-in; nothing listens."""
    te = TransferEngine()
    with caplog.at_level(logging.ERROR):
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0
    assert "MOONCAKE_CLUSTER_SECRET" in caplog.text and "MOONCAKE_LOCAL_SECRET=1" in caplog.text
    assert te.get_rpc_port() == -1


def test_a_short_secret_is_refused(no_secret, monkeypatch, caplog):
    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", "short")
    with caplog.at_level(logging.ERROR):
        assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0
    assert "16" in caplog.text


def test_secret_from_a_config_file(no_secret, monkeypatch, tmp_path):
    """cluster.secret_file of the file named by MOONCAKE_CONFIG is used."""
    (tmp_path / "secret").write_text("from-a-file-0123456789\n")
    config = tmp_path / "mooncake.toml"
    config.write_text(f'[cluster]\nsecret_file = "{tmp_path / "secret"}"\n')
    monkeypatch.setenv("MOONCAKE_CONFIG", str(config))
    assert engine_secret() == b"from-a-file-0123456789"


def test_local_opt_in_makes_one_private_secret_shared_by_engines(no_secret, monkeypatch):
    """MOONCAKE_LOCAL_SECRET=1: a 0600 file is made once and every engine of this user on
    this host uses it, so two of them transfer; a file others can read is refused."""
    monkeypatch.setenv("MOONCAKE_LOCAL_SECRET", "1")
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        path = local_secret_path()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert engine_secret() == path.read_text().encode()
        src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
        assert a.register_memory(src.ctypes.data, 256) == 0
        assert b.register_memory(dst.ctypes.data, 256) == 0
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        assert a.transfer_sync_write(peer, src.ctypes.data, dst.ctypes.data, 256) == 0
        assert np.array_equal(src, dst)
    finally:
        a.close()
        b.close()
    path.chmod(0o644)
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0

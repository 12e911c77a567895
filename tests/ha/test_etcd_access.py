"""Who may write etcd: the local etcd's auth, the client's login and token renewal, TLS with
a client certificate, the settings' checks, and a clear error for an unusable etcd binary
(mooncake/ha/etcd.py, etcdaccess.py, localetcd.py), all on a real etcd."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.config.load import load_config
from mooncake.config.settings import ClusterConfig
from mooncake.errors import ConfigError
from mooncake.ha.etcd import Etcd, EtcdAccess, EtcdError
from mooncake.ha.etcdaccess import create_etcd
from mooncake.ha.localetcd import (
    ETCD_ENV,
    TMPFS,
    TMPFS_PREFIX,
    LocalEtcd,
    etcd_binary,
    tmpfs_data_dir,
)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.cluster
def test_the_local_etcd_refuses_a_put_without_credentials(local_etcd: LocalEtcd, etcd: Etcd):
    body = {"key": _b64("/mooncake/local/leader"), "value": _b64("forged")}
    r = httpx.post(local_etcd.url + "/v3/kv/put", json=body, timeout=5)
    assert r.status_code != 200 and "user name is empty" in r.text
    assert etcd.get("/mooncake/local/leader") is None
    etcd.put("k", b"v")  # its root, with the password, may
    assert etcd.get("k") is not None
    anonymous = Etcd([local_etcd.url], timeout_s=2.0)
    with pytest.raises(EtcdError, match="requires authentication: set cluster.etcd_user"):
        anonymous.get("k")
    wrong = Etcd([local_etcd.url], timeout_s=2.0, access=EtcdAccess("root", "wrong"))
    with pytest.raises(EtcdError, match="check cluster.etcd_user and its password"):
        wrong.get("k")


@pytest.mark.cluster
def test_a_client_takes_a_new_token_when_etcd_lets_the_old_one_expire(tmp_path: Path):
    if etcd_binary() is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd", token_ttl_s=1)
    server.start()
    try:
        etcd = Etcd([server.url], timeout_s=2.0, access=server.access)
        etcd.put("k", b"1")
        first = etcd._token
        time.sleep(3.0)  # NOTE: etcd drops a simple token unused for --auth-token-ttl
        etcd.put("k", b"2")
        assert etcd.get("k") is not None and etcd.get("k").value == b"2"  # type: ignore[union-attr]
        assert etcd._token and etcd._token != first
    finally:
        server.stop()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    for name, ext in (
        # NOTE: etcd's JSON gateway dials etcd itself with the server certificate
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "req",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[str]:
    """An etcd that speaks https only and wants a client certificate signed by the test CA."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the test certificates")
    _certificates(tmp_path)
    url, peer = f"https://127.0.0.1:{_port()}", f"http://127.0.0.1:{_port()}"
    cmd = [
        binary,
        "--data-dir",
        str(tmp_path / "data"),
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"default={peer}",
        "--cert-file",
        str(tmp_path / "server.pem"),
        "--key-file",
        str(tmp_path / "server.key"),
        "--trusted-ca-file",
        str(tmp_path / "ca.pem"),
        "--client-cert-auth",
        "--log-level",
        "error",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.cluster
def test_a_client_reaches_an_etcd_on_tls_with_its_ca_and_client_certificate(
    tls_etcd: str, tmp_path: Path
):
    files = {
        "etcd_ca_file": str(tmp_path / "ca.pem"),
        "etcd_cert_file": str(tmp_path / "client.pem"),
        "etcd_key_file": str(tmp_path / "client.key"),
    }
    etcd = create_etcd(ClusterConfig(etcd=(tls_etcd,), **files))
    deadline = time.monotonic() + 30
    while True:  # NOTE: until it listens
        try:
            etcd.put("k", b"over tls")
            break
        except EtcdError:
            assert time.monotonic() < deadline, "the TLS etcd never answered"
            time.sleep(0.1)
    assert etcd.get("k").value == b"over tls"  # type: ignore[union-attr]
    no_cert = create_etcd(ClusterConfig(etcd=(tls_etcd,), etcd_ca_file=files["etcd_ca_file"]))
    with pytest.raises(EtcdError, match="no etcd endpoint answered"):
        no_cert.get("k")
    no_ca = create_etcd(
        ClusterConfig(
            etcd=(tls_etcd,),
            etcd_cert_file=files["etcd_cert_file"],
            etcd_key_file=files["etcd_key_file"],
        )
    )
    with pytest.raises(EtcdError, match="CERTIFICATE_VERIFY_FAILED"):
        no_ca.get("k")


def test_etcd_credentials_that_cannot_work_are_refused_naming_the_key(tmp_path: Path):
    with pytest.raises(ConfigError, match="cluster.etcd_password: not accepted as a flag"):
        load_config(env={}, overrides={"cluster.etcd_password": "pw"})
    cases = {
        "cluster.etcd_user: needs a password": {"cluster.etcd_user": "root"},
        "cluster.etcd_user: a password is set for etcd but no user": {
            "cluster.etcd_password_file": "/p"
        },
        "cluster.etcd_cert_file: set it together with cluster.etcd_key_file": {
            "cluster.etcd_cert_file": "/c.pem"
        },
        "cluster.etcd_ca_file: TLS is set but cluster.etcd has http:// URLs": {
            "cluster.etcd": "http://127.0.0.1:2379",
            "cluster.etcd_ca_file": "/ca.pem",
        },
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(env={}, overrides=overrides)
    env = {"MOONCAKE_CLUSTER_ETCD_PASSWORD": "pw", "MOONCAKE_CLUSTER_ETCD_USER": "root"}
    assert load_config(env=env).config.cluster.etcd_password == "pw"  # NOTE: env is fine
    url = ("http://127.0.0.1:1",)
    with pytest.raises(ConfigError, match="cluster.etcd_password_file: cannot read /nonexistent"):
        create_etcd(ClusterConfig(etcd=url, etcd_user="u", etcd_password_file="/nonexistent"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="cluster.etcd_password_file: .* is empty"):
        create_etcd(ClusterConfig(etcd=url, etcd_user="u", etcd_password_file=str(empty)))
    (tmp_path / "pw").write_text("secret\n")
    etcd = create_etcd(
        ClusterConfig(etcd=url, etcd_user="u", etcd_password_file=str(tmp_path / "pw"))
    )
    assert etcd.access.password == "secret"
    with pytest.raises(ConfigError, match="cluster.etcd_ca_file: cannot load it as PEM"):
        create_etcd(ClusterConfig(etcd=("https://h:1",), etcd_ca_file=str(empty)))
    with pytest.raises(ConfigError, match="cluster.etcd: 'h:2379' is not an etcd client URL"):
        create_etcd(ClusterConfig(etcd=("h:2379",)))


def _shm_dirs() -> set[Path]:
    return set(TMPFS.glob(f"{TMPFS_PREFIX}{os.getpid()}-*"))


@pytest.mark.cluster
@pytest.mark.parametrize("binary", ["/nonexistent", "/bin/true"])
def test_an_unusable_etcd_binary_is_named_and_leaves_no_directory_behind(
    binary: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv(ETCD_ENV, binary)
    before = _shm_dirs()
    server = LocalEtcd(tmpfs_data_dir(tmp_path / "etcd"))
    with pytest.raises(EtcdError, match=rf"\${ETCD_ENV}={binary}: .*expected the path of an etcd"):
        server.start()
    assert _shm_dirs() == before and not server.data_dir.exists()

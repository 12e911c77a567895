"""The etcd client of a master or a node, logged in as `[cluster]` says (docs/ha.md).

    etcd = create_etcd(config.cluster)   # ConfigError naming the key when a file is unusable

The loader already refused settings that cannot work together (a user without a password,
a certificate without its key, TLS files with http:// endpoints); here the password and
TLS files are read.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from mooncake.config.settings import ClusterConfig
from mooncake.errors import ConfigError
from mooncake.ha.etcd import Etcd, EtcdAccess


def etcd_access(c: ClusterConfig) -> EtcdAccess:
    """The credentials `c` names, its files read; raises ConfigError naming the key."""
    bad = [u for u in c.etcd if not u.startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(
            f"cluster.etcd: {', '.join(map(repr, bad))} is not an etcd client URL; "
            'write each as "http://host:2379" (or https://)'
        )
    password = c.etcd_password
    if c.etcd_password_file:
        password = _read("cluster.etcd_password_file", c.etcd_password_file).strip()
        if not password:
            raise ConfigError(f"cluster.etcd_password_file: {c.etcd_password_file} is empty")
    tls = None
    if c.etcd_ca_file or c.etcd_cert_file:
        tls = ssl.create_default_context()
        try:
            if c.etcd_ca_file:
                key = "cluster.etcd_ca_file"
                tls.load_verify_locations(cafile=c.etcd_ca_file)
            if c.etcd_cert_file:
                key = "cluster.etcd_cert_file"
                tls.load_cert_chain(c.etcd_cert_file, c.etcd_key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"{key}: cannot load it as PEM: {e}") from e
    return EtcdAccess(user=c.etcd_user, password=password, tls=tls)


def create_etcd(c: ClusterConfig) -> Etcd:
    """A client of the etcd `c.etcd` names (which must not be empty), with its credentials."""
    assert c.etcd, "no cluster.etcd"
    return Etcd(c.etcd, c.etcd_timeout_s, etcd_access(c))


def _read(key: str, path: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from e

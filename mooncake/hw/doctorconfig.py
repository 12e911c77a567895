"""`mooncake doctor --config FILE`: what the node's config needs from this host: the SSD
tier's directory (the checks a node runs at start: mooncake/hw/ssdplace.py), the ports it
listens on, and the master, reached and accepting the cluster secret. Same `Check`
records as mooncake/hw/doctor.py."""

from __future__ import annotations

import errno
import socket

from mooncake.config.portrange import node_ports
from mooncake.config.settings import Config
from mooncake.errors import AuthError, MooncakeError, RpcTimeout
from mooncake.hw.doctor import Check, Status
from mooncake.hw.ssdplace import ALLOWED, check_ssd
from mooncake.native.sysfs import read_filesystems


def check_config(config: Config, master_timeout_s: float = 3.0) -> list[Check]:
    """Every config check (the master one waits up to `master_timeout_s`)."""
    return [_ssd(config), *_ports(config), _master(config, master_timeout_s)]


def _ssd(config: Config) -> Check:
    cfg = config.store
    if cfg.ssd_bytes.is_zero:
        return Check("ssd tier", "skip", "store.ssd_bytes is 0")
    place, why = check_ssd(cfg, read_filesystems())
    if place is not None:
        return Check("ssd tier", "pass", f"O_DIRECT works; {place.summary}")
    if cfg.ssd_path:
        return Check(
            "ssd tier", "fail", why, f"set store.ssd_path to {ALLOWED}, or lower store.ssd_bytes"
        )
    return Check(
        "ssd tier",
        "warn",
        f"no local SSD filesystem found, the tier stays off: {why}",
        'set store.ssd_path to a directory on an SSD, or store.ssd_bytes = "0"',
    )


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _ports(config: Config) -> list[Check]:
    ports = node_ports(config)
    checks = []
    if ports.low:
        free = [p for p in ports.ports() if _free("0.0.0.0", p)]
        status: Status = "pass" if free else "fail"
        checks.append(
            Check(
                "node ports",
                status,
                f"node.port_range {ports.low}-{ports.high}: {len(free)} free",
                "" if free else "widen node.port_range or stop what holds it",
            )
        )
    else:
        checks.append(Check("node ports", "pass", "node.port_range unset: any free port"))
    for what, host, port in (
        ("api port", config.api.host, config.api.port),
        ("metrics port", config.metrics.host, config.metrics.port),
    ):
        if port and not _free(host, port):
            checks.append(
                Check(
                    what,
                    "warn",
                    f"{host}:{port} is in use (only the master binds it)",
                    f"stop what listens there (`ss -ltnp 'sport = :{port}'`) on the master",
                )
            )
        elif port:
            checks.append(Check(what, "pass", f"{host}:{port} free"))
    return checks


def _master(config: Config, timeout_s: float) -> Check:
    from mooncake.rpc.client import RpcClient
    from mooncake.store.server import messages as m

    address = config.cluster.master
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as e:
        return Check(
            "master",
            "fail",
            f"cluster.master {address}: {e.strerror or e}",
            "start the master, or set cluster.master to its host:port",
        )
    try:
        secret = config.cluster.require_secret()
    except MooncakeError as e:
        return Check("master", "fail", f"{address} listens, but {e}", "set cluster.secret")
    client = RpcClient(f"tcp://{address}", secret.encode(), timeout_s=timeout_s)
    try:
        client.call(m.ExistsMsg("doctor/probe"), m.KeyReplyMsg)
    except (AuthError, RpcTimeout) as e:
        return Check(
            "master",
            "fail",
            f"{address} listens but the cluster secret is refused (or the master is stuck): {e}",
            "use the secret every node of the cluster shares (cluster.secret)",
        )
    except MooncakeError as e:
        return Check("master", "fail", f"{address}: {e}", "see the master's log")
    finally:
        client.close()
    return Check("master", "pass", f"{address} reached, secret accepted")

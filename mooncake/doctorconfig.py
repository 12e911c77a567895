"""`mooncake doctor --config FILE`: what the node's config needs from this host: the SSD
tier's directory (O_DIRECT, free space), the ports it listens on, and the master, reached
and accepting the cluster secret. Same `Check` records as mooncake/doctor.py."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import socket

from mooncake.config import Config
from mooncake.doctor import Check, Status
from mooncake.errors import AuthError, MooncakeError, RpcTimeout
from mooncake.portrange import node_ports

SSD_PROBE_BYTES = 4096  # one O_DIRECT-aligned block written and removed
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def check_config(config: Config, master_timeout_s: float = 3.0) -> list[Check]:
    """Every config check (the master one waits up to `master_timeout_s`)."""
    return [_ssd(config), *_ports(config), _master(config, master_timeout_s)]


def _ssd(config: Config) -> Check:
    cfg = config.store
    if cfg.ssd_bytes.is_zero:
        return Check("ssd tier", "skip", "store.ssd_bytes is 0")
    path = cfg.ssd_path
    if not path or not os.path.isdir(path):
        return Check(
            "ssd tier",
            "fail",
            f"store.ssd_path {path!r} is not a directory",
            "create it on the SSD, or set store.ssd_path to a directory there",
        )
    fstype = _fstype(path)
    if fstype in MEMORY_FILESYSTEMS:
        return Check(
            "ssd tier",
            "fail",
            f"{path} is on {fstype}: the SSD tier would take RAM",
            "set store.ssd_path to a directory on a local SSD",
        )
    free = shutil.disk_usage(path).free
    want = cfg.ssd_bytes.resolve(free)
    probe = os.path.join(path, f".mooncake-doctor-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            block = mmap.mmap(-1, SSD_PROBE_BYTES)  # page-aligned, as O_DIRECT needs
            os.write(fd, block)
        finally:
            os.close(fd)
    except OSError as e:
        why = "the filesystem refuses O_DIRECT" if e.errno == errno.EINVAL else e.strerror
        return Check(
            "ssd tier",
            "fail",
            f"{path}: {why}",
            "use a directory on a local ext4/xfs SSD filesystem (not tmpfs or NFS)",
        )
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if want > free:
        return Check(
            "ssd tier",
            "fail",
            f"{path}: {want >> 30} GiB wanted, {free >> 30} GiB free",
            "lower store.ssd_bytes or free space there",
        )
    return Check(
        "ssd tier", "pass", f"{path}: O_DIRECT works, {want >> 30} of {free >> 30} GiB free"
    )


def _fstype(path: str, mounts: str = "/proc/mounts") -> str:
    """The type of the filesystem holding `path` (its longest mount point); "" if unknown."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


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
    from mooncake.store import messages as m

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

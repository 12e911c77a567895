"""`setup`'s arguments, upstream's way (mooncake-integration/store/store_py.cpp and
RealClient::setup_internal in mooncake-store/src/real_client.cpp), read into what our Store
needs, and the cluster secret.

    local_hostname       "host" or "host:port": the host this client's Transfer Engine
                         listens on ("localhost" binds 127.0.0.1); without a port, on the
                         first free one of upstream's range 12300-14300, and get_hostname()
                         names it; a port given is the client's name (get_hostname()), not
                         bound, as upstream's: the engine takes a free port of its own,
                         unless MC_LEGACY_RPC_PORT_BINDING is set (then it binds that port)
    metadata_server      "P2PHANDSHAKE", "http://...", "etcd://...": accepted and unused (our
                         master hands out each replica's endpoint with it)
    global_segment_size  bytes this client gives the pool: a DRAM segment mounted with the
                         master (0 = none); shared memory whose pages are taken only when
                         written, so gigabytes cost nothing until used
    local_buffer_size    bytes of the buffer behind put/get (it grows for larger values);
                         0 = none: put and get answer INVALID_PARAMS, as upstream's do
    protocol             "tcp", or "rdma": with `rdma_devices` named, RDMA on those NICs (setup
                         fails without them); with "" RDMA where a NIC opens, else TCP, as
                         upstream's auto-discovery (client_service.cpp); MC_FORCE_TCP set
                         makes it TCP; other protocols are refused
    master_server_addr   "host:port" of our master's control plane (tcp:// may be given)

Sizes are ints or strings like "16MB", "1.5 GB" (K/M/G/T with or without B: powers of
1024, as upstream reads them; KiB/MiB/GiB/TiB too); a percentage is refused.

The cluster secret authenticates the control and data planes. It comes from
MOONCAKE_CLUSTER_SECRET, MOONCAKE_CLUSTER_SECRET_FILE, or `cluster.secret` /
`cluster.secret_file` in the config file $MOONCAKE_CONFIG names, the same on the master and
every client; without one, setup refuses with a ConfigError saying so: nothing runs
unauthenticated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from mooncake.engine.engine import our_protocol

DEFAULT_SEGMENT_BYTES: Final = 16 << 20  # upstream's DEFAULT_GLOBAL_SEGMENT_SIZE
DEFAULT_BUFFER_BYTES: Final = 16 << 20  # upstream's DEFAULT_LOCAL_BUFFER_SIZE
DEFAULT_MASTER: Final = "127.0.0.1:50051"
UPSTREAM_PORTS: Final = (12300, 14300)  # where upstream's clients listen without a port
PROTOCOLS: Final = ("tcp", "rdma")

# unit (lower-case) -> bytes: K, KB and KiB alike are 1024, as upstream reads them
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[f"{_p}b"] = _UNITS[f"{_p}ib"] = 1024**_i
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class SetupArgs:
    """What `setup` asked for, checked."""

    host: str  # address the engine binds and advertises
    port: int  # the port of local_hostname; 0 = none (the first free one of UPSTREAM_PORTS)
    hostname: str  # local_hostname as given, without a port
    segment_bytes: int  # memory given to the pool; 0 = none
    buffer_bytes: int  # the put/get buffer; 0 = none
    protocol: str  # our transport: "tcp", "rdma" or "auto" (engine.our_protocol)
    nics: tuple[str, ...]  # RDMA devices; () = every usable one
    master: str  # "tcp://host:port"


def parse_size(value: object, key: str) -> int:
    """Bytes in `value` (an int, or a string as upstream's try_string_to_byte_size reads
    it); raises ValueError naming `key` and the forms allowed."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE_RE.match(str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f'{key}: expected bytes as an int or a string like "16MB", "1.5 GB", "64KiB", '
            f"got {value!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def read_args(
    local_hostname: str,
    metadata_server: str,
    global_segment_size: object,
    local_buffer_size: object,
    protocol: str,
    rdma_devices: str,
    master_server_addr: str,
) -> SetupArgs:
    """The checked arguments; raises ValueError naming the one that is wrong."""
    if not local_hostname:
        raise ValueError('local_hostname: required (e.g. "localhost" or "10.0.0.2:12345")')
    if not metadata_server:
        raise ValueError('metadata_server: required (e.g. "P2PHANDSHAKE")')
    hostname, _, port_text = str(local_hostname).rpartition(":")
    if not hostname or not port_text.isdigit():
        hostname, port_text = str(local_hostname), "0"
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"local_hostname: port must be 0..65535, got {port}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    master = str(master_server_addr).removeprefix("tcp://")
    if not re.fullmatch(r"[^\s:/]+:\d{1,5}", master):
        raise ValueError(f'master_server_addr: expected "host:port", got {master_server_addr!r}')
    nics = tuple(n.strip() for n in str(rdma_devices or "").split(",") if n.strip())
    return SetupArgs(
        host="127.0.0.1" if hostname == "localhost" else hostname,
        port=port,
        hostname=hostname,
        segment_bytes=parse_size(global_segment_size, "global_segment_size"),
        buffer_bytes=parse_size(local_buffer_size, "local_buffer_size"),
        protocol=our_protocol(protocol, nics, pinned=True),
        nics=nics if protocol == "rdma" else (),
        master=f"tcp://{master}",
    )


def read_dict(config: Mapping[str, Any]) -> SetupArgs:
    """`setup(dict)`: local_hostname and metadata_server required, the rest defaulted as
    upstream's; raises ValueError naming what is wrong."""
    if not isinstance(config, Mapping):
        raise ValueError(f"setup: expected the positional arguments or a dict, got {config!r}")
    return read_args(
        str(config.get("local_hostname", "")),
        str(config.get("metadata_server", "")),
        config.get("global_segment_size", DEFAULT_SEGMENT_BYTES),
        config.get("local_buffer_size", DEFAULT_BUFFER_BYTES),
        str(config.get("protocol", "tcp")),
        str(config.get("rdma_devices", "")),
        str(config.get("master_server_addr", DEFAULT_MASTER)),
    )


def cluster_secret(env: Mapping[str, str] | None = None) -> str:
    """The cluster secret, by the rule every upstream-API entry point shares
    (mooncake/engine/secret.py: MOONCAKE_CLUSTER_SECRET, MOONCAKE_CLUSTER_SECRET_FILE, the
    config file $MOONCAKE_CONFIG names, or the per-user opt-in). Raises ConfigError saying
    how to set one."""
    from mooncake.engine.secret import engine_secret

    return engine_secret(env).decode()

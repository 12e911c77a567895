"""The ports a node listens on: `[node] port_range` ("LOW-HIGH"; "" = any free port).

Every listener of a node (its RPC server, its Transfer Engine data-plane servers, a pipeline
stage's listener, the master's KV event sockets) binds through `bind_in_range` (ZeroMQ
sockets through `bind_zmq`), which tries
LOW, LOW+1, ... HIGH in order, so a firewall rule for the range covers the whole node.

    ports = PortRange.parse("7000-7019")            # ConfigError naming node.port_range if bad
    sock = listen("10.0.0.2", ports)                # a listening TCP socket on 7000..7019
    sock = listen("10.0.0.2", 0)                    # any free port, as without a range
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from mooncake.errors import ConfigError, MooncakeError

if TYPE_CHECKING:
    import zmq

    from mooncake.config.settings import Config

KEY = "node.port_range"
_T = TypeVar("_T")


class PortRange(NamedTuple):
    """Ports LOW..HIGH (both included); (0, 0) means "any free port the OS picks"."""

    low: int = 0
    high: int = 0

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """`"7000-7019"` -> PortRange(7000, 7019), `""` -> any port; ConfigError otherwise."""
        text = text.strip()
        if not text:
            return cls()
        low, sep, high = text.partition("-")
        if (
            not sep
            or not low.strip().isdigit()
            or not high.strip().isdigit()
            or not 1 <= int(low) <= int(high) <= 65535
        ):
            raise ConfigError(
                f'{KEY}: expected "LOW-HIGH" with 1 <= LOW <= HIGH <= 65535 (e.g. "7000-7019"),'
                f' or "" for any free port; got {text!r}'
            )
        return cls(int(low), int(high))

    @property
    def is_any(self) -> bool:
        return self.low == 0

    def ports(self) -> range:
        """The ports to try, in order (just 0 when any port will do)."""
        return range(0, 1) if self.is_any else range(self.low, self.high + 1)

    def __str__(self) -> str:
        return "any" if self.is_any else f"{self.low}-{self.high}"


def node_ports(config: Config) -> PortRange:
    """The range of `config`'s [node] section (validated when the config was loaded)."""
    return PortRange.parse(config.node.port_range)


def bind_in_range(ports: PortRange | int, bind: Callable[[int], _T], where: str = "") -> _T:
    """`bind(port)` for the first port of `ports` that is free; an int is that one port.

    `bind` raises OSError with errno EADDRINUSE when a port is taken (other errors pass
    through). Raises MooncakeError naming node.port_range when every port is taken."""
    if isinstance(ports, int):
        return bind(ports)
    for port in ports.ports():
        try:
            return bind(port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise MooncakeError(
        f"{KEY}: every port in {ports} is in use{' on ' + where if where else ''}; widen the "
        "range (each node needs one port per listener) or stop what holds those ports"
    )


def bind_zmq(sock: zmq.Socket[Any], address: str, ports: PortRange) -> None:
    """Bind a ZeroMQ socket to `address`; a tcp address at port 0 takes the first free
    port of `ports` instead (any free port when the range is unset)."""
    import zmq

    if ports.is_any or not address.startswith("tcp://") or not address.endswith(":0"):
        sock.bind(address)
        return
    prefix = address.removesuffix("0")

    def bind_port(port: int) -> None:
        try:
            sock.bind(f"{prefix}{port}")
        except zmq.ZMQError as e:  # the range helper moves on only past a port in use
            if e.errno == zmq.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, str(e)) from e
            raise

    bind_in_range(ports, bind_port, prefix.removeprefix("tcp://").rstrip(":"))


def listen(host: str, ports: PortRange | int = 0, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on `host` at the first free port of `ports`."""
    return bind_in_range(
        ports, lambda port: socket.create_server((host, port), backlog=backlog), host
    )

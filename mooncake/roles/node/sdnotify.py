"""Tell systemd (or any manager speaking its protocol) when a node is ready and when it stops.

The protocol is that of sd_notify(3): when the service manager started this process with
`NOTIFY_SOCKET` set, the process sends newline-separated `KEY=VALUE` assignments as one
datagram to that AF_UNIX socket. A path starting with `@` names a socket in the abstract
namespace (the `@` stands for a leading NUL byte). A unit of `Type=notify` counts as started
on `READY=1` (here with a `STATUS=` line naming the role and node id) and as stopping on
`STOPPING=1`. Without `NOTIFY_SOCKET` every call does nothing, as libsystemd's does.

`notify_ready` is called by `report_ready` (every role, the master included) and
`notify_stopping` where a stop begins (the node's signal handler, the master's shutdown).
`WATCHDOG=1` is not sent: a thread pinging systemd would prove only that the thread runs;
a node's serving loop is watched by `roles/node/watchdog.py`, which ends the process instead.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*assignments: str) -> bool:
    """Send `KEY=VALUE` lines as one datagram to `NOTIFY_SOCKET`; True when sent. Never
    raises: a service manager that went away must not stop the node."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]  # the abstract namespace
    elif not path.startswith("/"):
        log.warning("NOTIFY_SOCKET=%r is not an absolute path or @name; not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(assignments).encode(), path)
    except OSError as e:
        log.warning("cannot notify the service manager at %s: %s", path.lstrip("\0"), e)
        return False
    return True


def notify_ready(role: str, node_id: str) -> bool:
    """The node serves: systemd marks a `Type=notify` unit started."""
    return notify("READY=1", f"STATUS={role} {node_id} serving")


def notify_stopping() -> bool:
    """The node begins to stop (drain, deregister): systemd marks the unit deactivating."""
    return notify("STOPPING=1", "STATUS=stopping")

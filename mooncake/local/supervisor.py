"""A local cluster's node processes: their ready handshake, and restarting those that exit
on their own, as a process manager would.

`wait_ready` reads a node's stdout until its JSON ready line (`{"ready": true, ...}`).
`Supervisor.run` looks at each node's process every `poll_s`. A node whose process exited
(a crash, a kill, a node ending itself for its supervisor) is started again with the same
config and node id after a backoff that doubles with each of its restarts; one more exit
than `limit` restarts within `window_s` ends the supervision, and the caller stops the
cluster. A stopped process (SIGSTOP) is alive and is left alone. Every node is restartable,
the master too: nodes register again with a restarted master on their own.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from mooncake.errors import MooncakeError

log = logging.getLogger(__name__)

# NOTE: a child's stdout reaches EOF as it exits, a moment before it can be reaped: this
# long is waited for its exit code, so that a node failing at once (a config error) says
# so instead of seeming silent
EXIT_REAP_S = 5.0


@dataclass
class Child:
    """One node's process, started with stdout on a pipe for its ready line."""

    node_id: str
    role: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, object] = field(default_factory=dict)  # its ready line, once read


def wait_ready(child: Child, timeout_s: float) -> None:
    """Read the child's stdout until its JSON ready line, kept in `child.ready`; raises
    MooncakeError when it exits first or stays silent for `timeout_s`."""
    assert child.proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf, is_eof = b"", False
    with selectors.DefaultSelector() as sel:
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                if child.proc.poll() is not None:
                    break
                continue
            chunk = os.read(child.proc.stdout.fileno(), 65536)
            if not chunk:
                is_eof = True
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("ready"):
                    child.ready = msg
                    return
    code = child.proc.poll()
    if code is None and is_eof:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.proc.wait(timeout=EXIT_REAP_S)
    if code is not None:
        why = f": it exited with code {code} (its log is above)"
    elif is_eof:
        why = ": it closed its stdout and still runs"
    else:
        why = f" within {timeout_s:g} s"
    raise MooncakeError(f"{child.node_id} ({child.role}) did not report ready{why}")


def die_with_parent() -> None:
    """preexec_fn of a child: SIGTERM when its parent dies (PR_SET_PDEATHSIG, which fires
    when the *thread* that forked it ends), and Ctrl-C ignored: the parent forwards it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def terminate(children: list[Child], grace_s: Callable[[Child], float]) -> bool:
    """SIGTERM every running child (with SIGCONT, so a stopped one acts on it), then SIGKILL
    each still running once its `grace_s` seconds (from now) are over; returns whether one
    was killed."""
    started, is_killed = time.monotonic(), False
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
            c.proc.send_signal(signal.SIGCONT)
    for c in children:
        grace = grace_s(c)
        try:
            c.proc.wait(max(0.1, started + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", c.node_id, grace)
            c.proc.kill()
            c.proc.wait()
            is_killed = True
    return is_killed


@dataclass(frozen=True)
class RestartPolicy:
    """How a local cluster restarts and stops its nodes; the defaults are documented ones."""

    backoff_s: float = 1.0  # seconds before a node's first restart; doubles with each one
    max_backoff_s: float = 30.0  # seconds: the doubling stops here
    limit: int = 5  # restarts of one node within window_s; its next exit stops the cluster
    window_s: float = 300.0  # seconds
    poll_s: float = 0.2  # seconds between looks at the processes
    # seconds a node may take to exit after SIGTERM, on top of its drain (decode.drain_s for
    # a decode node), before it is killed
    stop_grace_s: float = 15.0


@dataclass(frozen=True)
class NodeEvent:
    """Something the supervisor saw or did, with a sentence for people."""

    kind: Literal["exited", "restarted", "ready", "gave_up"]
    node_id: str
    pid: int  # the process it is about: the dead one (exited, gave_up), else the new one
    message: str
    code: int | None = None  # exit code; negative = killed by that signal
    num_restarts: int = 0  # restarts of this node within the window, this one included
    backoff_s: float = 0.0  # seconds before this restart


class Nodes(Protocol):
    """What the supervisor needs of a launcher (`LocalLauncher`)."""

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Node id -> its current process; empty once the cluster is stopping."""
        ...

    def respawn(self, node_id: str) -> subprocess.Popen[bytes] | None:
        """Start the node again (not waiting for it to be ready); None if stopping."""
        ...

    def is_ready(self, node_id: str) -> bool:
        """Whether the node's current process reported ready."""
        ...


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    try:
        return f"code {code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"code {code}"


class Supervisor:
    """Restarts the nodes of `nodes` that exit, under `policy` (see the module docstring)."""

    def __init__(
        self,
        nodes: Nodes,
        policy: RestartPolicy,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.nodes, self.policy, self.clock = nodes, policy, clock
        self._restarts: dict[str, collections.deque[float]] = {}  # node id -> restart times

    def run(
        self, stop: threading.Event, on_event: Callable[[NodeEvent], None] = lambda _: None
    ) -> str | None:
        """Watch and restart until `stop` is set (returns None) or a node exits once more
        than the policy allows (returns why, also sent as a "gave_up" event). Restarts and
        `on_event` calls happen on the calling thread."""
        due: dict[str, float] = {}  # node id -> when to start it again
        starting: dict[str, int] = {}  # node id -> pid restarted, not yet ready
        while not stop.wait(self.policy.poll_s):
            now = self.clock()
            for node_id, proc in self.nodes.processes().items():
                code = None if node_id in due else proc.poll()
                if code is None:
                    if starting.get(node_id) == proc.pid and self.nodes.is_ready(node_id):
                        del starting[node_id]
                        note = f"{node_id} is ready again (pid {proc.pid})"
                        on_event(NodeEvent("ready", node_id, proc.pid, note))
                    continue
                starting.pop(node_id, None)
                event = self._on_exit(node_id, proc.pid, code, now)
                on_event(event)
                if event.kind == "gave_up":
                    return event.message
                due[node_id] = now + event.backoff_s
            for node_id, when in list(due.items()):
                if now < when:
                    continue
                del due[node_id]
                new = self.nodes.respawn(node_id)
                if new is None:
                    return None  # the cluster is stopping
                starting[node_id] = new.pid
                note = f"{node_id} started again (pid {new.pid})"
                on_event(NodeEvent("restarted", node_id, new.pid, note))
        return None

    def _on_exit(self, node_id: str, pid: int, code: int, now: float) -> NodeEvent:
        """Count the exit against the window; the event says what happens next."""
        p = self.policy
        times = self._restarts.setdefault(node_id, collections.deque())
        while times and times[0] <= now - p.window_s:
            times.popleft()
        exited = f"{node_id} (pid {pid}) exited with {_exit_text(code)}"
        if len(times) >= p.limit:
            why = (
                f"{exited}, and it was already restarted {len(times)} times within "
                f"{p.window_s:g} s; stopping the cluster (see its log above, fix the cause "
                "and run `mooncake up --local` again)"
                if p.limit
                else f"{exited}; restarts are off (restart limit 0): stopping the cluster"
            )
            return NodeEvent("gave_up", node_id, pid, why, code, len(times))
        backoff = min(p.max_backoff_s, p.backoff_s * 2 ** len(times))
        times.append(now)
        what = (
            f"{exited}; restarting it in {backoff:g} s ({_ordinal(len(times))} restart "
            f"within {p.window_s:g} s; at most {p.limit})"
        )
        return NodeEvent("exited", node_id, pid, what, code, len(times), backoff)

"""A node's serving loop on its own thread, watched: a loop that died or is stuck in one
unit of work is noticed, so the node stops reporting ready instead of queueing requests
that never finish.

    loop      runs `target(watch)`; wraps each unit of work in `with watch.busy():`
    watcher   the node's main thread asks `problem()` every heartbeat: "" while healthy,
              else why the node cannot serve (the loop's exception, or how long it is stuck)

A node whose loop fails raises `NodeFailed` from its `serve()`: the process exits with an
error, and its supervisor (`mooncake up --local`, systemd) starts it again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from mooncake.errors import MooncakeError

log = logging.getLogger(__name__)


class NodeFailed(MooncakeError):
    """A node's serving loop died or is stuck; the node must be restarted."""


class LoopWatch:
    """One serving thread and what the watcher needs to judge it."""

    def __init__(self, name: str, target: Callable[[LoopWatch], None], stall_timeout_s: float):
        self.name, self.stall_timeout_s = name, stall_timeout_s
        self.failure = ""  # why the loop ended abnormally ("" while it runs or ended cleanly)
        self._busy_since: float | None = None  # monotonic start of the unit of work under way
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark one unit of work (a decode step, a prefill) for the stall check."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def fail(self, why: str) -> None:
        """The loop gives up on its own (e.g. too many failed steps) and ends."""
        self.failure = self.failure or why

    def problem(self, now: float | None = None) -> str:
        """ "" while the loop serves; else why it cannot (it died, gave up or is stuck)."""
        if self.failure:
            return self.failure
        if not self._thread.is_alive():
            return f"{self.name} ended unexpectedly"
        since = self._busy_since
        now = time.monotonic() if now is None else now
        if since is not None and now - since > self.stall_timeout_s:
            return f"{self.name} is stuck: one step has run for {now - since:.0f} s"
        return ""

    def _run(self) -> None:
        try:
            self._target(self)
        except BaseException as e:  # NOTE: anything that ends the loop is a node failure
            log.exception("%s died", self.name)
            self.failure = f"{self.name} died: {type(e).__name__}: {e}"

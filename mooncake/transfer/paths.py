"""Paths to a peer and how slices choose them: NIC preference first, spread round-robin,
retries walk the other paths, and a path that keeps failing is paused for a while.

As upstream's `Topology::selectDevice`: a slice's first attempt takes one of the preferred
paths (local NIC nearest the buffer's location, remote NIC nearest the remote segment's);
retry k walks the full ordered list (preferred, then available) from position k-1,
skipping paused paths and the paths that already failed this slice.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake.transfer.batch import Batch, Slice
from mooncake.transfer.types import EngineOptions

MAX_PAUSE_S = 30.0


class Path:
    """One way to move slices to one peer: a local NIC, a remote NIC and the connections or
    queue pairs between them. Transports subclass it and implement dispatch()."""

    def __init__(
        self, key: str, local_nic: str, remote_nic: str, pause_after: int = 3, pause_s: float = 1.0
    ):
        self.key = key  # e.g. "tcp 10.0.0.2:7000 via eth1"
        self.local_nic = local_nic  # "" when the OS routes
        self.remote_nic = remote_nic
        self.pause_after = pause_after  # consecutive failures that pause the path
        self.first_pause_s = pause_s
        self.consecutive_failures = 0
        self.paused_until = 0.0  # time.monotonic()
        self.num_failures = 0  # totals, for stats
        self.num_slices = 0
        self.num_bytes = 0
        self._pause_s = pause_s
        self._lock = threading.Lock()

    def dispatch(self, slices: list[Slice]) -> None:  # pragma: no cover - interface
        """Queue `slices` on this path; the transport reports each through the engine."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections and threads."""

    def is_paused(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) < self.paused_until

    def record_success(self, num_bytes: int, num_slices: int = 1) -> None:
        self.num_slices += num_slices
        self.num_bytes += num_bytes
        if self.consecutive_failures:
            with self._lock:
                self.consecutive_failures = 0
                self._pause_s = self.first_pause_s

    def record_failure(self) -> bool:
        """Count a failure; returns True if that paused the path."""
        with self._lock:
            self.num_failures += 1
            if time.monotonic() < self.paused_until:
                return False  # slices that were in flight when it paused
            self.consecutive_failures += 1
            if self.consecutive_failures < self.pause_after:
                return False
            self.paused_until = time.monotonic() + self._pause_s
            self._pause_s = min(self._pause_s * 2, MAX_PAUSE_S)
            self.consecutive_failures = 0
            return True

    def __repr__(self) -> str:
        return f"Path({self.key})"


def _rank(nic: str, preferred: Sequence[str], available: Sequence[str]) -> int:
    if not preferred and not available:
        return 0  # no preference known: every NIC is as good as another
    return 0 if nic in preferred else 1 if nic in available or not nic else 2


class PathSet:
    """The ordered paths one (local location, remote segment) pair may use."""

    def __init__(
        self,
        paths: Sequence[Path],
        local_preference: Any = None,  # NicPreference-like: .preferred, .available
        remote_preferred: Sequence[str] = (),
    ):
        lp = list(getattr(local_preference, "preferred", []) or [])
        la = list(getattr(local_preference, "available", []) or [])
        rp = list(remote_preferred)

        def rank(item: tuple[int, Path]) -> tuple[int, int, int]:
            i, p = item
            return (_rank(p.local_nic, lp, la), 0 if not rp or p.remote_nic in rp else 1, i)

        ordered = sorted(enumerate(paths), key=rank)
        self.paths = [p for _, p in ordered]
        best = rank(ordered[0])[:2] if ordered else (0, 0)
        self.num_preferred = sum(1 for o in ordered if rank(o)[:2] == best)
        self._rr = itertools.count()

    def first(self) -> Path | None:
        """A path for a slice's first attempt: round-robin over the preferred, unpaused ones;
        the other unpaused paths if every preferred one is paused; None if all are paused."""
        picked = self.spread(1)
        return picked[0] if picked else None

    def live(self) -> list[Path]:
        """The unpaused preferred paths, else the other unpaused ones, else []."""
        now = time.monotonic()
        live = [p for p in self.paths[: self.num_preferred] if not p.is_paused(now)]
        return live or [p for p in self.paths[self.num_preferred :] if not p.is_paused(now)]

    def spread(self, count: int) -> list[Path]:
        """Paths for the first attempts of `count` slices, as first() would pick them one
        by one (round-robin over the unpaused preferred paths); [] if all are paused."""
        live = self.live()
        if not live:
            return []
        if len(live) == 1:
            return live * count
        start = next(self._rr)
        for _ in range(count - 1):
            next(self._rr)
        return [live[(start + k) % len(live)] for k in range(count)]

    def retry(self, s: Slice) -> Path | None:
        """A path for retry number `s.attempt` (>= 1): walk the ordered list from position
        attempt-1, preferring paths that have not failed this slice; None if all paused."""
        now = time.monotonic()
        n = len(self.paths)
        order = [self.paths[(s.attempt - 1 + k) % n] for k in range(n)]
        live = [p for p in order if not p.is_paused(now)]
        fresh = [p for p in live if p not in s.tried]
        return fresh[0] if fresh else live[0] if live else None


def nic_preference_for(mapping: Mapping[str, Any] | None, location: str) -> Any:
    """The NicPreference of `location` in a topology's `nic_preference` (None if unknown)."""
    if not mapping:
        return None
    return mapping.get(location)


def cut(
    batch: Batch,
    i: int,
    local: Any,
    local_offset: int,
    target: Any,
    pathset: PathSet,
    options: EngineOptions,
    by_path: dict[Any, list[Slice]],
) -> None:
    """Cut request `i` of `batch` (from `local_offset` of the `local` Region, into `target`
    at the request's remote offset) into slices of its transport's size, each added to its
    path's list in `by_path`; fails the request when every path of `pathset` is paused."""
    r, step = batch.requests[i], target.transport.slice_bytes(options)
    remote_offset = r.remote_offset
    if r.length <= step:  # one slice (most requests): the loop below in fewer steps
        paths = pathset.spread(1)
        if paths:
            batch.add_slices(i, 1)
            s = Slice(batch, i, r.op, local, local_offset, target, remote_offset, r.length)
            s.path = paths[0]
            by_path.setdefault(s.path, []).append(s)
            return
    num_slices = -(-r.length // step)
    # NOTE: on a transport that coalesces (tcp), consecutive slices share a path up
    # to group_bytes so they travel as one wire request; groups spread over paths
    per_path = max(1, options.group_bytes // step) if target.transport.coalesces else 1
    paths = pathset.spread(-(-num_slices // per_path))
    if not paths:
        batch.fail(
            i,
            f"every path to node {target.desc.node!r} is paused after repeated "
            "failures; retry in a moment",
        )
        return
    batch.add_slices(i, num_slices)
    for k, off in enumerate(range(0, r.length, step)):
        s = Slice(
            batch,
            i,
            r.op,
            local,
            local_offset + off,
            target,
            remote_offset + off,
            min(step, r.length - off),
        )
        s.path = paths[k // per_path]
        by_path.setdefault(s.path, []).append(s)

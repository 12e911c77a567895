"""Load on the network: bytes in flight per link, and the transfer time a new copy would see.

Every node has an egress and an ingress link of its NIC's bandwidth. A transfer from `src`
to `dst` uses src's egress and dst's ingress and queues behind the bytes already on them
(first come, first served), so

    transfer_time = (bytes + queued bytes on the busier link) / bandwidth

A link's queue is kept as the time it becomes idle (`busy_until`, seconds): its queued
bytes at time `now` are (busy_until - now) * bandwidth. The Conductor estimates with
`estimate`; whoever carries transfers out (the Store, the simulator) records them with
`reserve`, so the estimate always sees the load already on the path. Pure logic: time is
passed in.
"""

from __future__ import annotations

from mooncake.errors import SchedulingError


class NetworkState:
    """Per-node egress/ingress links with their bandwidth and queued bytes."""

    def __init__(self, default_bytes_per_s: float):
        assert default_bytes_per_s > 0, default_bytes_per_s
        self.default_bytes_per_s = default_bytes_per_s
        self._bw: dict[str, float] = {}  # node -> bytes/s
        self._out_busy: dict[str, float] = {}  # node -> time its egress is idle, s
        self._in_busy: dict[str, float] = {}  # node -> time its ingress is idle, s
        self.bytes_moved = 0  # bytes, every reserved transfer
        self._max_bw = 0.0  # bytes/s, the fastest link

    def add_node(self, node: str, bytes_per_s: float | None = None) -> None:
        bw = bytes_per_s or self.default_bytes_per_s
        assert bw > 0, (node, bw)
        old = self._bw.get(node, 0.0)
        self._bw[node] = bw
        self._out_busy.setdefault(node, 0.0)
        self._in_busy.setdefault(node, 0.0)
        if bw >= self._max_bw:
            self._max_bw = bw
        elif old == self._max_bw:  # NOTE: the fastest link slowed: find the new fastest
            self._max_bw = max(self._bw.values())

    def remove_node(self, node: str) -> None:
        for table in (self._bw, self._out_busy, self._in_busy):
            table.pop(node, None)
        self._max_bw = max(self._bw.values(), default=0.0)

    def _path(self, src: str, dst: str) -> tuple[float, float]:
        try:
            bw = min(self._bw[src], self._bw[dst])
            start = max(self._out_busy[src], self._in_busy[dst])
        except KeyError as e:
            raise SchedulingError(f"no network link for node {e.args[0]!r}: add_node first") from e
        return bw, start

    def bandwidth(self, src: str, dst: str) -> float:
        """Bytes/s of the path from src to dst (the slower of the two links)."""
        return self._path(src, dst)[0]

    def estimate(self, src: str, dst: str, num_bytes: float, now: float) -> float:
        """Seconds from `now` until `num_bytes` from src reach dst; changes nothing."""
        if src == dst or num_bytes <= 0:
            return 0.0
        bw, start = self._path(src, dst)
        return (start if start > now else now) + num_bytes / bw - now

    def floor_estimate(self, src: str, num_bytes: float, now: float) -> float:
        """A floor of `estimate(src, dst, ...)` over every destination `dst` other than
        src: src's egress queue alone, at the fastest link of the network, seconds."""
        if num_bytes <= 0:
            return 0.0
        bw = min(self._bw[src], self._max_bw)
        start = self._out_busy[src]
        return (start if start > now else now) + num_bytes / bw - now

    def reserve(self, src: str, dst: str, num_bytes: float, now: float) -> float:
        """Record a transfer starting at `now`; returns the time it completes."""
        if src == dst or num_bytes <= 0:
            return now
        bw, start = self._path(src, dst)
        end = (start if start > now else now) + num_bytes / bw
        self._out_busy[src] = end
        self._in_busy[dst] = end
        self.bytes_moved += int(num_bytes)
        return end

    def queued_bytes(self, node: str, now: float, direction: str = "out") -> float:
        """Bytes still queued on `node`'s egress ("out") or ingress ("in") link at `now`."""
        busy = (self._out_busy if direction == "out" else self._in_busy)[node]
        return max(0.0, busy - now) * self._bw[node]

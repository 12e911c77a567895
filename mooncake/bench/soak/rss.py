"""Each process's memory over a soak, and whether it grew after warm-up.

A process is one incarnation of a node (a node restarted is a new process with a new
pid). Its memory is that of its process tree (a prefill node's stage workers too):
`rss_bytes` all resident pages, `anon_bytes` the private ones (RSS less file-backed and
shared pages: the pool's shared-memory arenas fill up as objects are stored, which is not a
leak, and show in RSS only). Samples before `warmup_s` after the later of the soak's start
and the process's first sample are cut; growth compares the median of the first
`EDGE` samples after the cut with the median of the last `EDGE` (None when the process
did not live that long).
"""

from __future__ import annotations

import statistics

import msgspec
import psutil

EDGE = 3  # samples at each end of the kept window


class ProcessRss(msgspec.Struct, kw_only=True):
    """One process's memory through the soak (times in seconds from the soak's start)."""

    name: str  # the node id ("etcd" for the local etcd)
    pid: int
    first_s: float  # first sample
    last_s: float  # last sample (it died or the soak ended)
    samples: list[tuple[float, int, int]] = []  # (t, rss bytes, anon bytes)
    rss_growth: float | None = None  # after warm-up: last / first - 1 (medians of EDGE)
    anon_growth: float | None = None
    peak_rss_bytes: int = 0


def _tree_memory(pid: int) -> tuple[int, int]:
    """(rss, anon) bytes of the process and its descendants; raises psutil.Error if gone."""
    root = psutil.Process(pid)
    rss = anon = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            mem = p.memory_info()
        except psutil.Error:
            if p is root:
                raise
            continue
        rss += mem.rss
        anon += mem.rss - mem.shared
    return rss, anon


class RssSampler:
    """Samples the processes it is given; `report` says how each one's memory went."""

    def __init__(self, warmup_s: float):
        self.warmup_s = warmup_s
        self._by_pid: dict[int, ProcessRss] = {}

    def sample(self, t_s: float, pids: dict[str, int]) -> None:
        """One sample of every process in `pids` (name -> pid) at `t_s`; gone ones skipped."""
        for name, pid in pids.items():
            try:
                rss, anon = _tree_memory(pid)
            except psutil.Error:
                continue
            proc = self._by_pid.get(pid)
            if proc is None or proc.name != name:
                proc = self._by_pid[pid] = ProcessRss(name=name, pid=pid, first_s=t_s, last_s=t_s)
            proc.samples.append((t_s, rss, anon))
            proc.last_s = t_s
            proc.peak_rss_bytes = max(proc.peak_rss_bytes, rss)

    def report(self) -> list[ProcessRss]:
        """Every process seen, by name then first sample, growth filled in."""
        out = sorted(self._by_pid.values(), key=lambda p: (p.name, p.first_s))
        for proc in out:
            cut = max(0.0, proc.first_s) + self.warmup_s
            kept = [s for s in proc.samples if s[0] >= cut]
            if len(kept) < 2 * EDGE:
                continue
            proc.rss_growth = _growth([s[1] for s in kept])
            proc.anon_growth = _growth([s[2] for s in kept])
        return out


def _growth(values: list[int]) -> float:
    first = statistics.median(values[:EDGE])
    return statistics.median(values[-EDGE:]) / first - 1 if first else 0.0

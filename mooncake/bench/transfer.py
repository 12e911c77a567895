"""What `mooncake bench transfer` measures, modelled on upstream's transfer_engine_bench.

A target node allocates one shared-memory segment ("bench") and serves it. An initiator
runs `threads` threads; each submits batches of `batch_size` requests of `block_bytes`
against its own stripe of the segment and waits for each batch. Throughput counts
acknowledged bytes; latency is per batch. In the same run, in windows interleaved with the
transfer's, a baseline (mooncake.bench.transferbase) measures the ceiling of the machine.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import resource
import secrets
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import psutil

from mooncake.errors import TransferError
from mooncake.native.memory import aligned_empty
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.types import EngineOptions, TransferOp, TransferRequest

SEGMENT = "bench"


class BenchResult(msgspec.Struct):
    """One measurement (the --json output)."""

    protocol: str  # transport actually used
    scatter: bool  # requests of a batch were non-adjacent (no coalescing possible)
    op: str  # "read" or "write"
    block_bytes: int
    batch_size: int  # requests per batch
    threads: int
    slice_bytes: int  # bytes per slice the transport actually used
    duration_s: float  # measured seconds
    gbps: float  # GB/s (1e9 bytes) of acknowledged transfers
    requests_per_s: float
    p50_us: float  # batch latency percentiles
    p99_us: float
    baseline: str  # "socket-stream" or "memcpy"
    baseline_gbps: float
    ratio: float  # gbps / baseline_gbps
    num_batches: int
    num_retries: int
    rss_start_bytes: int  # initiator RSS after warm-up
    rss_end_bytes: int
    rss_peak_bytes: int  # initiator peak RSS (getrusage)
    rss_trace_bytes: list[int]  # initiator RSS sampled every 5 s of the measurement
    target_rss_peak_bytes: int  # target process peak RSS (0 when not --local)
    # --busy-target: the speed a pure-Python thread in the target kept while the target
    # served, as a share of its speed before (0 when not measured)
    target_busy_share: float = 0.0


class LatencyHistogram:
    """Latencies in fixed log-spaced bins (1% wide, 1 us to ~100 s): constant memory however
    long the run, so the bench itself never shows as RSS growth; percentiles within 1%."""

    RATIO = 1.01
    NUM_BINS = 2000

    def __init__(self) -> None:
        self.counts = np.zeros(self.NUM_BINS, dtype=np.int64)
        self.count = 0

    def add(self, seconds: float) -> None:
        us = max(seconds * 1e6, 1.0)
        self.counts[min(int(math.log(us, self.RATIO)), self.NUM_BINS - 1)] += 1
        self.count += 1

    @classmethod
    def merge(cls, parts: list[LatencyHistogram]) -> LatencyHistogram:
        out = cls()
        for p in parts:
            out.counts += p.counts
            out.count += p.count
        return out

    def percentile(self, q: float) -> float:
        """Seconds below which q% of the samples fall (the bin's upper edge); 0 if empty."""
        if not self.count:
            return 0.0
        k = int(np.searchsorted(np.cumsum(self.counts), self.count * q / 100.0))
        return self.RATIO ** (k + 1) / 1e6


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve_target(
    secret: bytes,
    host: str,
    port: int,
    buffer_bytes: int,
    conn: Connection | None,
    busy: bool = False,
    nics: tuple[str, ...] = (),
) -> None:
    """Run a target node; with `conn` (from --local) report (host, port) on it once ready and
    stop when the parent sends anything, answering with (peak RSS, busy share).

    `busy`: a thread runs pure Python all along, as a model node's engine thread does (its
    speed alone is measured first); the busy share is the speed it kept while serving. The
    initiator's figures then show whether serving waits for the GIL."""
    if threading.current_thread() is threading.main_thread():  # close (unlink) on SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine = TransferEngine(
        "bench-target", secret, EngineOptions(protocol="auto", nics=nics), host=host, port=port
    )
    stop, rates = threading.Event(), list[float]()
    worker = threading.Thread(target=_busy, args=(stop, rates), daemon=True)
    try:
        engine.allocate(SEGMENT, buffer_bytes)
        if conn is None:
            threading.Event().wait()
            return
        if busy:
            alone = _busy_rate(1.0)
            worker.start()
        conn.send((engine.server.host, engine.server.port))
        conn.recv()
        share = 0.0
        if busy:
            stop.set()
            worker.join(5)
            share = rates[0] / alone if rates and alone else 0.0
        conn.send((peak_rss_bytes(), share))
    finally:
        engine.close()


def _busy_rate(seconds: float, stop: threading.Event | None = None) -> float:
    """Rounds per second of a pure-Python loop, for `seconds` or until `stop`."""
    rounds, start = 0, time.perf_counter()
    until = start + seconds
    while time.perf_counter() < until and not (stop is not None and stop.is_set()):
        sum(i * i for i in range(200))
        rounds += 1
    return rounds / (time.perf_counter() - start)


def _busy(stop: threading.Event, rates: list[float]) -> None:
    rates.append(_busy_rate(1e9, stop))


def start_local_target(
    secret: bytes, buffer_bytes: int, busy: bool = False, nics: tuple[str, ...] = ()
) -> tuple[Any, Connection, str, int]:
    """Start a target process on loopback; returns (process, pipe, host, port) once it is
    serving (the child reports its port on the pipe: a handshake, not a sleep)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=serve_target,
        args=(secret, "127.0.0.1", 0, buffer_bytes, child, busy, nics),
        daemon=True,
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(30):
            raise EOFError
        host, port = parent.recv()
    except EOFError:
        proc.kill()
        raise TransferError("the bench target process did not start (see its log)") from None
    return proc, parent, host, port


class Initiator:
    """The initiator side: an engine, one local buffer and one batch of requests per thread."""

    def __init__(
        self,
        secret: bytes,
        host: str,
        port: int,
        protocol: str,
        op: str,
        block_bytes: int,
        batch_size: int,
        threads: int,
        slice_bytes: int,
        connections: int = 4,
        group_bytes: int = 0,
        scatter: bool = False,
        nics: tuple[str, ...] = (),  # RDMA devices to use (transfer.nics); () = every one
    ):
        opts = EngineOptions(
            protocol=protocol,  # type: ignore[arg-type]
            nics=nics,
            slice_bytes=slice_bytes,
            connections_per_peer=connections,
            group_bytes=group_bytes or EngineOptions.group_bytes,
        )
        self.engine = TransferEngine("bench-initiator", secret, opts)
        self.op, self.block_bytes, self.batch_size, self.scatter = (
            op,
            block_bytes,
            batch_size,
            scatter,
        )
        self.span = batch_size * block_bytes  # bytes per batch
        remote = f"{SEGMENT}@{host}:{port}"
        self.target = self.engine.resolve(remote)
        # scatter: blocks two block sizes apart remotely, reversed locally: none adjacent
        stride = 2 * block_bytes if scatter else block_bytes
        remote_span = batch_size * stride
        if remote_span > self.target.desc.num_bytes:
            have = self.target.desc.num_bytes
            raise ValueError(
                f"a batch spans {remote_span} bytes of the target's {have}; "
                "give the target a larger --buffer-size"
            )
        kind = TransferOp.READ if op == "read" else TransferOp.WRITE
        order = list(range(batch_size))[::-1] if scatter else list(range(batch_size))
        self.batches = []
        for t in range(threads):
            local = aligned_empty(self.span)
            local[:] = t + 1
            self.engine.register(f"local-{t}", local)
            fits = (t + 1) * remote_span <= self.target.desc.num_bytes
            base = t * remote_span if fits else 0
            self.batches.append(
                [
                    TransferRequest(
                        kind,
                        f"local-{t}",
                        order[j] * block_bytes,
                        remote,
                        base + j * stride,
                        block_bytes,
                    )
                    for j in range(batch_size)
                ]
            )
        for reqs in self.batches:  # warm-up: connections, page faults
            self.engine.submit(reqs).check()
        self.latency = LatencyHistogram()
        self.num_batches = 0

    def run(self, seconds: float) -> tuple[int, float]:
        """Every thread submits and waits for its batch, again and again, for `seconds`;
        returns (bytes acknowledged, seconds elapsed)."""
        stop = time.perf_counter() + seconds
        hists = [LatencyHistogram() for _ in self.batches]

        def loop(reqs: list[TransferRequest], hist: LatencyHistogram) -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                self.engine.submit(reqs).check()
                hist.add(time.perf_counter() - t0)

        workers = [
            threading.Thread(target=loop, args=a) for a in zip(self.batches, hists, strict=True)
        ]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        merged = LatencyHistogram.merge(hists)
        self.latency = LatencyHistogram.merge([self.latency, merged])
        self.num_batches += merged.count
        return merged.count * self.span, elapsed


def run_bench(initiator: Initiator, duration_s: float, baseline: Any | None) -> BenchResult:
    """Measure for `duration_s` in windows of about a second; with a `baseline`, a half-length
    baseline window follows each transfer window, so both see the same load."""
    proc = psutil.Process()
    rss_start = proc.memory_info().rss
    rounds = max(1, round(duration_s))
    moved = elapsed = base_bytes = base_elapsed = 0.0
    trace: list[int] = []
    next_sample = time.perf_counter() + 5.0
    for _ in range(rounds):
        b, e = initiator.run(duration_s / rounds)
        moved, elapsed = moved + b, elapsed + e
        if baseline is not None:
            b, e = baseline.run(duration_s / rounds / 2)
            base_bytes, base_elapsed = base_bytes + b, base_elapsed + e
        if time.perf_counter() >= next_sample:
            trace.append(proc.memory_info().rss)
            next_sample += 5.0
    lat, ini = initiator.latency, initiator
    gbps = moved / elapsed / 1e9
    base_gbps = base_bytes / base_elapsed / 1e9 if base_elapsed else 0.0
    return BenchResult(
        protocol=ini.target.transport.name,
        scatter=ini.scatter,
        op=ini.op,
        block_bytes=ini.block_bytes,
        batch_size=ini.batch_size,
        threads=len(ini.batches),
        slice_bytes=ini.target.transport.slice_bytes(ini.engine.options),
        duration_s=round(elapsed, 3),
        gbps=round(gbps, 3),
        requests_per_s=round(ini.num_batches * ini.batch_size / elapsed, 1),
        p50_us=round(lat.percentile(50) * 1e6, 1),
        p99_us=round(lat.percentile(99) * 1e6, 1),
        baseline=baseline.name if baseline is not None else "",
        baseline_gbps=round(base_gbps, 3),
        ratio=round(gbps / base_gbps, 3) if base_gbps else 0.0,
        num_batches=ini.num_batches,
        num_retries=ini.engine.num_retries,
        rss_start_bytes=rss_start,
        rss_end_bytes=proc.memory_info().rss,
        rss_peak_bytes=peak_rss_bytes(),
        rss_trace_bytes=trace,
        target_rss_peak_bytes=0,
    )


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


def cpu_note() -> str:
    """One line about the CPU this ran on (count and load), for honest reading of figures."""
    return f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"

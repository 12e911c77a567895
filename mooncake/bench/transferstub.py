"""The stub ceiling of the RDMA data path (`mooncake bench transfer --stub-device`): how many
slices one process posts and completes when the device costs nothing, for the C loop and for
the Python path in the same run.

- `c`: the C data loop (native/rdmaloop.py) over its stub provider (every work request
  completes at once, nothing is copied): one NIC, `num_qps` QPs, chains of 32 signalled
  every 16th.
- `python`: the project's RdmaTransport (an initiator and a target TransferEngine in this
  process, protocol rdma) on the stub device of bench/stubverbs.py: pyverbs' own SGE,
  SendWR and WC objects when it imports.
- `transport`: the same engines with `transfer.rdma_data_loop = "c"`: the RdmaTransport
  over the C loop's stub provider (discovery on bench/stubverbs.py), so the figure adds the
  engine's own per-request Python (validation, one Slice per request, the waiter's report)
  to `c`'s.

Cases: `large_64k` (4 requests of 16 MiB per batch, 64 KiB slices), `blocks_64k` (64
requests of 64 KiB: KV-block sized), `large_1m` (1 MiB slices), `busy_thread_64k`
(large_64k while a pure-Python thread spins in the process). One thread submits, keeping
`in_flight` batches outstanding. CPU is the process's (every thread: submitter, pollers,
workers), less the busy thread's own.

With a busy thread, the submitter holds the GIL about once per switch interval
(`sys.getswitchinterval()`, 5 ms): a path keeps its rate only if the work queued when it
gets it lasts that long. So busy_thread_64k keeps queued, per path, one switch interval of
that path's own large_64k rate in this run (at least IN_FLIGHT batches; `in_flight` says
how many): what a caller moving that much data would have in flight anyway.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from mooncake.bench.transfer import SEGMENT, cpu_note, new_secret
from mooncake.errors import TransferError
from mooncake.native.memory import aligned_empty

KIB, MIB = 1 << 10, 1 << 20
NUM_QPS = 4  # connections_per_peer's default
QUEUE_DEPTH = 256  # transfer.rdma_queue_depth's default
IN_FLIGHT = 4  # batches outstanding per submitting thread


@dataclass(frozen=True)
class StubCase:
    name: str
    request_bytes: int
    requests_per_batch: int
    slice_bytes: int
    busy: bool = False  # a pure-Python thread spins in the process meanwhile

    @property
    def batch_bytes(self) -> int:
        return self.request_bytes * self.requests_per_batch

    @property
    def slices_per_batch(self) -> int:
        per_request = -(-self.request_bytes // self.slice_bytes)
        return per_request * self.requests_per_batch


CASES = (
    StubCase("large_64k", 16 * MIB, 4, 64 * KIB),
    StubCase("blocks_64k", 64 * KIB, 64, 64 * KIB),
    StubCase("large_1m", 16 * MIB, 4, MIB),
    StubCase("busy_thread_64k", 16 * MIB, 4, 64 * KIB, busy=True),
)


class StubFigure(msgspec.Struct):
    """One path and case."""

    path: str  # "c", "transport" (the RdmaTransport over the C loop) or "python"
    case: str
    slices_per_s: float
    cpu_us_per_slice: float  # process CPU per slice, less a busy thread's own
    gb_per_s: float  # 1e9 bytes per second
    requests_per_s: float
    num_slices: int
    seconds: float
    in_flight: int  # batches kept outstanding


class StubReport(msgspec.Struct):
    """The --stub-device --json output."""

    cpu: str  # CPU count and load average during the run
    pyverbs: bool  # the Python path built real pyverbs SGE/SendWR/WC objects
    figures: list[StubFigure]
    # the targets for the C path: CPU per 64 KiB slice <= 0.5 us, >= 90% of
    # large_64k's rate with a busy thread, >= 1M KV-block requests/s
    c_cpu_us_per_64k_slice: float
    c_busy_thread_share: float
    # large_64k's CPU per slice over busy_thread_64k's: below 1 when the busy thread makes
    # each slice cost more (the GIL); the rate share also falls when the busy thread takes
    # a CPU the loop used (num_cpus)
    c_busy_thread_cpu_share: float
    c_blocks_requests_per_s: float
    num_cpus: int


class _Busy:
    """A pure-Python thread spinning until stop(); `cpu_s()` reads its own CPU seconds so
    far (its thread's CPU clock, read from the measuring thread)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-busy")
        self._thread.start()
        assert self._thread.ident is not None
        self._clock = time.pthread_getcpuclockid(self._thread.ident)

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i

    def cpu_s(self) -> float:
        return time.clock_gettime(self._clock)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _measure(
    path: str,
    case: StubCase,
    seconds: float,
    submit: Callable[[], Any],
    wait: Callable[[Any], None],
    in_flight: int,
) -> StubFigure:
    """Keep `in_flight` batches outstanding for `seconds`; `submit()` returns a handle that
    `wait(handle)` waits for (and checks)."""
    for handle in [submit() for _ in range(IN_FLIGHT)]:  # warm-up
        wait(handle)
    busy = _Busy() if case.busy else None
    pending = collections.deque(submit() for _ in range(in_flight))
    num_batches = 0
    busy0 = busy.cpu_s() if busy is not None else 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        wait(pending.popleft())
        num_batches += 1
        pending.append(submit())
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    if busy is not None:  # NOTE: its CPU over the same window, not since it started
        cpu -= busy.cpu_s() - busy0
        busy.stop()
    while pending:
        wait(pending.popleft())
    num_slices = num_batches * case.slices_per_batch
    return StubFigure(
        path=path,
        case=case.name,
        slices_per_s=round(num_slices / elapsed, 1),
        cpu_us_per_slice=round(cpu / num_slices * 1e6, 3),
        gb_per_s=round(num_batches * case.batch_bytes / elapsed / 1e9, 3),
        requests_per_s=round(num_batches * case.requests_per_batch / elapsed, 1),
        num_slices=num_slices,
        seconds=round(elapsed, 3),
        in_flight=in_flight,
    )


def busy_in_flight(case: StubCase, unloaded_slices_per_s: float) -> int:
    """Batches that keep one GIL switch interval of work queued at `unloaded_slices_per_s`
    (at least IN_FLIGHT)."""
    per_interval = unloaded_slices_per_s * sys.getswitchinterval() / case.slices_per_batch
    return max(IN_FLIGHT, math.ceil(per_interval))


def run_c(case: StubCase, seconds: float, in_flight: int = IN_FLIGHT) -> StubFigure:
    """The C loop over its stub provider; TransferError when the extension is not built."""
    from mooncake.native.rdma import QpEndpoint, Route
    from mooncake.native.rdmaloop import OP_WRITE, Paths, RdmaLoop, Requests

    loop = RdmaLoop.create("stub", signal_every=16, max_chain=32)
    if loop is None:
        raise TransferError("the RDMA C loop is not built (libibverbs headers at install)")
    try:
        nic = loop.open_nic("stub0", NUM_QPS * QUEUE_DEPTH)
        qps = []
        for _ in range(NUM_QPS):
            qp, qpn = loop.create_qp(nic, QUEUE_DEPTH)
            loop.connect_qp(qp, QpEndpoint("0" * 32, 0, qpn, 0, 5, 16), 0, Route(1, 0, 5))
            qps.append(qp)
        buf = np.empty(case.batch_bytes, np.uint8)  # never touched: nothing is copied
        region = loop.register(int(buf.ctypes.data), buf.nbytes)
        key = region.keys[0]
        n = case.requests_per_batch
        offsets = [i * case.request_bytes for i in range(n)]
        requests = Requests.of([OP_WRITE] * n, [region.handle] * n, offsets, offsets, [0] * n)
        requests.length[:] = case.request_bytes
        paths = Paths(qps, [key.base] * NUM_QPS, [key.rkey] * NUM_QPS)

        def wait(batch: Any) -> None:
            result = batch.wait()
            if result is None or not result.is_ok:
                raise TransferError(f"stub batch failed: {result}")

        return _measure(
            "c",
            case,
            seconds,
            lambda: loop.submit(requests, paths, case.slice_bytes),
            wait,
            in_flight,
        )
    finally:
        loop.close()


def run_python(
    case: StubCase, seconds: float, loop: bool = False, in_flight: int = IN_FLIGHT
) -> tuple[StubFigure, bool]:
    """The RdmaTransport on the stub device, its data plane in pyverbs (or, `loop`, in the
    C loop's stub provider): (figure, whether pyverbs' classes were used)."""
    from mooncake.bench.stubverbs import stub_verbs
    from mooncake.config.rdma import RdmaConfig
    from mooncake.transfer.engine import TransferEngine
    from mooncake.transfer.types import EngineOptions, TransferOp, TransferRequest

    verbs = stub_verbs()
    secret = new_secret()
    opts = EngineOptions(
        protocol="rdma",
        slice_bytes=case.slice_bytes,
        connections_per_peer=NUM_QPS,
        rdma=RdmaConfig(rdma_data_loop="c" if loop else "python"),
    )
    target = TransferEngine("stub-target", secret, opts, verbs=verbs, rdma_provider="stub")
    initiator = None
    try:
        target.allocate(SEGMENT, case.batch_bytes)
        initiator = TransferEngine(
            "stub-initiator", secret, opts, verbs=verbs, rdma_provider="stub"
        )
        remote = f"{SEGMENT}@{target.server.host}:{target.server.port}"
        initiator.resolve(remote)
        initiator.register("local", aligned_empty(case.batch_bytes))
        requests = [
            TransferRequest(
                TransferOp.WRITE,
                "local",
                i * case.request_bytes,
                remote,
                i * case.request_bytes,
                case.request_bytes,
            )
            for i in range(case.requests_per_batch)
        ]
        engine = initiator
        figure = _measure(
            "transport" if loop else "python",
            case,
            seconds,
            lambda: engine.submit(requests),
            lambda b: b.check(),
            in_flight,
        )
        return figure, bool(verbs.real)
    finally:
        if initiator is not None:
            initiator.close()
        target.close()


def run(
    seconds_per_case: float, paths: tuple[str, ...] = ("c", "transport", "python")
) -> StubReport:
    """Every case on every path in `paths`, the C path first."""
    figures: list[StubFigure] = []
    real = False
    unloaded: dict[str, float] = {}  # path -> its large_64k slices/s
    for case in CASES:
        for path in ("c", "transport", "python"):
            if path not in paths:
                continue
            depth = IN_FLIGHT
            if case.busy and path in unloaded:
                depth = busy_in_flight(case, unloaded[path])
            if path == "c":
                fig = run_c(case, seconds_per_case, depth)
            else:
                fig, is_real = run_python(case, seconds_per_case, path == "transport", depth)
                real |= is_real and path == "python"
            if case.name == "large_64k":
                unloaded[path] = fig.slices_per_s
            figures.append(fig)
    c = {f.case: f for f in figures if f.path == "c"}
    large, busy, blocks = c.get("large_64k"), c.get("busy_thread_64k"), c.get("blocks_64k")
    return StubReport(
        cpu=cpu_note(),
        pyverbs=real,
        figures=figures,
        c_cpu_us_per_64k_slice=large.cpu_us_per_slice if large else 0.0,
        c_busy_thread_share=round(busy.slices_per_s / large.slices_per_s, 3)
        if large and busy
        else 0.0,
        c_busy_thread_cpu_share=round(large.cpu_us_per_slice / busy.cpu_us_per_slice, 3)
        if large and busy and busy.cpu_us_per_slice
        else 0.0,
        c_blocks_requests_per_s=blocks.requests_per_s if blocks else 0.0,
        num_cpus=os.cpu_count() or 1,
    )

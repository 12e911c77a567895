"""What `mooncake bench store --clients N` measures: the master's metadata operations per second.

N client processes, each a Store client with small values, issue the calls a KV-cache
workload sends one master, as fast as they can for `duration_s`, all started at once:

    | step | call        | what a serving node does                                 |
    |------|-------------|----------------------------------------------------------|
    | 0    | put         | a prefill node stores a new KV block                     |
    | 1    | exists      | a scheduler probes a prefix block it holds (a hit)       |
    | 2    | get         | a decode node reads a prefix block                       |
    | 3    | exists      | a probe of a block nobody stored (a miss)                |
    | 4    | get         | another prefix block read                                |
    | 5    | remove      | the oldest block dropped (the ring stays RING_KEYS long) |

Each client first writes RING_KEYS blocks (untimed, in batches), so the pool is in steady
state: every put is matched by a remove. Reads pick a random block of the newest half of
the ring, so the block removed was read long before (its read lease, 0.2 s, is over: a
remove does not wait). Figures: operations per second of all clients together, and
p50/p99 per call, from log-spaced histograms (2% wide bins) merged over the clients.

upstream_driver.py's `load` mode runs the same loop on upstream's Python API: keep the two
in step (STEPS, RING_KEYS, the histogram's bins).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from mooncake.errors import StoreError

STEPS = ("put", "exists", "get", "exists_miss", "get", "remove")  # one cycle of a client
OPS = ("put", "get", "exists", "remove")  # what the figures are given per
RING_KEYS = 512  # blocks a client keeps in the pool
PREFILL_BATCH = 64  # blocks per put_batch of the untimed pre-fill
BIN_RATIO = 1.02  # a histogram bin's upper edge over its lower one
START_TIMEOUT_S = 120.0  # seconds N clients may take to start and pre-fill


def bin_of(seconds: float) -> int:
    """The histogram bin of a latency: bin b holds [1.02^b, 1.02^(b+1)) microseconds."""
    return max(0, int(math.log(max(seconds * 1e6, 1.0)) / math.log(BIN_RATIO)))


def percentile_us(hist: dict[int, int], q: float) -> float:
    """The q-th percentile (0-100) of a histogram, microseconds (its bin's middle)."""
    total = sum(hist.values())
    if not total:
        return 0.0
    rank, seen = q / 100 * total, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return round(BIN_RATIO ** (b + 0.5), 1)
    raise AssertionError(f"rank {rank} beyond {total} samples")


class ClientFigures(msgspec.Struct):
    """One client's run (the reply of a client process; upstream's driver sends the same)."""

    ops: dict[str, int]  # op -> calls completed
    hist: dict[str, dict[int, int]]  # op -> latency histogram (bin_of -> calls)
    seconds: float  # the client's measured time


class LoadRow(msgspec.Struct):
    """One master under load from `clients` processes (an element of the --json list)."""

    master: str  # "ours (file journal)", "ours (etcd)", "upstream", ...
    clients: int  # client processes
    value_bytes: int
    ops_per_s: float  # calls completed per second, all clients together
    p50_us: float  # per call, every op
    p99_us: float
    op_ops_per_s: dict[str, float]  # op -> calls per second
    op_p50_us: dict[str, float]  # op -> p50 microseconds
    op_p99_us: dict[str, float]
    seconds: float  # the measured time
    # the master process's CPU over the run, in cores (1.0: one core busy all along): far
    # below 1 (a Python master holds the GIL), the clients, not the master, are the limit
    master_cores: float = 0.0


def merge(master: str, value_bytes: int, figures: list[ClientFigures]) -> LoadRow:
    """One row from every client's figures."""
    seconds = max(f.seconds for f in figures)
    ops: Counter[str] = Counter()
    hists: dict[str, Counter[int]] = {op: Counter() for op in OPS}
    for f in figures:
        ops.update(f.ops)
        for op, h in f.hist.items():
            hists[op].update(h)
    every: Counter[int] = Counter()
    for h in hists.values():
        every.update(h)
    return LoadRow(
        master=master,
        clients=len(figures),
        value_bytes=value_bytes,
        ops_per_s=round(sum(ops.values()) / seconds),
        p50_us=percentile_us(every, 50),
        p99_us=percentile_us(every, 99),
        op_ops_per_s={op: round(ops[op] / seconds) for op in OPS},
        op_p50_us={op: percentile_us(hists[op], 50) for op in OPS},
        op_p99_us={op: percentile_us(hists[op], 99) for op in OPS},
        seconds=round(seconds, 2),
    )


class Workload:
    """One client's loop over a Store (ours); `run` returns its figures."""

    def __init__(self, store: object, prefix: str, value_bytes: int, seed: int):
        from mooncake.store.client.client import Store

        assert isinstance(store, Store)
        self.s = store
        self.prefix = prefix
        self.value = bytes(value_bytes)
        self.rng = random.Random(seed)
        self.ring: list[str] = []
        self.next = 0

    def _new_key(self) -> str:
        self.next += 1
        return f"{self.prefix}-{self.next}"

    def prefill(self) -> None:
        """Write RING_KEYS blocks, untimed."""
        while len(self.ring) < RING_KEYS:
            keys = [self._new_key() for _ in range(min(PREFILL_BATCH, RING_KEYS - len(self.ring)))]
            for r in self.s.put_batch(keys, [self.value] * len(keys)):
                if r.status != "ok":
                    raise StoreError(f"load bench pre-fill: put of {r.key!r}: {r.status}")
            self.ring += keys

    def _step(self, step: str) -> str:
        s, ring = self.s, self.ring
        if step == "put":
            key = self._new_key()
            s.put(key, self.value)
            ring.append(key)
            return "put"
        if step == "remove":
            s.remove(ring.pop(0))
            return "remove"
        if step == "exists_miss":
            if s.exists(f"{self.prefix}-missing-{self.next}"):
                raise StoreError("load bench: a key nobody stored exists")
            return "exists"
        key = ring[self.rng.randrange(len(ring) // 2, len(ring))]
        if step == "exists":
            if not s.exists(key):
                raise StoreError(f"load bench: {key!r} does not exist")
            return "exists"
        if len(s.get(key)) != len(self.value):
            raise StoreError(f"load bench: get of {key!r} returned the wrong size")
        return "get"

    def run(self, duration_s: float) -> ClientFigures:
        ops: Counter[str] = Counter()
        hist: dict[str, Counter[int]] = {op: Counter() for op in OPS}
        clock, i = time.perf_counter, 0
        start = clock()
        until = start + duration_s
        while True:
            t0 = clock()
            if t0 >= until:
                break
            op = self._step(STEPS[i % len(STEPS)])
            hist[op][bin_of(clock() - t0)] += 1
            ops[op] += 1
            i += 1
        return ClientFigures(dict(ops), {k: dict(v) for k, v in hist.items()}, clock() - start)

    def clear(self) -> None:
        if self.ring:
            self.s.remove_batch(self.ring, force=True)
        self.ring = []


def _client(index: int, secret: bytes, protocol: str, conn: Connection) -> None:
    """A client process: per ("run", master, value_bytes, duration_s) it connects, pre-fills,
    answers "ready", waits for "go", runs, answers its figures (JSON), clears and closes.
    Any failure is answered as {"error": ...}."""
    from mooncake.store.client.client import Store
    from mooncake.transfer.types import EngineOptions

    conn.send("started")
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        _, master, value_bytes, duration_s = req
        store = None
        try:
            opts = EngineOptions(protocol=protocol)  # type: ignore[arg-type]
            store = Store.connect(master, secret, engine_options=opts)
            work = Workload(store, f"load-{index}-{time.monotonic_ns()}", value_bytes, index)
            work.prefill()
            conn.send("ready")
            if conn.recv() != "go":
                return
            figures = work.run(duration_s)
            work.clear()
            conn.send(msgspec.json.encode(figures))
        except Exception as e:  # said to the parent, which stops the run
            conn.send(msgspec.json.encode({"error": f"client {index}: {e!r}"}))
        finally:
            if store is not None:
                store.close()


class LoadClients:
    """N spawned client processes of ours, reused for every master of a run."""

    def __init__(self, num_clients: int, secret: bytes, protocol: str = "tcp"):
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for i in range(num_clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(i, secret, protocol, child), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        for i, pipe in enumerate(self.pipes):
            self._expect(i, pipe, "started")

    def _expect(self, i: int, pipe: Connection, what: str) -> object:
        if not pipe.poll(START_TIMEOUT_S):
            raise StoreError(f"load client {i} did not answer {what!r} in {START_TIMEOUT_S:g} s")
        got = pipe.recv()
        if what and got != what:
            raise StoreError(f"load client {i}: expected {what!r}, got {str(got)[:300]}")
        return got

    def run(
        self,
        master: str,
        value_bytes: int,
        duration_s: float,
        on_go: Callable[[], None] | None = None,  # called as the clients start (a profiler)
    ) -> list[ClientFigures]:
        """Every client against `master`, started together; their figures."""
        for pipe in self.pipes:
            pipe.send(("run", master, value_bytes, duration_s))
        replies = [self._expect(i, p, "") for i, p in enumerate(self.pipes)]
        if bad := [r for r in replies if r != "ready"]:
            raise StoreError(f"load clients failed to prepare: {str(bad[0])[:300]}")
        if on_go is not None:
            on_go()
        for pipe in self.pipes:
            pipe.send("go")
        return [
            parse_figures(self._expect(i, p, ""))  # type: ignore[arg-type]
            for i, p in enumerate(self.pipes)
        ]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()  # EOF: the client returns
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> LoadClients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Failure(msgspec.Struct, forbid_unknown_fields=True):
    error: str


def parse_figures(data: bytes) -> ClientFigures:
    """A client's reply (ours or upstream's driver); StoreError for an error or a bad line."""
    try:
        raw = msgspec.json.decode(data)
        if isinstance(raw, dict) and "error" in raw:
            raise StoreError(msgspec.convert(raw, _Failure).error)
        return msgspec.convert(raw, ClientFigures, strict=False)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StoreError(f"load client: bad reply {data[:200]!r}: {e}") from e

"""What `mooncake bench store` measures: put and get through the Store client API.

For each API (bytes: put/get; zero-copy: put_from/get_into on registered buffers; batch:
put_batch/get_batch) and each value size, a put phase writes fresh keys for `duration_s`
(keeping a ring of at most RING_BYTES in the pool: the oldest key is removed, untimed,
before a new one is written), then a get phase reads those keys round robin for
`duration_s`. GB/s is value bytes over the summed call time; latency is per call (per
batch for the batch API). Before the first cell, `warm_up` runs untimed. The client has no
segment of its own beyond its registered buffers (the staging buffer of put/get and the
zero-copy buffers). It reads back what it wrote, as a prefill node reads the KV blocks it
stored: a get's lookup at the master then overlaps the read at the place its own put
left (a hint, store/client/grants.py), kept when the master still lists that replica. The
share of gets served so is in `gets_on_hint`, and of those within a read lease (one
round trip, no lookup) in `gets_on_lease`.

Before each cell, the same-run floor (SocketBaseline): one round trip carrying the value
over a plain socket to another process, so a figure can be read against this machine's
load at that moment rather than only against a reference measured elsewhere.

With `bench store --upstream PYTHON`, upstream Mooncake's C++ Store runs the same loop
(mooncake/bench/upstream_driver.py, which must stay in step with `StoreBench.run`) right
after each of our cells: the `upstream_*` figures of a row.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Literal

import msgspec
import numpy as np

from mooncake.errors import StoreError
from mooncake.store.client.client import Store
from mooncake.store.node.node import remote_name
from mooncake.transfer import wire
from mooncake.transfer.types import EngineOptions

Api = Literal["bytes", "zero-copy", "batch"]
APIS: tuple[Api, ...] = ("bytes", "zero-copy", "batch")
RING_BYTES = 64 << 20  # bytes of values a cell keeps in the pool at most
BATCH_BYTES = 64 << 20  # bytes of values per batch call at most
MAX_BATCH_KEYS = 8  # keys per batch call at most

# Upstream C++ Mooncake 0.3.13 Store, remote TCP on a 2-core loopback machine like ours
# (medians, +-20% noise), quoted from ../shared/PAPER.md "Transfer Engine figures". A
# reference measured elsewhere at another time, not a baseline of this run.
# (api, value_bytes) -> (put GB/s, get GB/s, put p50 us, get p50 us); None = not quoted.
UPSTREAM_0_3_13: dict[tuple[str, int], tuple[float | None, ...]] = {
    ("zero-copy", 1 << 20): (1.0, 1.4, None, None),
    ("zero-copy", 16 << 20): (1.4, 1.4, None, None),
    ("bytes", 4 << 10): (None, None, 242.0, 151.0),
}


_ASK = struct.Struct("!BQ")  # baseline request: op (1 write, 2 read), value bytes


def _echo_node(conn: Connection) -> None:
    """The baseline's peer: one connection; a write is received into a 64 MiB span (a new
    place each time, as a pool's), a read is sent from it; a 1-byte answer either way."""
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    wire.tune(sock)
    span = memoryview(np.ones(RING_BYTES, np.uint8))  # type: ignore[arg-type]
    ask, pos = bytearray(_ASK.size), 0
    while sock.recv_into(ask, _ASK.size, socket.MSG_WAITALL) == _ASK.size:
        op, size = _ASK.unpack(ask)
        pos = pos + size if pos + 2 * size <= RING_BYTES else 0
        view = span[pos : pos + size]
        if op == 1:
            wire.recv_exact(sock, view)
            sock.sendall(b"k")
        else:
            wire.send_all(sock, [b"k", view])


class SocketBaseline:
    """The same-run floor of a remote put or get: one request/response round trip that
    carries the value over a plain tuned TCP socket to another process (no Store, no
    Transfer Engine). A Store op needs at least two round trips (metadata, then data)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_echo_node, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        if not parent.poll(30):
            self._proc.kill()
            raise StoreError("the socket baseline's peer process did not start")
        self._sock = socket.create_connection(("127.0.0.1", parent.recv()))
        wire.tune(self._sock)

    def run(self, size: int, seconds: float) -> tuple[float, float]:
        """p50 microseconds of a write and of a read of `size` bytes, `seconds` each."""
        data = memoryview(np.ones(size, np.uint8))  # type: ignore[arg-type]
        ack = bytearray(1)
        out = []
        for op in (1, 2):
            lat: list[float] = []
            until = time.perf_counter() + seconds
            while time.perf_counter() < until or not lat:
                t0 = time.perf_counter()
                if op == 1:
                    wire.send_all(self._sock, [_ASK.pack(1, size), data])
                    wire.recv_exact(self._sock, ack)
                else:
                    self._sock.sendall(_ASK.pack(2, size))
                    wire.recv_exact(self._sock, ack)
                    wire.recv_exact(self._sock, data)
                lat.append(time.perf_counter() - t0)
            out.append(_pct(lat, 50))
        return out[0], out[1]

    def close(self) -> None:
        self._sock.close()  # the peer sees EOF and exits
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()


class StoreBenchRow(msgspec.Struct):
    """One (api, value size) cell (an element of the --json list)."""

    api: str  # "bytes", "zero-copy" or "batch"
    value_bytes: int
    keys_per_call: int  # 1, or keys per put_batch/get_batch call
    protocol: str  # transport the client used to reach the node ("tcp", "shm", ...)
    put_gbps: float  # GB/s (1e9 bytes) of values over summed put call time
    get_gbps: float
    put_p50_us: float  # per-call latency percentiles, microseconds
    put_p99_us: float
    get_p50_us: float
    get_p99_us: float
    num_puts: int  # calls measured
    num_gets: int
    # the same-run floor: one round trip carrying the value over a plain socket to another
    # process (SocketBaseline), microseconds p50; 0 when not measured
    socket_put_p50_us: float = 0.0
    socket_get_p50_us: float = 0.0
    # upstream Mooncake's C++ Store measured in the same run, cell by cell right after ours
    # (bench store --upstream; mooncake.bench.upstream); 0 when not measured
    upstream_put_gbps: float = 0.0  # GB/s, as put_gbps
    upstream_get_gbps: float = 0.0
    upstream_put_p50_us: float = 0.0  # microseconds, as put_p50_us
    upstream_get_p50_us: float = 0.0
    gets_on_hint: float = 0.0  # share of keys read: overlapped with their lookup (a hint)
    gets_on_lease: float = 0.0  # share of keys read: within a read lease, with no lookup
    repeats: int = 1  # measurements of this cell its figures are the medians of


def median_row(rows: list[StoreBenchRow]) -> StoreBenchRow:
    """One row for repeated measurements of a cell: the median of each figure, the calls
    summed."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    figures = {
        name: float(np.median([getattr(r, name) for r in rows]))
        for name in (
            "put_gbps",
            "get_gbps",
            "put_p50_us",
            "put_p99_us",
            "get_p50_us",
            "get_p99_us",
            "socket_put_p50_us",
            "socket_get_p50_us",
            "upstream_put_gbps",
            "upstream_get_gbps",
            "upstream_put_p50_us",
            "upstream_get_p50_us",
            "gets_on_hint",
            "gets_on_lease",
        )
    }
    return msgspec.structs.replace(
        first,
        **{
            k: _sig(v) if k.endswith("gbps") or k.startswith("gets_on") else round(v, 1)
            for k, v in figures.items()
        },
        num_puts=sum(r.num_puts for r in rows),
        num_gets=sum(r.num_gets for r in rows),
        repeats=len(rows),
    )


def keys_per_call(api: str, size: int) -> int:
    """Keys per put/get call of a cell: 1, or for the batch API as many values as fit
    BATCH_BYTES, at most MAX_BATCH_KEYS."""
    return max(1, min(MAX_BATCH_KEYS, BATCH_BYTES // size)) if api == "batch" else 1


def _timed(fn: Callable[[], object], lat: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    lat.append(time.perf_counter() - t0)


def _sig(x: float) -> float:
    """`x` to 4 significant digits (GB/s of 4 KiB values is ~0.01: ratios need digits)."""
    return float(f"{x:.4g}")


def _pct(lat: list[float], q: float) -> float:
    return round(float(np.percentile(lat, q)) * 1e6, 1) if lat else 0.0


class StoreBench:
    """A client connected to a master, measuring cells against one store node."""

    def __init__(
        self,
        master_address: str,
        secret: bytes,
        protocol: str,
        node_segment: str,
        baseline: bool = True,
        spin_us: float = EngineOptions.spin_us,
    ):
        opts = EngineOptions(protocol=protocol, spin_us=spin_us)  # type: ignore[arg-type]
        self.store = Store.connect(master_address, secret, engine_options=opts)
        self.node_segment = node_segment  # "seg@host:port" of the node's DRAM tier, or ""
        self.seq = 0
        self.registered = 0  # bytes of the zero-copy buffers
        self.baseline = SocketBaseline() if baseline else None

    def close(self) -> None:
        if self.baseline is not None:
            self.baseline.close()
        self.store.close()

    def protocol(self) -> str:
        if not self.node_segment:  # a remote cluster: the transport asked for
            return self.store.engine.options.protocol
        return self.store.engine.resolve(self.node_segment).transport.name

    def warm_up(self, seconds: float) -> None:
        """Untimed 4 KiB puts and gets for `seconds` (connections opened, slots reserved,
        processes past their first slow seconds), then their keys removed."""
        value, keys = bytes(4096), list[str]()
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            keys.append(f"bench-warmup-{len(keys)}")
            self.store.put(keys[-1], value)
            self.store.get(keys[-1])
        if keys:
            self.store.remove_batch(keys)

    def _zero_copy_buffers(self, size: int) -> None:
        if size > self.registered:
            if self.registered:
                self.store.unregister_buffer("bench.src")
                self.store.unregister_buffer("bench.dst")
            src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            self.store.register_buffer("bench.src", src)
            self.store.register_buffer("bench.dst", np.zeros(size, dtype=np.uint8))
            self.registered = size

    def run(self, api: Api, size: int, duration_s: float) -> StoreBenchRow:
        """Measure one cell: a put phase, then a get phase, each `duration_s` long."""
        s = self.store
        per_call = keys_per_call(api, size)
        ring = max(2, RING_BYTES // (size * per_call))  # calls whose keys stay in the pool
        value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        if api == "zero-copy":
            self._zero_copy_buffers(size)
        self.seq += 1
        prefix = f"bench-{self.seq}-{api}-{size}"
        live: list[list[str]] = []

        def put(keys: list[str]) -> None:
            if api == "bytes":
                s.put(keys[0], value)
            elif api == "zero-copy":
                s.put_from(keys[0], "bench.src", 0, size)
            else:
                for r in s.put_batch(keys, [value] * len(keys)):
                    if r.status != "ok":
                        raise_for(r.key, r.status, r.message)

        def get(keys: list[str]) -> None:
            if api == "bytes":
                s.get(keys[0])
            elif api == "zero-copy":
                s.get_into(keys[0], "bench.dst", 0, size)
            else:
                for v in s.get_batch(keys):
                    v.unwrap()

        floor = (0.0, 0.0)
        if self.baseline is not None and api != "batch":  # interleaved: the same load
            floor = self.baseline.run(size, min(0.5, duration_s / 2))
        put_lat: list[float] = []
        get_lat: list[float] = []
        i, until = 0, time.perf_counter() + duration_s
        while time.perf_counter() < until or not put_lat:
            if len(live) >= ring:
                s.remove_batch(live.pop(0))
            keys = [f"{prefix}-{i}-{j}" for j in range(per_call)]
            _timed(functools.partial(put, keys), put_lat)
            live.append(keys)
            i += 1
        cache = s.locations
        before = (cache.num_overlapped, cache.num_hits) if cache is not None else (0, 0)
        i, until = 0, time.perf_counter() + duration_s
        while time.perf_counter() < until or not get_lat:
            _timed(functools.partial(get, live[i % len(live)]), get_lat)
            i += 1
        on_hint = on_lease = 0.0
        if cache is not None:
            num_keys = len(get_lat) * per_call
            on_hint = _sig((cache.num_overlapped - before[0]) / num_keys)
            on_lease = _sig((cache.num_hits - before[1]) / num_keys)
        s.remove_batch([k for keys in live for k in keys])  # waits out the read leases
        moved = size * per_call
        return StoreBenchRow(
            api=api,
            value_bytes=size,
            keys_per_call=per_call,
            protocol=self.protocol(),
            put_gbps=_sig(moved * len(put_lat) / sum(put_lat) / 1e9),
            get_gbps=_sig(moved * len(get_lat) / sum(get_lat) / 1e9),
            put_p50_us=_pct(put_lat, 50),
            put_p99_us=_pct(put_lat, 99),
            get_p50_us=_pct(get_lat, 50),
            get_p99_us=_pct(get_lat, 99),
            num_puts=len(put_lat),
            num_gets=len(get_lat),
            socket_put_p50_us=floor[0],
            socket_get_p50_us=floor[1],
            gets_on_hint=on_hint,
            gets_on_lease=on_lease,
        )


def raise_for(key: str, status: str, message: str) -> None:
    raise StoreError(message or f"put of {key!r} in the bench: {status}")


def node_segment(node_id: str, endpoint: str) -> str:
    """The Transfer Engine name of a store node's DRAM tier."""
    return remote_name(f"{node_id}.dram", endpoint)

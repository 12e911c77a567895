"""One small workload through upstream Mooncake's Python API, run by either implementation.

A standalone script that `mooncake bench dropin` (mooncake/bench/dropin.py) runs twice: in
an upstream venv (the PyPI wheel) and with this package importable. It imports only the
standard library, numpy and whatever `mooncake.store` / `mooncake.engine` the interpreter
has, by upstream's names (`MooncakeDistributedStore`, `TransferEngine`), so both sides run
the same lines. `-P` keeps this file's folder (inside our package) off sys.path.

    node    setup with a segment of --segment-bytes; print READY; serve until stdin's EOF
    target  a TransferEngine with a registered buffer; print {"peer", "addr"}; serve until EOF
    client  setup without a segment, then each cell in turn, one JSON line per phase:
            {"cell", "op", "bytes_per_call", "calls", "gbps", "p50_us"} or {"error": ...}

Cells: put/get of 4 KiB and 1 MiB values (`put`, `get`), batch_put_from/batch_get_into of
64 x 64 KiB from and into registered buffers, transfer_sync_write of 1 MiB to the target.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
RING_BYTES = 64 * MiB  # bytes of values a cell keeps in the pool at most
BATCH_KEYS, BATCH_VALUE_BYTES = 64, 64 * KiB
WRITE_BYTES = 1 * MiB
LOCAL_BUFFER_BYTES = 64 * MiB  # the client's staging buffer (get/put of bytes)
REMOVE_WAIT_S = 5.0  # seconds a removal may wait for read leases to run out


class CallError(Exception):
    """An upstream-API call returned a failure code."""


def phase_figures(cell: str, op: str, bytes_per_call: int, lat: list[float]) -> dict[str, Any]:
    """One reply line: GB/s (1e9 bytes) over the summed call time, median call in us."""
    total = sum(lat)
    return {
        "cell": cell,
        "op": op,
        "bytes_per_call": bytes_per_call,
        "calls": len(lat),
        "gbps": float(f"{bytes_per_call * len(lat) / total / 1e9:.4g}") if total else 0.0,
        "p50_us": round(float(np.percentile(lat, 50)) * 1e6, 1),
    }


def _timed_loop(duration_s: float, step: Callable[[int], None]) -> list[float]:
    """Call step(i) for i = 0, 1, ... until `duration_s` has passed (once at least); each
    call's seconds."""
    lat: list[float] = []
    until = time.perf_counter() + duration_s
    i = 0
    while not lat or time.perf_counter() < until:
        t0 = time.perf_counter()
        step(i)
        lat.append(time.perf_counter() - t0)
        i += 1
    return lat


def _ok(what: str, rc: int) -> None:
    if rc != 0:
        raise CallError(f"{what} returned {rc}")


class Client:
    """The workload's client: a Store with no segment, and a TransferEngine."""

    def __init__(self, store: Any, duration_s: float):
        self.s, self.duration_s = store, duration_s
        self.seq = 0

    def remove(self, keys: list[str]) -> None:
        """Remove `keys` (untimed), waiting out read leases up to REMOVE_WAIT_S."""
        until = time.perf_counter() + REMOVE_WAIT_S
        for key in keys:
            while (rc := self.s.remove(key)) != 0:
                if time.perf_counter() > until:
                    raise CallError(f"remove({key!r}) returned {rc}")
                time.sleep(0.005)

    def _keys(self, cell: str, i: int, n: int) -> list[str]:
        return [f"dropin-{self.seq}-{cell}-{i}-{j}" for j in range(n)]

    def put_get(self, size: int) -> list[dict[str, Any]]:
        """put then get of distinct `size`-byte values; at most RING_BYTES stay stored."""
        self.seq += 1
        cell = f"put/get {size // KiB} KiB" if size < MiB else f"put/get {size // MiB} MiB"
        value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        ring = max(2, RING_BYTES // size)
        live: list[str] = []
        put_lat: list[float] = []

        def put(i: int) -> None:
            key = self._keys("pg", i, 1)[0]
            _ok(f"put({key!r})", self.s.put(key, value))
            live.append(key)

        until = time.perf_counter() + self.duration_s
        i = 0
        while not put_lat or time.perf_counter() < until:
            if len(live) >= ring:
                self.remove([live.pop(0)])
            t0 = time.perf_counter()
            put(i)
            put_lat.append(time.perf_counter() - t0)
            i += 1

        def get(i: int) -> None:
            got = self.s.get(live[i % len(live)])
            if len(got) != size:
                raise CallError(f"get returned {len(got)} bytes, expected {size}")

        get_lat = _timed_loop(self.duration_s, get)
        self.remove(live)
        return [
            phase_figures(cell, "put", size, put_lat),
            phase_figures(cell, "get", size, get_lat),
        ]

    def batch(self) -> list[dict[str, Any]]:
        """batch_put_from and batch_get_into of BATCH_KEYS x BATCH_VALUE_BYTES, zero copy."""
        self.seq += 1
        cell = f"batch_put_from/batch_get_into {BATCH_KEYS} x {BATCH_VALUE_BYTES // KiB} KiB"
        nbytes = BATCH_KEYS * BATCH_VALUE_BYTES
        src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        for buf in (src, dst):
            _ok("register_buffer", self.s.register_buffer(buf.ctypes.data, nbytes))
        sizes = [BATCH_VALUE_BYTES] * BATCH_KEYS
        src_ptrs = [src.ctypes.data + j * BATCH_VALUE_BYTES for j in range(BATCH_KEYS)]
        dst_ptrs = [dst.ctypes.data + j * BATCH_VALUE_BYTES for j in range(BATCH_KEYS)]
        ring = max(2, RING_BYTES // nbytes)
        live: list[list[str]] = []
        put_lat: list[float] = []
        until = time.perf_counter() + self.duration_s
        i = 0
        while not put_lat or time.perf_counter() < until:
            if len(live) >= ring:
                self.remove(live.pop(0))
            keys = self._keys("batch", i, BATCH_KEYS)
            t0 = time.perf_counter()
            rcs = self.s.batch_put_from(keys, src_ptrs, sizes)
            put_lat.append(time.perf_counter() - t0)
            if any(rc != 0 for rc in rcs):
                raise CallError(f"batch_put_from returned {sorted(set(rcs))}")
            live.append(keys)
            i += 1

        def get(i: int) -> None:
            got = self.s.batch_get_into(live[i % len(live)], dst_ptrs, sizes)
            if any(n != BATCH_VALUE_BYTES for n in got):
                raise CallError(f"batch_get_into returned {sorted(set(got))}")

        get_lat = _timed_loop(self.duration_s, get)
        if not np.array_equal(src, dst):
            raise CallError("batch_get_into: the values read differ from those written")
        self.remove([k for keys in live for k in keys])
        for buf in (src, dst):
            _ok("unregister_buffer", self.s.unregister_buffer(buf.ctypes.data))
        return [
            phase_figures(cell, "batch_put_from", nbytes, put_lat),
            phase_figures(cell, "batch_get_into", nbytes, get_lat),
        ]

    def write(self, engine: Any, peer: str, peer_addr: int) -> list[dict[str, Any]]:
        """transfer_sync_write of WRITE_BYTES from a registered buffer to the target's."""
        src = np.random.default_rng(3).integers(0, 256, WRITE_BYTES, dtype=np.uint8)
        _ok("register_memory", engine.register_memory(src.ctypes.data, WRITE_BYTES))

        def write(_i: int) -> None:
            rc = engine.transfer_sync_write(peer, src.ctypes.data, peer_addr, WRITE_BYTES)
            _ok("transfer_sync_write", rc)

        lat = _timed_loop(self.duration_s, write)
        _ok("unregister_memory", engine.unregister_memory(src.ctypes.data))
        return [phase_figures("transfer_sync_write 1 MiB", "write", WRITE_BYTES, lat)]


def _engine(hostname: str) -> Any:
    engine = importlib.import_module("mooncake.engine").TransferEngine()
    _ok("TransferEngine.initialize", engine.initialize(hostname, "P2PHANDSHAKE", "tcp", ""))
    return engine


def _store(args: argparse.Namespace, segment_bytes: int) -> Any:
    store = importlib.import_module("mooncake.store").MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", args.metadata, segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", args.master
    )
    _ok("MooncakeDistributedStore.setup", rc)
    return store


def run(args: argparse.Namespace, out: Any) -> int:
    """The mode's work; replies on `out`."""
    if args.mode == "target":
        engine = _engine("127.0.0.1")
        buf = np.zeros(WRITE_BYTES, dtype=np.uint8)
        _ok("register_memory", engine.register_memory(buf.ctypes.data, WRITE_BYTES))
        peer = f"127.0.0.1:{engine.get_rpc_port()}"
        out.write(json.dumps({"peer": peer, "addr": buf.ctypes.data}) + "\n")
        sys.stdin.read()  # serve until the parent closes our stdin
        return 0
    if args.mode == "node":
        store = _store(args, args.segment_bytes)
        out.write("READY\n")
        sys.stdin.read()
        store.close()
        return 0
    store = _store(args, 0)
    client = Client(store, args.duration)
    cells: list[Callable[[], list[dict[str, Any]]]] = [
        lambda: client.put_get(4 * KiB),
        lambda: client.put_get(1 * MiB),
        client.batch,
        lambda: client.write(_engine("127.0.0.1"), args.target, args.target_addr),
    ]
    if args.warmup > 0:
        Client(store, args.warmup).put_get(4 * KiB)
    for cell in cells:
        for line in cell():
            out.write(json.dumps(line) + "\n")
    store.close()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("mode", choices=("node", "target", "client"))
    p.add_argument("--master", default="", help="host:port of mooncake_master's RPC")
    p.add_argument("--metadata", default="P2PHANDSHAKE", help="the Store's metadata server")
    p.add_argument("--segment-bytes", type=int, default=0, help="bytes the node contributes")
    p.add_argument("--target", default="", help="the target engine, ip:port")
    p.add_argument("--target-addr", type=int, default=0, help="its buffer's address")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per phase")
    p.add_argument("--warmup", type=float, default=0.0, help="untimed seconds of 4 KiB put/get")
    args = p.parse_args(argv)
    if args.mode in ("node", "client") and not args.master:
        p.error(f"{args.mode}: --master is required")
    if args.mode == "node" and args.segment_bytes <= 0:
        p.error("node: --segment-bytes must be > 0")
    if args.mode == "client" and (not args.target or args.target_addr <= 0):
        p.error("client: --target and --target-addr are required")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    # NOTE: stdout is our reply channel; the C++ side may print, so its fd 1 goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        return run(args, out)
    except CallError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        return 1
    except Exception as e:  # an API that differs: said, not a dead driver
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())

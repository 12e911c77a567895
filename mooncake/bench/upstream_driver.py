"""Upstream Mooncake's Store, measured the way `mooncake bench store` measures ours.

A standalone script run by mooncake.bench.upstream in the interpreter of an upstream venv
(scripts/upstream-venv), as `PYTHON -P upstream_driver.py node|client ...`. It imports only
the standard library, numpy and upstream's `mooncake.store` (the PyPI wheel's C++ Store):
upstream's package is also named `mooncake`, so ours can never be imported beside it, and
`-P` keeps this file's folder (inside our package) off sys.path.

    node    setup with a segment of --segment-bytes, print READY, serve until stdin's EOF
    client  setup without a segment, print READY, then per stdin line one request
            {"api", "size", "duration", "warmup"} -> one reply line: the cell's figures
            (as StoreBenchRow's) or {"error": "..."}
    load    setup without a segment, print READY, then per stdin line
            {"cmd": "prepare", "size"} -> "ready" (pre-filled), then
            {"cmd": "go", "duration"} -> one line: ClientFigures (bench/storeload.py)

The client loop is StoreBench.run's (mooncake/bench/store.py), the load loop Workload's
(mooncake/bench/storeload.py): keep each pair the same.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

RING_BYTES = 64 << 20  # bytes of values a cell keeps in the pool at most (bench.py's)
BATCH_BYTES = 64 << 20  # bytes of values per batch call at most (bench.py's)
MAX_BATCH_KEYS = 8  # keys per batch call at most (bench.py's)
LOCAL_BUFFER_BYTES = BATCH_BYTES + (16 << 20)  # the client's staging buffer: a batch fits
REMOVE_WAIT_S = 5.0  # seconds a removal may wait for the read leases to run out


class CallError(Exception):
    """An upstream call returned a failure code."""


def _check(what: str, rc: int) -> None:
    if rc != 0:
        raise CallError(f"upstream {what} returned {rc}")


def _check_len(what: str, got: int, size: int) -> None:
    if got != size:
        raise CallError(f"upstream {what} returned {got} (expected {size} bytes)")


def _pct(lat: list[float], q: float) -> float:
    return round(float(np.percentile(lat, q)) * 1e6, 1) if lat else 0.0


def _timed(fn: Callable[[], object], lat: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    lat.append(time.perf_counter() - t0)


class Cells:
    """The bench's client: one upstream Store with no segment of its own."""

    def __init__(self, store: Any):
        self.s = store
        self.seq = 0
        self.src: Any = None  # the zero-copy buffers (registered numpy arrays)
        self.dst: Any = None

    def remove(self, keys: list[str]) -> None:
        """Remove `keys`, waiting out read leases (-706) up to REMOVE_WAIT_S."""
        until = time.perf_counter() + REMOVE_WAIT_S
        while keys:
            rcs = self.s.batch_remove(keys)
            failed = [(k, rc) for k, rc in zip(keys, rcs, strict=True) if rc != 0]
            if failed and time.perf_counter() > until:
                raise CallError(
                    f"upstream batch_remove of {failed[0][0]!r} returned {failed[0][1]}"
                )
            keys = [k for k, _ in failed]
            if keys:
                time.sleep(0.01)

    def warm_up(self, seconds: float) -> None:
        value, keys = bytes(4096), list[str]()
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            keys.append(f"bench-warmup-{self.seq}-{len(keys)}")
            _check("put", self.s.put(keys[-1], value))
            _check_len("get", len(self.s.get(keys[-1])), 4096)
        self.remove(keys)

    def _zero_copy_buffers(self, size: int) -> None:
        if self.src is None or size > self.src.nbytes:
            if self.src is not None:
                _check("unregister_buffer", self.s.unregister_buffer(self.src.ctypes.data))
                _check("unregister_buffer", self.s.unregister_buffer(self.dst.ctypes.data))
            self.src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            self.dst = np.zeros(size, dtype=np.uint8)
            _check("register_buffer", self.s.register_buffer(self.src.ctypes.data, size))
            _check("register_buffer", self.s.register_buffer(self.dst.ctypes.data, size))

    def run(self, api: str, size: int, duration_s: float) -> dict[str, Any]:
        """One cell, as StoreBench.run: a put phase, then a get phase, `duration_s` each."""
        s = self.s
        per_call = max(1, min(MAX_BATCH_KEYS, BATCH_BYTES // size)) if api == "batch" else 1
        ring = max(2, RING_BYTES // (size * per_call))  # calls whose keys stay in the pool
        value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        if api == "zero-copy":
            self._zero_copy_buffers(size)
        self.seq += 1
        prefix = f"bench-{self.seq}-{api}-{size}"
        live: list[list[str]] = []

        def put(keys: list[str]) -> None:
            if api == "bytes":
                _check("put", s.put(keys[0], value))
            elif api == "zero-copy":
                _check("put_from", s.put_from(keys[0], self.src.ctypes.data, size))
            else:
                _check("put_batch", s.put_batch(keys, [value] * len(keys)))

        def get(keys: list[str]) -> None:
            if api == "bytes":
                _check_len("get", len(s.get(keys[0])), size)
            elif api == "zero-copy":
                _check_len("get_into", s.get_into(keys[0], self.dst.ctypes.data, size), size)
            else:
                for v in s.get_batch(keys):
                    _check_len("get_batch", len(v), size)

        put_lat: list[float] = []
        get_lat: list[float] = []
        i, until = 0, time.perf_counter() + duration_s
        while time.perf_counter() < until or not put_lat:
            if len(live) >= ring:
                self.remove(live.pop(0))
            keys = [f"{prefix}-{i}-{j}" for j in range(per_call)]
            _timed(functools.partial(put, keys), put_lat)
            live.append(keys)
            i += 1
        i, until = 0, time.perf_counter() + duration_s
        while time.perf_counter() < until or not get_lat:
            _timed(functools.partial(get, live[i % len(live)]), get_lat)
            i += 1
        self.remove([k for keys in live for k in keys])
        moved = size * per_call
        return {
            "api": api,
            "value_bytes": size,
            "keys_per_call": per_call,
            "put_gbps": float(f"{moved * len(put_lat) / sum(put_lat) / 1e9:.4g}"),
            "get_gbps": float(f"{moved * len(get_lat) / sum(get_lat) / 1e9:.4g}"),
            "put_p50_us": _pct(put_lat, 50),
            "put_p99_us": _pct(put_lat, 99),
            "get_p50_us": _pct(get_lat, 50),
            "get_p99_us": _pct(get_lat, 99),
            "num_puts": len(put_lat),
            "num_gets": len(get_lat),
        }


LOAD_STEPS = ("put", "exists", "get", "exists_miss", "get", "remove")  # storeload.STEPS
LOAD_OPS = ("put", "get", "exists", "remove")
RING_KEYS = 512  # storeload.RING_KEYS
PREFILL_BATCH = 64
BIN_RATIO = 1.02


class Load:
    """storeload.Workload on upstream's API: one client's loop of KV-cache calls."""

    def __init__(self, store: Any, index: int):
        self.s, self.index = store, index
        self.rng = random.Random(index)
        self.ring: list[str] = []
        self.next = 0
        self.value = b""
        self.prefix = ""

    def _new_key(self) -> str:
        self.next += 1
        return f"{self.prefix}-{self.next}"

    def prepare(self, size: int) -> None:
        self.value, self.prefix = bytes(size), f"load-{self.index}-{time.monotonic_ns()}"
        while len(self.ring) < RING_KEYS:
            keys = [self._new_key() for _ in range(min(PREFILL_BATCH, RING_KEYS - len(self.ring)))]
            _check("put_batch", self.s.put_batch(keys, [self.value] * len(keys)))
            self.ring += keys

    def _step(self, step: str) -> str:
        s, ring = self.s, self.ring
        if step == "put":
            key = self._new_key()
            _check("put", s.put(key, self.value))
            ring.append(key)
            return "put"
        if step == "remove":
            Cells(s).remove([ring.pop(0)])
            return "remove"
        if step == "exists_miss":
            if s.is_exist(f"{self.prefix}-missing-{self.next}") != 0:
                raise CallError("upstream is_exist of a key nobody stored did not return 0")
            return "exists"
        key = ring[self.rng.randrange(len(ring) // 2, len(ring))]
        if step == "exists":
            if s.is_exist(key) != 1:
                raise CallError(f"upstream is_exist of {key!r} did not return 1")
            return "exists"
        _check_len("get", len(s.get(key)), len(self.value))
        return "get"

    def run(self, duration_s: float) -> dict[str, Any]:
        ops = dict.fromkeys(LOAD_OPS, 0)
        hist: dict[str, dict[int, int]] = {op: {} for op in LOAD_OPS}
        clock, i, log_ratio = time.perf_counter, 0, math.log(BIN_RATIO)
        start = clock()
        until = start + duration_s
        while True:
            t0 = clock()
            if t0 >= until:
                break
            op = self._step(LOAD_STEPS[i % len(LOAD_STEPS)])
            b = max(0, int(math.log(max((clock() - t0) * 1e6, 1.0)) / log_ratio))
            hist[op][b] = hist[op].get(b, 0) + 1
            ops[op] += 1
            i += 1
        seconds = clock() - start
        Cells(self.s).remove(self.ring)
        self.ring = []
        return {"ops": ops, "hist": hist, "seconds": seconds}


def _answer_load(load: Load, line: str) -> str:
    try:
        req = json.loads(line)
        if req["cmd"] == "prepare":
            load.prepare(int(req["size"]))
            return "ready"
        return json.dumps(load.run(float(req["duration"])))
    except (ValueError, KeyError, TypeError) as e:
        return json.dumps({"error": f"bad request {line.strip()!r}: {e!r}"})
    except CallError as e:
        return json.dumps({"error": str(e)})
    except Exception as e:  # an API that changed under us: said, not a dead driver
        return json.dumps({"error": f"{e!r}"})


def _answer(cells: Cells, line: str) -> dict[str, Any]:
    try:
        req = json.loads(line)
        api, size = req["api"], int(req["size"])
        duration, warmup = float(req["duration"]), float(req["warmup"])
    except (ValueError, KeyError, TypeError) as e:
        return {"error": f"bad request {line.strip()!r}: {e!r}"}
    if api not in ("bytes", "zero-copy", "batch") or size <= 0 or duration < 0 or warmup < 0:
        return {"error": f"bad request {line.strip()!r}"}
    try:
        if warmup > 0:
            cells.warm_up(warmup)
        return cells.run(api, size, duration)
    except CallError as e:
        return {"error": str(e)}
    except Exception as e:  # an API that changed under us: said, not a dead driver
        return {"error": f"{e!r}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("node", "client", "load"))
    p.add_argument("--index", type=int, default=0, help="load: this client's number (its seed)")
    p.add_argument("--master", required=True, help="host:port of mooncake_master's RPC")
    p.add_argument("--metadata", required=True, help="URL of the HTTP metadata server")
    p.add_argument("--segment-bytes", type=int, default=0, help="bytes the node contributes")
    args = p.parse_args()
    # NOTE: stdout is our reply channel; the C++ side may print, so its fd 1 goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # upstream's package; by name, so that a type checker never confuses it with ours
    module = importlib.import_module("mooncake.store")
    if not str(module.__file__).endswith(".so"):  # ours has one too (store/upstream/)
        raise ImportError(
            f"MooncakeDistributedStore of {module.__file__} is not upstream's C++ one"
        )
    store = module.MooncakeDistributedStore()
    segment = args.segment_bytes if args.mode == "node" else 0
    rc = store.setup(
        "127.0.0.1", args.metadata, segment, LOCAL_BUFFER_BYTES, "tcp", "", args.master
    )
    if rc != 0:
        out.write(json.dumps({"error": f"upstream setup returned {rc}"}) + "\n")
        return 1
    out.write("READY\n")
    if args.mode == "node":
        sys.stdin.read()  # serve until the parent closes our stdin
    elif args.mode == "load":
        load = Load(store, args.index)
        for line in sys.stdin:
            out.write(_answer_load(load, line) + "\n")
    else:
        cells = Cells(store)
        for line in sys.stdin:
            out.write(json.dumps(_answer(cells, line)) + "\n")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`mooncake bench rpc`: authenticated RPC echo latency against a raw TCP ping-pong baseline."""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import typer

from mooncake.cli.app import bench_app
from mooncake.errors import MooncakeError

DEFAULT_SPIN_US = 0.0  # the RpcClient default, repeated to keep `mooncake` start-up light

_CHILD = "from mooncake.cli.bench_rpc import serve_child; serve_child()"
_BENCH_SECRET = b"mooncake-bench-rpc-secret-not-for-production"


@bench_app.command("rpc")
def bench_rpc(
    iterations: int = typer.Option(
        20000, "--iterations", "-n", min=100, help="Timed round trips per measurement."
    ),
    warmup: int = typer.Option(
        2000, "--warmup", min=0, help="Untimed round trips before each measurement."
    ),
    payload_bytes: int = typer.Option(
        64, "--payload-bytes", min=0, help="Bytes of payload in each echo message."
    ),
    no_auth: bool = typer.Option(
        False, "--no-auth", help="Also measure RPC without CURVE, to show what security costs."
    ),
    spin_us: float = typer.Option(
        DEFAULT_SPIN_US,
        "--spin-us",
        min=0,
        help="Microseconds the client busy-waits for each reply before sleeping (0: never).",
    ),
    repeats: int = typer.Option(
        1,
        "--repeats",
        min=1,
        help="Measure each transport this many times, interleaved, and report the medians "
        "(steadier on a machine shared with other work).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Measure control-plane RPC round-trip latency (p50/p90/p99 in microseconds, calls/s).

    A server runs in a separate process on 127.0.0.1 and echoes a small message; this
    process calls it `--iterations` times after a warm-up, over CURVE with the cluster-secret
    handshake. In the same run, a raw Python TCP socket ping-pong between two processes with
    the same message size gives the baseline; `ratio` is RPC p50 / baseline p50.
    """
    import msgspec

    from mooncake.cli.output import console, print_json
    from mooncake.rpc import wire

    frame_bytes = len(
        wire.encode_frame(
            msgspec.msgpack.Encoder(), wire.KIND_REQUEST, 1, _echo_type()(b"x" * payload_bytes)
        )
    )
    runs: dict[str, list[dict[str, float]]] = {"rpc": [], "rpc_no_auth": [], "baseline": []}
    for _ in range(repeats):
        runs["rpc"].append(_measure_rpc(_BENCH_SECRET, iterations, warmup, payload_bytes, spin_us))
        if no_auth:
            runs["rpc_no_auth"].append(
                _measure_rpc(None, iterations, warmup, payload_bytes, spin_us)
            )
        runs["baseline"].append(_measure_tcp(iterations, warmup, frame_bytes))
    rows = {name: _median(stats) for name, stats in runs.items() if stats}
    result: dict[str, Any] = {
        "iterations": iterations,
        "repeats": repeats,
        "message_bytes": frame_bytes,
        "auth": "curve",
        "spin_us": spin_us,
    }
    for name, row in rows.items():
        result.update({f"{name}_{key}": round(value, 1) for key, value in row.items()})
    result["ratio"] = round(rows["rpc"]["p50_us"] / rows["baseline"]["p50_us"], 2)
    if as_json:
        print_json(result)
        return
    from rich.table import Table

    title = f"RPC echo, {frame_bytes}-byte messages, {iterations} round trips"
    table = Table(title=title + (f", median of {repeats} runs" if repeats > 1 else ""))
    table.add_column("transport")
    for col in ("p50 us", "p90 us", "p99 us", "calls/s"):
        table.add_column(col, justify="right")
    labels = {
        "rpc": "RPC, CURVE authenticated",
        "rpc_no_auth": "RPC, no auth",
        "baseline": "raw TCP ping-pong",
    }
    for name, row in rows.items():
        table.add_row(
            labels[name],
            f"{row['p50_us']:.1f}",
            f"{row['p90_us']:.1f}",
            f"{row['p99_us']:.1f}",
            f"{row['calls_per_s']:,.0f}",
        )
    console.print(table)
    console.print(f"ratio (RPC p50 / baseline p50): {result['ratio']:.2f}")


def _stats(samples_ns: list[int], elapsed_s: float) -> dict[str, float]:
    samples_ns.sort()
    n = len(samples_ns)
    pick = lambda q: samples_ns[min(n - 1, int(q * n))] / 1000  # noqa: E731
    return {
        "p50_us": pick(0.5),
        "p90_us": pick(0.9),
        "p99_us": pick(0.99),
        "calls_per_s": n / elapsed_s,
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _start_child(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start a server child; returns it and the address it printed once ready (the handshake)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    address = child.stdout.readline().strip()
    if not address:
        child.kill()
        raise MooncakeError(f"the bench server exited with code {child.wait()} before it was ready")
    return child, address


def _stop_child(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()  # the child exits when its stdin closes
    child.wait(10)


def _measure_rpc(
    secret: bytes | None, iterations: int, warmup: int, payload_bytes: int, spin_us: float
) -> dict[str, float]:
    from mooncake.rpc import RpcClient

    child, address = _start_child("rpc", "auth" if secret else "none")
    try:
        client = RpcClient(address, secret, timeout_s=10.0, spin_us=spin_us)
        echo_type = _echo_type()
        msg = echo_type(b"x" * payload_bytes)
        call, clock = client.call, time.perf_counter_ns
        for _ in range(warmup):
            call(msg, echo_type)
        samples = [0] * iterations
        start = time.perf_counter()
        for i in range(iterations):
            t0 = clock()
            call(msg, echo_type)
            samples[i] = clock() - t0
        elapsed = time.perf_counter() - start
        client.close()
    finally:
        _stop_child(child)
    return _stats(samples, elapsed)


def _measure_tcp(iterations: int, warmup: int, size: int) -> dict[str, float]:
    import socket

    child, address = _start_child("tcp", str(size))
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, buf = b"x" * size, bytearray(size)
        clock = time.perf_counter_ns

        def round_trip() -> None:
            sock.sendall(msg)
            got = 0
            while got < size:
                got += sock.recv_into(memoryview(buf)[got:])

        for _ in range(warmup):
            round_trip()
        samples = [0] * iterations
        start = time.perf_counter()
        for i in range(iterations):
            t0 = clock()
            round_trip()
            samples[i] = clock() - t0
        elapsed = time.perf_counter() - start
        sock.close()
    finally:
        _stop_child(child)
    return _stats(samples, elapsed)


def serve_child() -> None:
    """Child process: serve `rpc auth|none` or `tcp SIZE`, print the address, exit on stdin EOF."""
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "rpc":
        from mooncake.rpc import RpcServer

        server = RpcServer("tcp://127.0.0.1:0", _BENCH_SECRET if arg == "auth" else None)
        server.register(_echo_type(), lambda msg, peer: msg)
        server.start()
        print(server.address, flush=True)
        sys.stdin.read()
        server.stop()
        return
    import socket
    import threading

    size = int(arg)
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def echo() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        while True:
            got = 0
            while got < size:
                n = conn.recv_into(memoryview(buf)[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(buf)

    threading.Thread(target=echo, daemon=True).start()
    sys.stdin.read()


@functools.cache
def _echo_type() -> Any:
    """The echoed message type, defined on first use to keep `mooncake` start-up light."""
    from mooncake.rpc import Msg

    class BenchEchoMsg(Msg, frozen=True, tag="bench.echo"):
        payload: bytes  # opaque bytes, --payload-bytes long

    return BenchEchoMsg

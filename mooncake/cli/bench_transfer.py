"""`mooncake bench transfer`: Transfer Engine throughput and batch latency against a baseline
measured in the same run (a socket stream for tcp/rdma, a memcpy for shm)."""

from __future__ import annotations

import typer

from mooncake.cli.app import bench_app
from mooncake.errors import ConfigError, TransferError


def _size(text: str, what: str) -> int:
    from mooncake.config.sizes import parse_size

    value = parse_size(text)
    if value <= 0:
        raise ConfigError(f"{what}: expected a size > 0, got {text!r}")
    return value


@bench_app.command("transfer")
def bench_transfer(
    mode: str = typer.Option(
        "initiator", "--mode", help="target: serve a segment and wait; initiator: drive a target."
    ),
    local: bool = typer.Option(
        False, "--local", help="Start the target process here on 127.0.0.1 (one-machine run)."
    ),
    target: str = typer.Option(
        "", "--target", help="HOST:PORT of a running target (initiator mode without --local)."
    ),
    host: str = typer.Option("0.0.0.0", "--host", help="Address the target listens on."),
    port: int = typer.Option(0, "--port", help="Port the target listens on (0 = any free one)."),
    protocol: str = typer.Option("tcp", "--protocol", help="tcp, shm, rdma or auto."),
    op: str = typer.Option("write", "--op", help="read (pull from the target) or write (push)."),
    block_size: str = typer.Option(
        "1MiB", "--block-size", help="Bytes per request, e.g. 64KiB, 1MiB, 16MiB."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="Requests per batch."),
    threads: int = typer.Option(
        2, "--threads", min=1, help="Initiator threads, each with its own batches."
    ),
    duration: float = typer.Option(5.0, "--duration", min=0.1, help="Seconds to measure."),
    slice_size: str = typer.Option(
        "64KiB", "--slice-size", help="Bytes per slice (the [transfer] slice_bytes default)."
    ),
    connections: int = typer.Option(
        4, "--connections", min=1, max=64, help="Connections (or queue pairs) per path."
    ),
    group_size: str = typer.Option(
        "", "--group-size", help="Bytes of slices a TCP connection sends before reading replies."
    ),
    scatter: bool = typer.Option(
        False,
        "--scatter",
        help="Place the blocks of a batch apart (no two adjacent), so every request is its "
        "own wire operation; default: adjacent blocks, which the tcp transport coalesces.",
    ),
    buffer_size: str = typer.Option(
        "", "--buffer-size", help="Target segment size (default: threads x batch x block, >= 1MiB)."
    ),
    secret: str = typer.Option(
        "",
        "--secret",
        envvar="MOONCAKE_CLUSTER_SECRET",
        help="Cluster secret shared by target and initiator (random with --local).",
    ),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="Skip the baseline measurement."),
    busy_target: bool = typer.Option(
        False,
        "--busy-target",
        help="With --local: the target also runs a pure-Python thread all along, as a model "
        "node's engine thread does; reports the share of its speed it kept "
        "(target_busy_share), and the figures show whether serving waits for the GIL.",
    ),
    nics: str = typer.Option(
        "",
        "--nics",
        help="Comma-separated RDMA devices the initiator (and a --local or --mode target "
        "target) use, as transfer.nics; empty = every usable one.",
    ),
    stub_device: bool = typer.Option(
        False,
        "--stub-device",
        help="Measure the RDMA path's stub ceiling instead (no NIC, no target): slices per "
        "second and CPU per slice of the C data loop (c), of the RdmaTransport over it "
        "(transport) and of the Python path (python) in this process, with a device that "
        "completes every work request at once; --duration is shared by the 4 cases x 3 "
        "paths.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Measure one-sided transfers (GB/s, requests/s, p50/p99 batch latency, peak RSS).

    Modelled on upstream's transfer_engine_bench. Run `--mode target` on one node and
    `--mode initiator --target HOST:PORT` on another, or `--local` to start the target as a
    second process on this machine. The same run measures a baseline in windows interleaved
    with the transfer's (so both see the same machine load), moving blocks between buffers
    of one batch's size as the transfer does: a plain two-process Python socket stream (tcp,
    rdma) or a single-threaded memcpy (shm); `ratio` is gbps / baseline_gbps.
    """
    from mooncake.bench import transfer as bench
    from mooncake.bench.transferbase import MemcpyBaseline, StreamBaseline
    from mooncake.cli.output import console, err_console, print_json

    if stub_device:
        _stub_ceiling(duration, as_json)
        return
    if mode not in ("target", "initiator"):
        raise ConfigError(f"--mode: expected target or initiator, got {mode!r}")
    if protocol not in ("tcp", "shm", "rdma", "auto"):
        raise ConfigError(f"--protocol: expected tcp, shm, rdma or auto, got {protocol!r}")
    if op not in ("read", "write"):
        raise ConfigError(f"--op: expected read or write, got {op!r}")
    nic_list = tuple(n.strip() for n in nics.split(",") if n.strip())
    block = _size(block_size, "--block-size")
    span = block * batch_size
    slice_bytes = _size(slice_size, "--slice-size")
    buffer_bytes = (
        _size(buffer_size, "--buffer-size")
        if buffer_size
        else max(span * threads * (2 if scatter else 1), 1 << 20)
    )
    key = secret.encode() if secret else b""
    if mode == "target":
        if len(key) < 16:
            raise ConfigError("--secret (or MOONCAKE_CLUSTER_SECRET): need >= 16 characters")
        err_console.print(
            f"serving segment '{bench.SEGMENT}' ({buffer_bytes} bytes) on {host}:{port}"
        )
        bench.serve_target(key, host, port, buffer_bytes, None, nics=nic_list)
        return
    if busy_target and not local:
        raise ConfigError("--busy-target needs --local: the bench starts that target itself")
    proc = pipe = None
    if local:
        key = key or bench.new_secret()
        proc, pipe, thost, tport = bench.start_local_target(
            key, buffer_bytes, busy_target, nic_list
        )
    else:
        thost, _, tport_text = target.rpartition(":")
        if not thost or not tport_text.isdigit() or len(key) < 16:
            raise ConfigError("initiator: give --local, or --target HOST:PORT and --secret")
        tport = int(tport_text)
    group_bytes = _size(group_size, "--group-size") if group_size else 0
    ini = baseline = None
    try:
        ini = bench.Initiator(
            key,
            thost,
            tport,
            protocol,
            op,
            block,
            batch_size,
            threads,
            slice_bytes,
            connections,
            group_bytes,
            scatter,
            nic_list,
        )
        if not no_baseline:
            uses_copy = ini.target.transport.name in ("shm", "local")
            baseline = MemcpyBaseline(block, span) if uses_copy else StreamBaseline(block, span)
        result = bench.run_bench(ini, duration, baseline)
    except ValueError as e:
        raise TransferError(str(e)) from e
    finally:
        if ini is not None:
            ini.engine.close()
        if baseline is not None:
            baseline.close()
        if pipe is not None and proc is not None:
            pipe.send("stop")
            target_peak, busy_share = pipe.recv() if pipe.poll(10) else (0, 0.0)
            proc.join(10)
    if local:
        result.target_rss_peak_bytes = target_peak
        result.target_busy_share = round(busy_share, 3)
    used = result.protocol
    if as_json:
        print_json(result)
        return
    from rich.table import Table

    title = (
        f"transfer {op} over {used}: {block} B blocks x {batch_size} per batch"
        f"{' (scattered)' if scatter else ''}, "
        f"{threads} threads, {result.duration_s:.1f} s ({bench.cpu_note()})"
    )
    table = Table(title=title)
    baseline_col = f"{result.baseline or 'baseline'} GB/s"
    columns = ("GB/s", "requests/s", "p50 us", "p99 us", baseline_col, "ratio", "retries")
    busy_cols = ("target busy thread kept",) if busy_target else ()
    for col in (*columns, "RSS start/end/peak MiB", "target peak MiB", *busy_cols):
        table.add_column(col, justify="right")
    mib = 1 << 20
    table.add_row(
        f"{result.gbps:.2f}",
        f"{result.requests_per_s:,.0f}",
        f"{result.p50_us:,.0f}",
        f"{result.p99_us:,.0f}",
        f"{result.baseline_gbps:.2f}",
        f"{result.ratio:.2f}",
        str(result.num_retries),
        "/".join(
            str(n // mib)
            for n in (result.rss_start_bytes, result.rss_end_bytes, result.rss_peak_bytes)
        ),
        str(result.target_rss_peak_bytes // mib) if result.target_rss_peak_bytes else "-",
        *([f"{result.target_busy_share:.0%}"] if busy_target else []),
    )
    console.print(table)


def _stub_ceiling(duration: float, as_json: bool) -> None:
    from mooncake.bench import transferstub
    from mooncake.cli.output import console, print_json

    per_case = max(0.2, duration / (3 * len(transferstub.CASES)))
    report = transferstub.run(per_case)
    if as_json:
        print_json(report)
        return
    from rich.table import Table

    where = "pyverbs' SGE/SendWR/WC" if report.pyverbs else "stand-in SGE/SendWR/WC"
    table = Table(title=f"RDMA stub ceiling, device stubbed ({where}; {report.cpu})")
    for col in ("path", "case", "slices/s", "CPU us/slice", "GB/s", "requests/s", "in flight"):
        table.add_column(col, justify="right")
    for f in report.figures:
        table.add_row(
            f.path,
            f.case,
            f"{f.slices_per_s:,.0f}",
            f"{f.cpu_us_per_slice:.3f}",
            f"{f.gb_per_s:.1f}",
            f"{f.requests_per_s:,.0f}",
            str(f.in_flight),
        )
    console.print(table)
    console.print(
        f"C loop: {report.c_cpu_us_per_64k_slice:.3f} us CPU per 64 KiB slice (target <= 0.5), "
        f"busy thread keeps {report.c_busy_thread_share:.0%} of its rate at "
        f"{report.c_busy_thread_cpu_share:.0%} of its CPU per slice (it holds one of "
        f"{report.num_cpus} CPUs), {report.c_blocks_requests_per_s:,.0f} KV-block requests/s "
        "(target >= 1M)"
    )

"""`mooncake bench store`: put/get GB/s and p50/p99 latency of the Store client API."""

from __future__ import annotations

import typer

from mooncake.cli.app import bench_app
from mooncake.errors import ConfigError
from mooncake.transfer.types import EngineOptions


@bench_app.command("store")
def bench_store(
    local: bool = typer.Option(
        False,
        "--local",
        help="Start a master and one store node as child processes on 127.0.0.1 (one-machine "
        "run); the client is this process, with no segment beyond its registered buffers.",
    ),
    master: str = typer.Option(
        "", "--master", help="RPC address of a running master, e.g. tcp://10.0.0.1:7100."
    ),
    secret: str = typer.Option(
        "",
        "--secret",
        envvar="MOONCAKE_CLUSTER_SECRET",
        help="Cluster secret (random with --local).",
    ),
    sizes: str = typer.Option(
        "4KiB,64KiB,1MiB,16MiB", "--sizes", help="Comma-separated value sizes, e.g. 4KiB,1MiB."
    ),
    apis: str = typer.Option(
        "bytes,zero-copy,batch",
        "--apis",
        help="Comma-separated APIs: bytes (put/get), zero-copy (put_from/get_into on "
        "registered buffers), batch (put_batch/get_batch).",
    ),
    duration: float = typer.Option(
        2.0, "--duration", min=0.05, help="Seconds of the put phase and of the get phase per cell."
    ),
    protocol: str = typer.Option(
        "tcp",
        "--protocol",
        help="tcp: reach the node as if it were on another host; auto: let a same-host node "
        "be read and written through shared memory.",
    ),
    warmup: float = typer.Option(
        2.0,
        "--warmup",
        min=0.0,
        help="Untimed seconds of 4 KiB puts and gets before the first "
        "cell (freshly started processes run slower for their first seconds).",
    ),
    spin_us: float = typer.Option(
        EngineOptions.spin_us,
        "--spin-us",
        min=0.0,
        max=10000.0,
        help="Microseconds the client polls for a reply before it sleeps ([transfer] "
        "spin_us); 0 sleeps at once.",
    ),
    repeat: int = typer.Option(
        1,
        "--repeat",
        min=1,
        max=100,
        help="Measure every cell this many times, in rounds "
        "(each round goes through every cell), and report each figure's median over them.",
    ),
    pool_size: str = typer.Option(
        "512MiB", "--pool-size", help="DRAM tier of the --local store node."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print a JSON list of rows (one per API and size) instead of a table."
    ),
) -> None:
    """Measure Store put and get: GB/s and p50/p99 latency per API and value size.

    For each API and size, a put phase writes fresh keys for --duration seconds (keeping at
    most 64 MiB of them in the pool; older ones are removed, untimed), then a get phase reads
    them back for --duration seconds. GB/s is value bytes over summed call time; latency is
    per call (per batch call for the batch API). With --repeat N, each figure is the median
    of N measurements taken in rounds. The table quotes upstream Mooncake 0.3.13's
    figures from PAPER.md as a reference: measured elsewhere, not a baseline of this run.
    """
    from mooncake.cli.output import console, print_json
    from mooncake.config import parse_size
    from mooncake.store import bench
    from mooncake.store.localproc import LocalCluster
    from mooncake.transfer.bench import cpu_note, new_secret

    if protocol not in ("tcp", "auto"):
        raise ConfigError(f"--protocol: expected tcp or auto, got {protocol!r}")
    api_list = [a.strip() for a in apis.split(",") if a.strip()]
    if bad := [a for a in api_list if a not in bench.APIS]:
        raise ConfigError(f"--apis: unknown {', '.join(bad)}; choose from {', '.join(bench.APIS)}")
    size_list = [parse_size(t.strip()) for t in sizes.split(",") if t.strip()]
    if not size_list or min(size_list) <= 0:
        raise ConfigError(f"--sizes: expected sizes > 0, got {sizes!r}")
    key = secret.encode()
    cluster = None
    if local:
        key = key or new_secret()
        cluster = LocalCluster(key, parse_size(pool_size))
        master, segment = (
            cluster.master_address,
            bench.node_segment(LocalCluster.NODE_ID, cluster.node_endpoint),
        )
    elif not master or len(key) < 16:
        raise ConfigError("give --local, or --master ADDRESS and --secret (>= 16 characters)")
    else:
        segment = ""
    cells = [(api, size) for api in api_list for size in size_list]
    runs: dict[tuple[str, int], list[bench.StoreBenchRow]] = {cell: [] for cell in cells}
    try:
        runner = bench.StoreBench(master, key, protocol, segment, spin_us=spin_us)
        try:
            runner.warm_up(warmup)
            for _ in range(repeat):
                for api, size in cells:
                    runs[api, size].append(runner.run(api, size, duration))  # type: ignore[arg-type]
            rows = [bench.median_row(runs[cell]) for cell in cells]
        finally:
            runner.close()
    finally:
        if cluster is not None:
            cluster.stop()
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    medians = f", medians of {repeat} rounds" if repeat > 1 else ""
    table = Table(title=f"store put/get, --protocol {protocol}, {duration:g} s per phase"
                        f"{medians} ({cpu_note()})")  # fmt: skip
    cols = ("api", "value", "keys/call", "via", "put GB/s", "get GB/s", "put p50/p99 us",
            "get p50/p99 us", "socket p50 w/r us (same run)",
            "upstream 0.3.13 (PAPER.md, not this run)")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("api", "via") else "right")
    for r in rows:
        ref = bench.UPSTREAM_0_3_13.get((r.api, r.value_bytes))
        ref_text = "-"
        if ref is not None:
            gbps = f"{ref[0]}/{ref[1]} GB/s" if ref[0] is not None else ""
            p50 = f"p50 {ref[2]:g}/{ref[3]:g} us" if ref[2] is not None else ""
            ref_text = gbps or p50
        table.add_row(
            r.api, _human(r.value_bytes), str(r.keys_per_call), r.protocol,
            f"{r.put_gbps:.2f}", f"{r.get_gbps:.2f}",
            f"{r.put_p50_us:,.0f}/{r.put_p99_us:,.0f}", f"{r.get_p50_us:,.0f}/{r.get_p99_us:,.0f}",
            f"{r.socket_put_p50_us:,.0f}/{r.socket_get_p50_us:,.0f}",
            ref_text,
        )  # fmt: skip
    console.print(table)


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"

"""`mooncake bench store`: put/get GB/s and p50/p99 latency of the Store client API."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app
from mooncake.errors import ConfigError
from mooncake.transfer.types import EngineOptions

if TYPE_CHECKING:
    from rich.table import Table

    from mooncake.bench.store import StoreBenchRow


@bench_app.command("store")
def bench_store(
    local: bool = typer.Option(
        False,
        "--local",
        help="Start a master and one store node as child processes on 127.0.0.1 (one-machine "
        "run); the client is this process, with no segment beyond its registered buffers.",
    ),
    master: str = typer.Option(
        "",
        "--master",
        help="host:port of a running master's control plane, the value of its cluster.master "
        "(e.g. 10.0.0.1:50051; tcp://10.0.0.1:50051 is accepted too).",
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
    upstream: str = typer.Option(
        "",
        "--upstream",
        envvar="MOONCAKE_UPSTREAM_PYTHON",
        help="Python of a venv with upstream Mooncake 0.3.13 (scripts/upstream-venv makes "
        "one): also run upstream's C++ Store (its master, a store node of --pool-size and a "
        "client, over tcp on 127.0.0.1), each cell right after ours, and report its figures "
        "in the same rows. Needs --local: a remote cluster has no upstream twin.",
    ),
    clients: str = typer.Option(
        "",
        "--clients",
        help="Comma-separated client counts, e.g. 8,32: measure the master's metadata "
        "operations per second instead (N client processes of small puts, gets, exists and "
        "removes against one local master per --journals entry; with --upstream, against "
        "upstream's mooncake_master too). Implies --local; --apis and --sizes do not apply.",
    ),
    journals: str = typer.Option(
        "file,etcd",
        "--journals",
        help="With --clients: our masters to load, comma-separated: none, file (a journal "
        "file), etcd (a local one-member etcd on tmpfs, group commit as [cluster] sets it); "
        "etcdN and etcdNwM set it: N groups in flight, an M ms window (e.g. etcd4, etcd1w0.5).",
    ),
    value_size: str = typer.Option("512B", "--value-size", help="With --clients: bytes per value."),
    profile: str = typer.Option(
        "",
        "--profile",
        help="With --clients: a folder where py-spy writes each master of ours' collapsed "
        "stacks while its clients run (needs py-spy); the top entries are printed.",
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
    of N measurements taken in rounds. With --upstream, upstream Mooncake's Store is
    measured the same way in the same run (cell by cell, interleaved with ours, so both see
    the same load); without it, the table quotes upstream Mooncake 0.3.13's figures from
    PAPER.md as a reference: measured elsewhere, not a baseline of this run.
    """
    import contextlib

    import msgspec

    from mooncake.bench import store as bench
    from mooncake.bench.storeprocs import LocalCluster
    from mooncake.bench.transfer import cpu_note, new_secret
    from mooncake.bench.upstream import UpstreamStore
    from mooncake.cli.output import console, print_json
    from mooncake.config.sizes import parse_size

    if clients:
        return _bench_load(
            clients, journals, value_size, duration, pool_size, upstream, profile, secret, as_json
        )
    if protocol not in ("tcp", "auto"):
        raise ConfigError(f"--protocol: expected tcp or auto, got {protocol!r}")
    api_list = [a.strip() for a in apis.split(",") if a.strip()]
    if bad := [a for a in api_list if a not in bench.APIS]:
        raise ConfigError(f"--apis: unknown {', '.join(bad)}; choose from {', '.join(bench.APIS)}")
    size_list = [parse_size(t.strip()) for t in sizes.split(",") if t.strip()]
    if not size_list or min(size_list) <= 0:
        raise ConfigError(f"--sizes: expected sizes > 0, got {sizes!r}")
    if upstream and not local:
        raise ConfigError(
            "--upstream needs --local (upstream's Store runs on this machine "
            "beside a local cluster of ours, not beside a remote --master)"
        )
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
        master = master if master.startswith("tcp://") else f"tcp://{master}"
    cells = [(api, size) for api in api_list for size in size_list]
    runs: dict[tuple[str, int], list[bench.StoreBenchRow]] = {cell: [] for cell in cells}
    with contextlib.ExitStack() as stack:
        if cluster is not None:
            stack.callback(cluster.stop)
        twin = (
            stack.enter_context(UpstreamStore(upstream, parse_size(pool_size)))
            if upstream
            else None
        )
        runner = bench.StoreBench(master, key, protocol, segment, spin_us=spin_us)
        stack.callback(runner.close)
        runner.warm_up(warmup)
        twin_warmup = warmup  # upstream's warm-up: before its first cell
        for _ in range(repeat):
            for api, size in cells:
                row = runner.run(api, size, duration)  # type: ignore[arg-type]
                if twin is not None:  # right after ours: the same load
                    up = twin.run(api, size, duration, warmup_s=twin_warmup)
                    twin_warmup = 0.0
                    row = msgspec.structs.replace(
                        row,
                        upstream_put_gbps=up.put_gbps,
                        upstream_get_gbps=up.get_gbps,
                        upstream_put_p50_us=up.put_p50_us,
                        upstream_get_p50_us=up.get_p50_us,
                    )
                runs[api, size].append(row)
        rows = [bench.median_row(runs[cell]) for cell in cells]
    if as_json:
        print_json(rows)
        return
    medians = f", medians of {repeat} rounds" if repeat > 1 else ""
    console.print(
        _table(
            rows,
            f"store put/get, --protocol {protocol}, {duration:g} s per "
            f"phase{medians} ({cpu_note()})",
            has_upstream=bool(upstream),
        )
    )


def _table(rows: list[StoreBenchRow], title: str, has_upstream: bool) -> Table:
    """Our figures per row, then upstream's: measured in this run (--upstream) with
    our/upstream GB/s ratios, or else the reference quoted from PAPER.md."""
    from rich.table import Table

    from mooncake.bench.store import UPSTREAM_0_3_13

    table = Table(title=title)
    cols = [
        "api",
        "value",
        "keys/call",
        "via",
        "put GB/s",
        "get GB/s",
        "put p50/p99 us",
        "get p50/p99 us",
        "socket p50 w/r us (same run)",
    ]
    if has_upstream:
        cols += [
            "upstream put/get GB/s (same run)",
            "upstream p50 put/get us",
            "ours/upstream put/get GB/s",
        ]
    else:
        cols += ["upstream 0.3.13 (PAPER.md, not this run)"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("api", "via") else "right")
    for r in rows:
        cells = [
            r.api,
            _human(r.value_bytes),
            str(r.keys_per_call),
            r.protocol,
            f"{r.put_gbps:.2f}",
            f"{r.get_gbps:.2f}",
            f"{r.put_p50_us:,.0f}/{r.put_p99_us:,.0f}",
            f"{r.get_p50_us:,.0f}/{r.get_p99_us:,.0f}",
            f"{r.socket_put_p50_us:,.0f}/{r.socket_get_p50_us:,.0f}",
        ]
        if has_upstream:
            cells += [
                f"{r.upstream_put_gbps:.2f}/{r.upstream_get_gbps:.2f}",
                f"{r.upstream_put_p50_us:,.0f}/{r.upstream_get_p50_us:,.0f}",
                f"{_ratio(r.put_gbps, r.upstream_put_gbps)}/"
                f"{_ratio(r.get_gbps, r.upstream_get_gbps)}",
            ]
        else:
            ref = UPSTREAM_0_3_13.get((r.api, r.value_bytes))
            ref_text = "-"
            if ref is not None:
                gbps = f"{ref[0]}/{ref[1]} GB/s" if ref[0] is not None else ""
                p50 = f"p50 {ref[2]:g}/{ref[3]:g} us" if ref[2] is not None else ""
                ref_text = gbps or p50
            cells.append(ref_text)
        table.add_row(*cells)
    return table


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if ours > 0 and theirs > 0 else "-"


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _bench_load(
    clients: str,
    journals: str,
    value_size: str,
    duration: float,
    pool_size: str,
    upstream: str,
    profile: str,
    secret: str,
    as_json: bool,
) -> None:
    """`bench store --clients`: the master's metadata operations per second."""
    from pathlib import Path

    from rich.table import Table

    from mooncake.bench.storeloadrun import LoadPlan, busy_share, run_load, top_entries
    from mooncake.bench.transfer import cpu_note, new_secret
    from mooncake.cli.output import console, print_json
    from mooncake.config.sizes import parse_size

    try:
        counts = tuple(int(t) for t in clients.split(",") if t.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1 or max(counts) > 256:
        raise ConfigError(f"--clients: expected counts from 1 to 256, e.g. 8,32; got {clients!r}")
    plan = LoadPlan(
        clients=counts,
        journals=tuple(j.strip() for j in journals.split(",") if j.strip()),
        value_bytes=parse_size(value_size),
        duration_s=duration,
        pool_bytes=parse_size(pool_size),
        upstream=upstream,
        profile_dir=profile,
    )
    rows = run_load(plan, secret.encode() or new_secret())
    if as_json:
        print_json(rows)
        return
    table = Table(
        title=f"master metadata ops, {plan.value_bytes} B values, {duration:g} s ({cpu_note()})"
    )
    cols = (
        "master",
        "clients",
        "ops/s",
        "p50/p99 us",
        "put/get/exists/remove ops/s",
        "master cores",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "master" else "right")
    table.add_column("vs upstream (same run)", justify="right")
    ups = {r.clients: r.ops_per_s for r in rows if r.master == "upstream"}
    for r in rows:
        up = ups.get(r.clients, 0.0)
        table.add_row(
            r.master,
            str(r.clients),
            f"{r.ops_per_s:,.0f}",
            f"{r.p50_us:,.0f}/{r.p99_us:,.0f}",
            "/".join(f"{r.op_ops_per_s[op]:,.0f}" for op in ("put", "get", "exists", "remove")),
            f"{r.master_cores:.2f}",
            f"{r.ops_per_s / up:.2f}x" if up and r.master != "upstream" else "-",
        )
    console.print(table)
    for path in sorted(Path(profile).glob("ours-*.txt")) if profile else []:
        busy = busy_share(path, duration)
        console.print(
            f"[bold]{path}[/]: the master held the GIL {busy:.0%} of the run; top entries "
            "(own share / on stack, of its samples)"
        )
        for fn, own, total in top_entries(path):
            console.print(f"  {own:6.1%} {total:6.1%}  {fn}")

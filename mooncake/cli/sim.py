"""`mooncake sim TRACE`, `mooncake sim capacity TRACE`, `mooncake sim hitrate TRACE`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from mooncake.cli.app import app

if TYPE_CHECKING:
    from mooncake.sim.capacity import CapacityResult
    from mooncake.sim.cluster import SimConfig
    from mooncake.sim.metrics import SimResult


class _TraceOrSubcommand(TyperGroup):
    """`sim TRACE` runs the group itself; `sim capacity TRACE` runs the subcommand.

    NOTE: click would otherwise give a subcommand's name to the group's TRACE argument,
    and would stop parsing the group's options at TRACE.
    """

    allow_interspersed_args = True

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            super().parse_args(ctx, [])
            ctx._protected_args, ctx.args = args[:1], args[1:]
            return ctx.args
        return super().parse_args(ctx, args)


sim_app = typer.Typer(
    cls=_TraceOrSubcommand,
    help="Trace-driven cluster simulator running the real Conductor. `mooncake sim TRACE` "
    "replays a Mooncake-format trace on a simulated cluster and reports requests completed "
    "and rejected, TTFT and TBT percentiles, SLO attainment, cache hit rates (global pool and "
    "chosen node), why each missed block missed (cold, evicted, elsewhere) and the GPU time "
    "spent in prefill; `capacity` finds the effective request "
    "capacity; `hitrate` gives the hit rate of one global LRU pool per size.",
)
app.add_typer(sim_app, name="sim")

TRACE_HELP = "Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)."
OPT: dict[str, Any] = {
    "prefill": typer.Option(8, "--prefill", min=0, help="Prefill nodes (one instance each)."),
    "group_size": typer.Option(
        1,
        "--group-size",
        min=1,
        help="Prefill nodes per pipeline group (its stages): each group is one prefill "
        "instance, taking a new request every prefill time / S.",
    ),
    "max_inflight": typer.Option(
        4, "--max-inflight", min=1, help="Requests in flight per prefill group at most."
    ),
    "reserve": typer.Option(
        True,
        "--reserve-at-start/--admit-on-arrival",
        help="The cluster's hand-off: reserve the decode node's KV room as the prefill "
        "starts (waiting for room, head of line), stream the KV during the prefill, the "
        "decode node gives the first token (default); or the paper's §7 path: the decode "
        "instance checks the request when its KV lands and may reject it then.",
    ),
    "decode": typer.Option(8, "--decode", min=0, help="Decode instances (one node each)."),
    "coupled": typer.Option(
        0,
        "--coupled",
        min=0,
        help="Coupled vLLM-like instances instead of --prefill/--decode (chunked prefill, "
        "continuous batching, prefix cache local to each instance).",
    ),
    "policy": typer.Option(
        "kvcache_centric",
        "--policy",
        help="Prefill scheduling: random, load_balance, cache_aware or kvcache_centric "
        "(Algorithm 1).",
    ),
    "rejection": typer.Option(
        "predictive",
        "--rejection",
        help="Early rejection: none (only the decode instance checks, after the prefill is "
        "spent), basic (§7.2: at arrival, the decode pool's load now) or predictive (§7.4: "
        "at arrival, its load forecast for when the request's prefill ends; again as the "
        "prefill is about to start, choosing the decode instance the KV goes to).",
    ),
    "defer": typer.Option(
        0.0,
        "--defer-s",
        min=0,
        help="A request refused for the prefill queue alone waits this long for an idle "
        "prefill group (scheduler.defer_s; the cluster's default is 10); 0 = refused at once.",
    ),
    "late_binding": typer.Option(
        True,
        "--late-binding/--arrival-binding",
        help="Choose the decode instance a request's KV goes to when its prefill starts, "
        "from the §7.4 per-instance forecast, in every rejection mode (default); or keep "
        "the one chosen at arrival (predictive mode still re-chooses at prefill start).",
    ),
    "threshold": typer.Option(
        1.5, "--threshold", help="kvcache_balancing_threshold of Algorithm 1 (>= 1)."
    ),
    "gpu": typer.Option(
        "A800", "--gpu", help="GPU of the roofline cost model: A800, A100, H800, H100."
    ),
    "model": typer.Option(
        "llama2-70b",
        "--model",
        help="Model shape: llama2-70b, llama3-70b, llama3-8b, dummy:tiny, ...",
    ),
    "tp": typer.Option(8, "--tp", min=1, help="GPUs per instance (tensor parallel)."),
    "cost_model": typer.Option(
        None,
        "--cost-model",
        help="Cost model file from `mooncake profile` instead of the roofline.",
    ),
    "pool_blocks": typer.Option(
        None,
        "--pool-blocks",
        min=0,
        help="Pool capacity in blocks, in total over the pool nodes (default: from --dram-bytes).",
    ),
    "dram_bytes": typer.Option(
        "1TiB", "--dram-bytes", help="DRAM per prefill node for KV blocks, e.g. 512GiB."
    ),
    "ssd_bytes": typer.Option("0", "--ssd-bytes", help="SSD per prefill node for KV blocks."),
    "limit": typer.Option(None, "--limit", min=1, help="Replay only the first N requests."),
    "ttft_slo": typer.Option(30.0, "--ttft-slo", help="TTFT SLO, seconds."),
    "tbt_slo": typer.Option(
        0.1, "--tbt-slo", help="TBT SLO, seconds (per request: mean of its slowest 10% token gaps)."
    ),
    "chunk_tokens": typer.Option(
        512,
        "--chunk-tokens",
        min=1,
        help="Tokens per prefill chunk; coupled instances: per iteration (vLLM default 512).",
    ),
    "block_tokens": typer.Option(
        512, "--block-tokens", min=1, help="Tokens per KV block of the trace."
    ),
    "seed": typer.Option(0, "--seed", help="Seed of the random policy."),
    "json": typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    "plot": typer.Option(
        None, "--plot", help="Write PNG figures (TTFT/TBT CDFs, hit rate vs pool size) here."
    ),
}


def _config(kw: dict[str, Any]) -> SimConfig:
    from mooncake.config.sizes import parse_size
    from mooncake.sim.cluster import SimConfig

    return SimConfig(
        num_prefill=kw["prefill"],
        num_decode=kw["decode"],
        num_coupled=kw["coupled"],
        policy=kw["policy"],
        rejection=kw["rejection"],
        balancing_threshold=kw["threshold"],
        ttft_slo_s=kw["ttft_slo"],
        tbt_slo_s=kw["tbt_slo"],
        gpu=kw["gpu"],
        model=kw["model"],
        tp=kw["tp"],
        cost_model_path=str(kw["cost_model"] or ""),
        pool_blocks=kw["pool_blocks"],
        dram_bytes=parse_size(kw["dram_bytes"]),
        ssd_bytes=parse_size(kw["ssd_bytes"]),
        block_tokens=kw["block_tokens"],
        chunk_tokens=kw["chunk_tokens"],
        speed=kw.get("speed", 1.0),
        limit=kw["limit"],
        seed=kw["seed"],
        late_binding=kw.get("late_binding", True),
        group_size=kw.get("group_size", 1),
        max_inflight=kw.get("max_inflight", 4),
        reserve_at_start=kw.get("reserve", True),
        defer_s=kw.get("defer", 0.0),
    )


def _cluster_name(cfg: SimConfig) -> str:
    shape = (
        f"{cfg.num_coupled} coupled" if cfg.is_coupled else f"{cfg.num_prefill}P+{cfg.num_decode}D"
    )
    if not cfg.is_coupled and cfg.group_size > 1:
        shape += f" (groups of {cfg.group_size})"
    binding = "" if cfg.late_binding or cfg.is_coupled else ", decode bound at arrival"
    return (
        f"{shape}, {cfg.model} on {cfg.gpu} x{cfg.tp}, {cfg.policy}, "
        f"rejection {cfg.rejection}{binding}"
    )


@sim_app.callback(invoke_without_command=True)
def sim_run(
    ctx: typer.Context,
    trace: Path | None = typer.Argument(None, help=TRACE_HELP, show_default=False),
    speed: float = typer.Option(
        1.0, "--speed", help="Replay speed factor (2 = twice as many requests per second)."
    ),
    prefill: int = OPT["prefill"],
    decode: int = OPT["decode"],
    coupled: int = OPT["coupled"],
    group_size: int = OPT["group_size"],
    max_inflight: int = OPT["max_inflight"],
    reserve: bool = OPT["reserve"],
    policy: str = OPT["policy"],
    rejection: str = OPT["rejection"],
    defer: float = OPT["defer"],
    late_binding: bool = OPT["late_binding"],
    threshold: float = OPT["threshold"],
    gpu: str = OPT["gpu"],
    model: str = OPT["model"],
    tp: int = OPT["tp"],
    cost_model: Path | None = OPT["cost_model"],
    pool_blocks: int | None = OPT["pool_blocks"],
    dram_bytes: str = OPT["dram_bytes"],
    ssd_bytes: str = OPT["ssd_bytes"],
    limit: int | None = OPT["limit"],
    ttft_slo: float = OPT["ttft_slo"],
    tbt_slo: float = OPT["tbt_slo"],
    chunk_tokens: int = OPT["chunk_tokens"],
    block_tokens: int = OPT["block_tokens"],
    seed: int = OPT["seed"],
    json_out: bool = OPT["json"],
    plot: Path | None = OPT["plot"],
) -> None:
    """Replay TRACE on a simulated cluster (see the group's help)."""
    if ctx.invoked_subcommand is not None:
        return
    if trace is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    from mooncake.sim.plot import hit_rate_curve, write_plots
    from mooncake.sim.simulator import run_sim
    from mooncake.sim.trace import load_trace

    cfg = _config(dict(locals()))
    records = load_trace(trace, limit=limit, block_tokens=block_tokens)
    report = run_sim(cfg, records)
    files = []
    if plot is not None:
        files = write_plots(
            plot,
            report,
            hit_rate_curve(records),
            ttft_slo_s=ttft_slo,
            tbt_slo_s=tbt_slo,
            label=f"({_cluster_name(cfg)})",
        )
    print_result(report.result, _cluster_name(cfg), trace, json_out, files)


@sim_app.command("capacity")
def sim_capacity(
    trace: Path = typer.Argument(..., help=TRACE_HELP, show_default=False),
    target: float = typer.Option(
        0.9, "--target", min=0.01, max=1.0, help="Share of all requests that must meet both SLOs."
    ),
    lo: float = typer.Option(0.05, "--lo", help="Lowest replay speed tried."),
    hi: float = typer.Option(8.0, "--hi", help="Highest replay speed tried."),
    tolerance: float = typer.Option(0.03, "--tolerance", help="Stop when hi/lo < 1 + this."),
    prefill: int = OPT["prefill"],
    decode: int = OPT["decode"],
    coupled: int = OPT["coupled"],
    policy: str = OPT["policy"],
    rejection: str = OPT["rejection"],
    threshold: float = OPT["threshold"],
    gpu: str = OPT["gpu"],
    model: str = OPT["model"],
    tp: int = OPT["tp"],
    cost_model: Path | None = OPT["cost_model"],
    pool_blocks: int | None = OPT["pool_blocks"],
    dram_bytes: str = OPT["dram_bytes"],
    ssd_bytes: str = OPT["ssd_bytes"],
    limit: int | None = OPT["limit"],
    ttft_slo: float = OPT["ttft_slo"],
    tbt_slo: float = OPT["tbt_slo"],
    chunk_tokens: int = OPT["chunk_tokens"],
    block_tokens: int = OPT["block_tokens"],
    seed: int = OPT["seed"],
    json_out: bool = OPT["json"],
) -> None:
    """Effective request capacity: the highest replay speed of TRACE at which at least
    --target of all requests meet both the TTFT and the TBT SLO, found by bisection."""
    from mooncake.sim.capacity import find_capacity
    from mooncake.sim.trace import load_trace

    cfg = _config(dict(locals()))
    records = load_trace(trace, limit=limit, block_tokens=block_tokens)
    result = find_capacity(cfg, records, target=target, lo=lo, hi=hi, rel_tol=tolerance)
    print_capacity(result, _cluster_name(cfg), json_out)


@sim_app.command("hitrate")
def sim_hitrate(
    trace: Path = typer.Argument(..., help=TRACE_HELP, show_default=False),
    sizes: str = typer.Option(
        "1000,10000,30000,50000,100000,0",
        "--sizes",
        help="Pool capacities in blocks, comma-separated; 0 = unbounded.",
    ),
    limit: int | None = OPT["limit"],
    block_tokens: int = OPT["block_tokens"],
    json_out: bool = OPT["json"],
    plot: Path | None = OPT["plot"],
) -> None:
    """Hit rate of one global LRU pool per capacity (the paper's Table 1): the longest
    resident prefix of each request's blocks over all blocks requested, in trace order."""
    from mooncake.errors import ConfigError
    from mooncake.sim.plot import hit_rate_curve, write_plots
    from mooncake.sim.trace import load_trace

    try:
        caps = [int(s) or None for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        raise ConfigError(f"--sizes: expected comma-separated integers, got {sizes!r}") from e
    records = load_trace(trace, limit=limit, block_tokens=block_tokens)
    curve = hit_rate_curve(records, caps)
    files = write_plots(plot, None, curve, ttft_slo_s=0, tbt_slo_s=0) if plot else []
    print_hit_rates(curve, len(records), json_out, files)


# -- output ------------------------------------------------------------------------------
def _fmt(v: object) -> str:
    return f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def print_result(
    result: SimResult, cluster: str, trace: Path, json_out: bool, files: list[Path]
) -> None:
    import msgspec
    from rich.table import Table

    from mooncake.cli.output import console, print_json

    if json_out:
        data = msgspec.structs.asdict(result)
        print_json(
            {**data, "cluster": cluster, "trace": str(trace), "plots": [str(f) for f in files]}
        )
        return
    table = Table(title=f"{trace.name} on {cluster}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in msgspec.structs.asdict(result).items():
        if key != "misses":
            table.add_row(key, _fmt(value))
    console.print(table)
    console.print(_misses_table(result))
    for f in files:
        console.print(f"wrote {f}")


def _misses_table(result: SimResult) -> Any:
    """Blocks of the started requests by cause, with the evicted blocks' ages."""
    from rich.table import Table

    m = result.misses
    table = Table(title=f"blocks by cause ({m.requests:,} requests started, {m.blocks:,} blocks)")
    table.add_column("cause")
    table.add_column("blocks", justify="right")
    table.add_column("share", justify="right")
    notes = {
        "hit": "reused",
        "cold": "never stored before",
        "evicted": f"age at eviction p50 {m.evicted_age_p50_s:,.1f} s, "
        f"p90 {m.evicted_age_p90_s:,.1f} s",
        "elsewhere": "in the pool, not reused",
        "priced_out": "of which the placement saw in the pool and recomputed",
        "plan_lost": "of which the placement meant to reuse, lost before the start",
        "after_placement": "of which stored after the placement",
        "unverified": "token check failed (never in the simulator)",
    }
    table.add_column("")
    for cause, note in notes.items():
        table.add_row(cause, f"{getattr(m, cause):,}", f"{m.shares.get(cause, 0.0):.3f}", note)
    return table


def print_capacity(result: CapacityResult, cluster: str, json_out: bool) -> None:
    import msgspec
    from rich.table import Table

    from mooncake.cli.output import console, print_json

    if json_out:
        print_json({**msgspec.structs.asdict(result), "cluster": cluster})
        return
    table = Table(title=f"capacity search on {cluster}")
    table.add_column("speed", justify="right")
    table.add_column("SLO attainment", justify="right")
    table.add_column("meets", justify="center")
    for run in result.runs:
        table.add_row(f"{run.speed:.3f}", f"{run.slo_attainment:.3f}", "yes" if run.meets else "no")
    console.print(table)
    bound = "" if result.bounded else " (at least: --hi met the target; raise --hi)"
    console.print(
        f"effective capacity: speed {result.speed:.3f} = {result.requests_per_s:.3f} requests/s "
        f"with {result.target:.0%} of requests within both SLOs{bound}"
    )


def print_hit_rates(
    curve: list[tuple[int | None, float]], num_requests: int, json_out: bool, files: list[Path]
) -> None:
    from rich.table import Table

    from mooncake.cli.output import console, print_json

    rows = [{"pool_blocks": size, "hit_rate": hit} for size, hit in curve]
    if json_out:
        print_json({"requests": num_requests, "lru": rows, "plots": [str(f) for f in files]})
        return
    table = Table(title=f"global LRU pool hit rate ({num_requests:,} requests)")
    table.add_column("pool blocks", justify="right")
    table.add_column("hit rate", justify="right")
    for size, hit in curve:
        table.add_row("unbounded" if size is None else f"{size:,}", f"{hit:.4f}")
    console.print(table)
    for f in files:
        console.print(f"wrote {f}")

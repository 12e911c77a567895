"""`mooncake trace synth` (write a synthetic trace) and `mooncake trace stats TRACE`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mooncake.cli.app import app

if TYPE_CHECKING:
    from mooncake.sim.tracestats import TraceStats

trace_app = typer.Typer(
    help="Mooncake-format request traces: `synth` writes one from a workload description "
    "(conversation, agent, document QA), `stats` tells what one holds (lengths, sharing, "
    "reuse distances, hit rates of an unbounded and a global LRU pool).",
    no_args_is_help=True,
)
app.add_typer(trace_app, name="trace")


def _length(flag: str, default: str, what: str) -> Any:
    return typer.Option(
        default,
        flag,
        help=f"{what}: MEAN or MEAN:SPREAD tokens (lognormal, SPREAD = sigma of "
        "the log, default 0.5; 0 = constant).",
    )


@trace_app.command("synth")
def trace_synth(
    output: Path = typer.Option(..., "--output", "-o", help="Trace file to write (JSON lines)."),
    mix: str = typer.Option(
        "conversation",
        "--mix",
        help="Workload kinds of the sessions, KIND[:WEIGHT],...: conversation (multi-turn "
        "chat, each session its own system prompt), agent (sessions start with one of "
        "--agent-prompts shared system prompts + tool definitions), docqa (sessions start "
        "with one document of a shared corpus, Zipf popularity); e.g. agent:0.7,docqa:0.3.",
    ),
    sessions: int = typer.Option(200, "--sessions", help="Sessions in the trace."),
    rate: float = typer.Option(0.5, "--rate", help="Session starts per second."),
    cv: float = typer.Option(
        1.0,
        "--cv",
        help="Burstiness: coefficient of variation of the times between session starts "
        "(1 = Poisson; other values: Gamma, > 1 burstier).",
    ),
    turns: float = typer.Option(
        4.0, "--turns", help="Mean turns per session (geometric, at least 1)."
    ),
    think_s: float = typer.Option(
        20.0, "--think-s", help="Mean seconds between a session's turns (exponential)."
    ),
    system_len: str = _length(
        "--system-len", "1000", "System prompt length (docqa: its shared instruction)"
    ),
    tools_len: str = _length("--tools-len", "4000", "Agent tool definitions length"),
    user_len: str = _length("--user-len", "400", "User message length, per turn"),
    doc_len: str = _length("--doc-len", "8000", "Document length (docqa)"),
    output_len: str = _length("--output-len", "300", "Output length, per turn"),
    agent_prompts: int = typer.Option(
        4, "--agent-prompts", help="Distinct shared agent prefixes (system prompt + tools)."
    ),
    docs: int = typer.Option(100, "--docs", help="Documents in the docqa corpus."),
    zipf: float = typer.Option(
        1.0, "--zipf", help="Docqa popularity exponent: document i has weight 1/i^zipf."
    ),
    max_input: int = typer.Option(
        65536, "--max-input", help="A session ends before a prompt would pass this many tokens."
    ),
    block_tokens: int = typer.Option(512, "--block-tokens", help="Tokens per hash_ids block."),
    seed: int = typer.Option(0, "--seed", help="Random seed (same flags and seed, same file)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write a synthetic Mooncake-format trace (timestamp ms, input_length, output_length,
    prefix-chained hash_ids) of sessions whose turns reuse the earlier prompt."""
    import msgspec

    from mooncake.cli.output import console, print_json
    from mooncake.sim.synth import SynthParams, parse_length, parse_mix, synthesize, write_trace

    params = SynthParams(
        mix=parse_mix(mix),
        sessions=sessions,
        rate=rate,
        cv=cv,
        turns=turns,
        think_s=think_s,
        system_len=parse_length("--system-len", system_len),
        tools_len=parse_length("--tools-len", tools_len),
        user_len=parse_length("--user-len", user_len),
        doc_len=parse_length("--doc-len", doc_len),
        output_len=parse_length("--output-len", output_len),
        agent_prompts=agent_prompts,
        docs=docs,
        zipf=zipf,
        max_input=max_input,
        block_tokens=block_tokens,
        seed=seed,
    )
    records, kinds = synthesize(params)
    nbytes = write_trace(output, records)
    blocks = sum(len(r.hash_ids) for r in records)
    summary = {
        "output": str(output),
        "bytes": nbytes,
        "requests": len(records),
        "sessions": kinds,
        "duration_s": (records[-1].timestamp - records[0].timestamp) / 1000.0,
        "mean_input_length": sum(r.input_length for r in records) / len(records),
        "mean_output_length": sum(r.output_length for r in records) / len(records),
        "blocks": blocks,
        "distinct_blocks": len({h for r in records for h in r.hash_ids}),
        "params": msgspec.to_builtins(params),
    }
    if json_out:
        print_json(summary)
        return
    console.print(
        f"wrote {output}: {len(records):,} requests from "
        + ", ".join(f"{n:,} {k}" for k, n in kinds.items())
        + f" sessions over {summary['duration_s']:,.0f} s; {blocks:,} blocks, "
        f"{summary['distinct_blocks']:,} distinct"
    )


@trace_app.command("stats")
def trace_stats_cmd(
    trace: Path = typer.Argument(
        ...,
        help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).",
        show_default=False,
    ),
    sizes: str = typer.Option(
        "10000,30000,100000",
        "--sizes",
        help="Capacities in blocks of the global LRU pools whose hit rates are shown.",
    ),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N requests."),
    block_tokens: int = typer.Option(512, "--block-tokens", min=1, help="Tokens per block."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What TRACE holds: requests, duration, arrival rate, length percentiles, blocks and
    their sharing, reuse distances, the unbounded and a global LRU's hit rates."""
    import msgspec

    from mooncake.cli.output import print_json
    from mooncake.errors import ConfigError
    from mooncake.sim.trace import load_trace
    from mooncake.sim.tracestats import trace_stats

    try:
        caps = [int(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--sizes: expected comma-separated integers, got {sizes!r}") from None
    if any(c < 1 for c in caps):
        raise ConfigError(f"--sizes: capacities must be >= 1 block, got {sizes!r}")
    records = load_trace(trace, limit=limit, block_tokens=block_tokens)
    stats = trace_stats(records, caps)
    if json_out:
        print_json({"trace": str(trace), **msgspec.to_builtins(stats)})
    else:
        _print_stats(trace, stats)


def _print_stats(trace: Path, s: TraceStats) -> None:
    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(title=f"{trace.name}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("requests", f"{s.requests:,}"),
        ("duration", f"{s.duration_s:,.1f} s"),
        ("arrival rate", f"{s.arrival_rate_rps:.3f} requests/s"),
    ]
    for name, p in (("input length", s.input_length), ("output length", s.output_length)):
        rows.append(
            (
                name,
                f"mean {p.mean:,.0f}  p50 {p.p50:,.0f}  p90 {p.p90:,.0f}  p99 {p.p99:,.0f}  "
                f"max {p.max:,.0f}",
            )
        )
    d = s.reuse_distance
    rows += [
        ("blocks", f"{s.blocks:,} ({s.distinct_blocks:,} distinct)"),
        ("blocks reused", f"{s.reused_block_share:.1%}"),
        ("shared prefixes", f"{s.shared_prefixes:,}"),
        *(
            (
                f"  prefix #{i + 1}",
                f"{g.blocks:,} block{'s' if g.blocks > 1 else ''}, "
                f"{g.requests:,} requests ({g.share:.1%})",
            )
            for i, g in enumerate(s.top_prefixes)
        ),
        ("reuse distance", f"p50 {d.p50:,.0f}  p90 {d.p90:,.0f}  p99 {d.p99:,.0f} distinct blocks"),
        ("hit rate, unbounded", f"{s.unbounded_hit_rate:.4f}"),
        *((f"hit rate, LRU {p.pool_blocks:,} blocks", f"{p.hit_rate:.4f}") for p in s.lru),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)

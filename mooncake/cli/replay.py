"""`mooncake replay TRACE`: replay a Mooncake trace against an OpenAI-compatible server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import app

if TYPE_CHECKING:
    from mooncake.replay import PromptConfig, ReplayConfig, ReplayReport, RequestRecord, ServerInfo
    from mooncake.sim.trace import TraceRecord


@app.command("replay")
def replay_cmd(
    trace: Path = typer.Argument(
        ..., help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)."
    ),
    url: str = typer.Option(
        "",
        "--url",
        help="Base URL of the server, e.g. http://10.0.0.1:8000 (vLLM, SGLang or ours). "
        "Default: the cluster `mooncake up --local` started.",
    ),
    api_key: str = typer.Option(
        "", "--api-key", envvar="MOONCAKE_API_KEY", help="Sent as `Authorization: Bearer KEY`."
    ),
    model: str = typer.Option(
        "", "--model", help="Model name; default: the first /v1/models lists."
    ),
    limit: int = typer.Option(
        0, "--limit", min=0, help="Replay only the first N requests (0 = all)."
    ),
    skip: int = typer.Option(
        0, "--skip", min=0, help="Start after the trace's first N requests (--limit counts on)."
    ),
    speed: float = typer.Option(
        1.0,
        "--speed",
        help="Arrival speed-up: timestamps (ms) are divided by it; 2 = twice as fast.",
    ),
    concurrency: int = typer.Option(
        0, "--concurrency", min=0, help="Requests in flight at most (0 = no cap; later ones wait)."
    ),
    scale: float | None = typer.Option(
        None,
        "--scale",
        help="Prompt scale: blocks become round(512 * S) tokens and prompts keep their blocks "
        "(the last one partial), so prefix sharing is kept. 0.0625: 32-token blocks, a 12k "
        "prompt becomes 750 tokens. Set the server's block size to the printed value. "
        "Default: 1, halved until every request fits the server's context (the max_model_len "
        "/v1/models gives; 0.0625 for the first 20 requests of the bundled trace on up --local).",
        show_default=False,
    ),
    output_scale: float | None = typer.Option(
        None,
        "--output-scale",
        help="Output lengths = the trace's times this (default: the scale), at least 1.",
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Cap on each request's output tokens."
    ),
    ignore_eos: bool = typer.Option(
        True,
        "--ignore-eos/--no-ignore-eos",
        help="Send ignore_eos (vLLM, SGLang and ours accept it) so outputs have the asked length.",
    ),
    prompt_format: str = typer.Option(
        "tokens",
        "--prompt-format",
        help="tokens: prompts are token-id lists; text: each id becomes a word from a fixed "
        "list (for servers that take only text; token counts then depend on its tokenizer).",
    ),
    vocab_size: int | None = typer.Option(
        None,
        "--vocab-size",
        min=1,
        help="Token ids are drawn from [--first-id, N). Default: the vocab_size /v1/models "
        "gives, else 32000.",
    ),
    first_id: int = typer.Option(0, "--first-id", min=0, help="Lowest token id in prompts."),
    seed: int = typer.Option(
        0, "--seed", help="Token seed: another seed gives other prompts (no hits on a warm cache)."
    ),
    ttft_slo: float = typer.Option(30.0, "--ttft-slo", help="TTFT SLO in seconds."),
    tbt_slo: float = typer.Option(0.1, "--tbt-slo", help="TBT SLO in seconds per token."),
    timeout: float = typer.Option(
        300.0, "--timeout", help="Seconds to connect, and to wait for each piece of a response."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the report as JSON, no progress bar."
    ),
) -> None:
    """Replay a trace against an OpenAI-compatible server and report TTFT, TBT and SLOs.

    Each request is sent at its timestamp / --speed as a streaming /v1/completions call.
    Its prompt is synthesized from its hash_ids: a fixed block of token ids per id, so
    requests sharing leading hash ids share a token prefix exactly. Requests are not
    retried: HTTP 429 counts as rejected, any other failure as failed.

    TTFT is send -> first token chunk; TBT is each gap between later token chunks (the
    percentiles pool all gaps). A request meets the SLO when it completed with TTFT <=
    --ttft-slo and the 90th percentile of its own token gaps <= --tbt-slo; attainment is
    over all requests sent. The prompt-cache hit share (cached / prompt tokens) is shown
    when the server reports usage.prompt_tokens_details.cached_tokens. Exits 1 when no
    request completed.
    """
    from mooncake.cli.output import print_json
    from mooncake.errors import ConfigError
    from mooncake.local.runfile import read_runfile
    from mooncake.replay import PromptConfig, ReplayConfig, ReplayError, replay
    from mooncake.sim.trace import load_trace

    if not url:
        cluster = read_runfile()
        if cluster is None:
            raise ReplayError(
                "no --url given and no local cluster is running (`mooncake up --local` starts "
                "one); pass --url http://HOST:PORT of an OpenAI-compatible server"
            )
        url, api_key = cluster.url, api_key or cluster.api_key
    if prompt_format not in ("tokens", "text"):
        raise ConfigError(f"--prompt-format: expected tokens or text, got {prompt_format!r}")
    prompts = PromptConfig(
        scale=1.0 if scale is None else scale,
        output_scale=next((s for s in (output_scale, scale) if s is not None), 1.0),
        fit_context=scale is None,
        max_tokens=max_tokens,
        vocab_size=vocab_size or 32000,
        first_id=first_id,
        seed=seed,
    )
    prompts.validate()
    cfg = ReplayConfig(
        url=url,
        model=model,
        api_key=api_key,
        speed=speed,
        concurrency=concurrency,
        timeout_s=timeout,
        prompt_format=prompt_format,  # type: ignore[arg-type]
        ignore_eos=ignore_eos,
        vocab_size=vocab_size,
        ttft_slo_s=ttft_slo,
        tbt_slo_s=tbt_slo,
    )
    cfg.validate()
    records = load_trace(trace, limit=limit or None, skip=skip)
    if as_json:
        report = replay(records, prompts, cfg)
        print_json(report)
    else:
        report = _replay_with_progress(records, prompts, cfg)
        _print_report(report)
    if report.completed == 0:
        raise typer.Exit(1)


def _replay_with_progress(
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: ReplayConfig,
    also: Callable[[RequestRecord], None] | None = None,
) -> ReplayReport:
    """`replay` with a progress bar on stderr; `also` sees every request's record too."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mooncake.cli.output import err_console
    from mooncake.replay import replay

    counts = {"ok": 0, "rejected": 0, "error": 0}
    progress = Progress(
        TextColumn("[bold]replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[counts]}"),
        console=err_console,
        transient=False,
    )
    task = progress.add_task("replay", total=len(records), counts="")

    def on_start(info: ServerInfo, final: PromptConfig) -> None:
        if final.scale != prompts.scale and info.max_model_len is not None:
            why = "the largest power of 2 at which every request fits"
            if not final.fits(records, info.max_model_len):
                why = "the smallest; some requests still do not fit"
            err_console.print(
                f"--scale {final.scale:g}: {why} the server's context of {info.max_model_len} "
                "tokens (pass --scale to choose)",
                highlight=False,
            )
        err_console.print(
            f"replaying {len(records)} requests on {info.model}: blocks of "
            f"[bold]{final.block_tokens}[/] tokens after --scale {final.scale:g} (set the "
            f"server's block size to match), token ids in [{final.first_id}, {final.vocab_size})",
            highlight=False,
        )
        progress.start()

    def on_record(rec: RequestRecord) -> None:
        if also is not None:
            also(rec)
        counts[rec.status] += 1
        text = f"ok {counts['ok']}  429 {counts['rejected']}  failed {counts['error']}"
        progress.update(task, advance=1, counts=text)

    try:
        return replay(records, prompts, cfg, on_start, on_record)
    finally:
        progress.stop()


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:,.1f} ms" if unit == "s" and value < 1 else f"{value:,.3f} {unit}"


def _three(*values: float | None) -> str:
    return " / ".join(_fmt(v) for v in values)


def _print_report(r: ReplayReport) -> None:
    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(title=f"replay of {r.sent} requests on {r.model} at {r.url}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    share = "-" if r.cached_token_share is None else f"{r.cached_token_share:.1%}"
    rows = [
        ("sent / completed", f"{r.sent} / {r.completed}"),
        ("rejected (429) / failed", f"{r.rejected} / {r.failed}"),
        ("TTFT p50 / p90 / p99", _three(r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s)),
        ("TBT p50 / p90 / p99", _three(r.tbt_p50_s, r.tbt_p90_s, r.tbt_p99_s)),
        (
            f"SLO attainment (TTFT <= {r.ttft_slo_s:g} s, own P90 TBT <= {r.tbt_slo_s:g} s)",
            f"{r.slo_attainment:.1%}",
        ),
        ("output tokens/s", f"{r.output_tokens_per_s:,.1f}"),
        ("goodput tokens/s (requests meeting both SLOs)", f"{r.goodput_tokens_per_s:,.1f}"),
        ("requests/s", f"{r.request_throughput_rps:,.3f}"),
        ("prompt / output tokens", f"{r.prompt_tokens:,} / {r.output_tokens:,}"),
        ("prompt-cache hit share", share),
        ("block size after scaling", f"{r.block_tokens} tokens"),
        ("duration", f"{r.duration_s:,.2f} s at --speed {r.speed:g}"),
    ]
    if r.short_outputs:
        rows.append(("outputs shorter than asked", f"{r.short_outputs} (EOS not ignored?)"))
    if sh := r.kv_block_shares:  # NOTE: only where the server attributes its misses
        from mooncake.conductor.misses import CAUSES

        shares = "  ".join(f"{c} {sh.get(c, 0.0):.1%}" for c in CAUSES)
        rows.append(("blocks by cause (server)", shares))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for message, num in r.errors.items():
        console.print(f"[red]{num} x[/] {message}", highlight=False)
    if too_long := sum(n for m, n in r.errors.items() if "maximum context length" in m):
        console.print(
            f"hint: {too_long} request{'s' if too_long > 1 else ''} did not fit the server's "
            f"context at --scale {r.scale:g}; leave --scale out to have replay fit the trace to "
            "it, or pass a smaller one (or --max-tokens)",
            highlight=False,
        )

"""`mooncake bench repeats`: distinct prompts on a fresh local cluster, each sent again as
soon as its answer ended; does every repeat reuse every full block?"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app
from mooncake.cli.config_cmd import SET_HELP

if TYPE_CHECKING:
    from mooncake.bench.repeats import RepeatsResult


@bench_app.command("repeats")
def bench_repeats(
    num_prompts: int = typer.Option(200, "--prompts", min=1, help="Distinct prompts."),
    prompt_len: int = typer.Option(1500, "--prompt-len", min=3, help="Tokens per prompt."),
    max_tokens: int = typer.Option(1, "--max-tokens", min=1, help="Output tokens per answer."),
    num_prefill: int = typer.Option(2, "--prefill", min=1, help="Prefill nodes."),
    group_size: int = typer.Option(2, "--group-size", min=1, help="Prefill nodes per group."),
    num_decode: int = typer.Option(1, "--decode", min=1, help="Decode nodes."),
    num_store: int = typer.Option(1, "--store", min=0, help="Store nodes."),
    model: str = typer.Option("dummy:tiny", "--model", help="Model the cluster serves."),
    block_tokens: int = typer.Option(32, "--block-tokens", min=1, help="Tokens per KV block."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompts' tokens."),
    sets: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Start a fresh `up --local` cluster of the shape given, send --prompts distinct
    prompts of --prompt-len tokens, each followed at once by the same prompt again, and
    count the full blocks each repeat reused (usage.prompt_tokens_details.cached_tokens)
    with the server's blocks by cause (its kv_blocks). A block committed before a request
    is placed must be reused by it: every repeat should reuse every full block (0 misses
    of committed blocks). Exits 1 when a repeat missed some."""
    from mooncake.bench.repeats import run_repeats
    from mooncake.cli.output import err_console, print_json
    from mooncake.config.load import parse_set_option
    from mooncake.local.launcher import LocalPlan

    with tempfile.TemporaryDirectory(prefix="mooncake-bench-repeats-") as tmp:
        plan = LocalPlan(
            model=model,
            num_prefill=num_prefill,
            group_size=min(group_size, num_prefill),
            num_decode=num_decode,
            num_store=num_store,
            api_port=0,
            block_tokens=block_tokens,
            run_dir=Path(tmp),
            extra=dict(parse_set_option(s) for s in sets),
        )
        result = run_repeats(
            plan,
            num_prompts,
            prompt_len,
            max_tokens,
            seed,
            on_progress=lambda s: err_console.print(s, highlight=False),
        )
    if as_json:
        print_json(result)
    else:
        _print(result)
    if result.committed_misses:
        raise typer.Exit(1)


def _print(r: RepeatsResult) -> None:
    from rich.table import Table

    from mooncake.cli.output import console
    from mooncake.conductor.misses import CAUSES

    table = Table(
        title=f"{r.prompts} prompts of {r.prompt_len} tokens, each sent twice, on {r.cluster}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("full blocks per prompt", f"{r.full_blocks} of {r.block_tokens} tokens")
    table.add_row("repeats reusing every full block", f"{r.whole_repeats} of {r.prompts}")
    table.add_row("misses of committed blocks", str(r.committed_misses))
    table.add_row("fewest blocks a repeat reused", ", ".join(map(str, r.worst)))
    for name, blocks in (("first sends", r.first_kv_blocks), ("repeats", r.repeat_kv_blocks)):
        table.add_row(f"{name} by cause", "  ".join(f"{c} {blocks.get(c, 0):,}" for c in CAUSES))
    table.add_row(
        "request time p50, first / repeat",
        f"{r.first_p50_s * 1000:,.1f} / {r.repeat_p50_s * 1000:,.1f} ms",
    )
    console.print(table)

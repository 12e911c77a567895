"""`mooncake bench grammar`: structured outputs' cost, a guided decode step against a free
one in the same run, and schema compile times."""

from __future__ import annotations

import typer

from mooncake.cli.app import bench_app


@bench_app.command("grammar")
def bench_grammar(
    model: str = typer.Option(
        "smollm2-135m-instruct", help="model.path: its weights and its tokenizer's vocabulary."
    ),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    batch: int = typer.Option(32, min=1, help="Requests per decode step."),
    context_len: int = typer.Option(64, min=1, help="Prompt tokens per request."),
    steps: int = typer.Option(8, min=1, help="Timed steps per round."),
    rounds: int = typer.Option(3, min=1, help="Rounds per mode (guided, free), alternating."),
    schemas: int = typer.Option(200, min=1, help="Distinct random schemas compiled."),
    temperature: float = typer.Option(1.0, min=0, help="Of every request (0: greedy)."),
    threads: int = typer.Option(1, min=1, help="torch threads."),
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of a table."
    ),
) -> None:
    """Decode step time with every row held to a JSON schema against the same batch
    unconstrained (target: at most 1.1x), the masks' fill time alone, and compile time
    p50/p99 of random JSON schemas through the grammar engine (llguidance)."""
    import torch

    from mooncake.bench.grammar import run_grammar_bench
    from mooncake.cli.output import console, print_json

    torch.set_num_threads(threads)
    figures = run_grammar_bench(
        model,
        device=device,
        batch=batch,
        context_len=context_len,
        num_steps=steps,
        num_rounds=rounds,
        num_schemas=schemas,
        temperature=temperature,
    )
    if json_out:
        print_json(figures)
        return
    from rich.table import Table

    f = figures
    table = Table(
        title=f"structured outputs on {f.model} ({f.device}), batch {f.batch}, "
        f"temperature {f.temperature:g}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("decode step, unconstrained (median)", f"{f.free_step_ms:.2f} ms")
    table.add_row("decode step, every row a JSON schema (median)", f"{f.guided_step_ms:.2f} ms")
    table.add_row("guided / unconstrained (target <= 1.1x)", f"{f.ratio:.3f}x")
    table.add_row("mask fill of the batch alone (median)", f"{f.mask_fill_ms:.3f} ms")
    table.add_row(f"schema compile p50 ({f.num_schemas} schemas)", f"{f.compile_ms_p50:.2f} ms")
    table.add_row("schema compile p99", f"{f.compile_ms_p99:.2f} ms")
    table.add_row("schema compile max", f"{f.compile_ms_max:.2f} ms")
    console.print(table)

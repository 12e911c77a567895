"""`mooncake bench cluster TRACE`: a trace slice on a real local cluster and in the
simulator, same shape, same cost model, figures side by side."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app
from mooncake.cli.config_cmd import SET_HELP

if TYPE_CHECKING:
    from mooncake.api.status import TtftPhases
    from mooncake.bench.calibrate import Calibration


@bench_app.command("cluster")
def bench_cluster(
    trace: Path = typer.Argument(..., help="Mooncake-format JSONL trace."),
    limit: int = typer.Option(60, "--limit", min=1, help="Replay the first N requests."),
    skip: int = typer.Option(
        0, "--skip", min=0, help="Start the slice after the trace's first N requests."
    ),
    scale: float = typer.Option(
        0.0625, "--scale", help="Prompt scale (see `mooncake replay`); sets the block size."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="Cap on each request's output tokens."
    ),
    speed: float = typer.Option(1.0, "--speed", help="Arrival speed-up (see `mooncake replay`)."),
    num_prefill: int = typer.Option(2, "--prefill", min=1, help="Prefill nodes."),
    group_size: int = typer.Option(2, "--group-size", min=1, help="Prefill nodes per group."),
    num_decode: int = typer.Option(1, "--decode", min=1, help="Decode nodes."),
    num_store: int = typer.Option(1, "--store", min=0, help="Store nodes."),
    model: str = typer.Option("dummy:tiny", "--model", help="Model the cluster serves."),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1, help="Prefill chunk tokens."),
    pool: bool = typer.Option(True, "--pool/--no-pool", help="The KV pool (off: recompute)."),
    warmup: int = typer.Option(
        2, "--warmup", min=0, help="Requests sent one at a time first, not counted."
    ),
    repeat: int = typer.Option(
        1, "--repeat", min=1, help="Real replays, each on a fresh cluster; their medians count."
    ),
    sets: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (real, sim, ratio) on stdout."
    ),
) -> None:
    """Calibrate the simulator against the cluster: start a fresh `up --local` cluster of
    the shape given (its cost model profiled once and cached, as `up --local` does), replay
    the first --limit requests of TRACE through its OpenAI API, simulate the same requests
    (scaled as the replay scales them) on the same shape with the same cost model and
    settings, and print TTFT P50/P90, TBT P50/P90 (over every token gap), prompt-cache hit
    rate and rejections of both, with the ratio sim / real of each. The simulated twin runs
    on this host as the real cluster does: its nodes share the host's cores, with the
    control plane's share and the idle cluster's fixed latency both measured in the run."""
    from mooncake.bench.calibrate import calibrate
    from mooncake.cli.output import err_console, print_json
    from mooncake.cli.replay import _replay_with_progress
    from mooncake.config.load import parse_set_option
    from mooncake.local.launcher import LocalPlan
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import load_trace

    records = load_trace(trace, limit=limit, skip=skip)
    prompts = PromptConfig(scale=scale, output_scale=scale, max_tokens=max_tokens)
    prompts.validate()
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-cluster-") as tmp:
        plan = LocalPlan(
            model=model,
            num_prefill=num_prefill,
            group_size=min(group_size, num_prefill),
            num_decode=num_decode,
            num_store=num_store,
            api_port=0,
            block_tokens=prompts.block_tokens,
            chunk_tokens=chunk_tokens,
            pool=pool,
            run_dir=Path(tmp),
            extra=dict(parse_set_option(s) for s in sets),
        )
        result = calibrate(
            records,
            prompts,
            plan,
            speed,
            replay_fn=_replay_with_progress,  # the replay's progress bar
            on_progress=lambda s: err_console.print(s, highlight=False),
            warmup=warmup,
            repeat=repeat,
        )
    if as_json:
        print_json(result)
        return
    _print(result)


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_s"):
        return f"{value * 1000:,.1f} ms" if value < 1 else f"{value:,.3f} s"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _print(r: Calibration) -> None:
    from rich.table import Table

    from mooncake.bench.calibrate import FIGURES
    from mooncake.cli.output import console
    from mooncake.conductor.misses import CAUSES

    table = Table(
        title=f"{r.requests} requests at speed {r.speed:g}, scale {r.scale:g} on {r.cluster}"
    )
    for col in ("figure", "real", "sim", "sim / real"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name in FIGURES:
        ratio = r.ratio.get(name)
        table.add_row(
            name,
            _fmt(name, getattr(r.real, name)),
            _fmt(name, getattr(r.sim, name)),
            "-" if ratio is None else f"{ratio:.2f}",
        )
    table.add_row("failed", str(r.real.failed), str(r.sim.failed), "")
    table.add_row("completed", str(r.real.completed), str(r.sim.completed), "")
    real, sim = r.real.block_shares, r.sim.block_shares
    for cause in CAUSES if real or sim else ():  # blocks by cause / blocks requested
        table.add_row(
            f"blocks {cause}",
            _fmt(cause, real.get(cause)) if real else "-",
            _fmt(cause, sim.get(cause)),
            "",
        )
    console.print(table)
    console.print(f"cost model: {r.cost_model}; simulated in {r.sim_wall_s:.2f} s", highlight=False)
    if r.host is not None:
        h = r.host
        console.print(
            f"real: median of {len(r.real_runs)} run(s); host: {h.host_cores:g} cores, control "
            f"plane {h.background_cores:.2f} cores busy, idle latency "
            f"{h.overhead_s * 1000:.0f} ms; "
            f"lone {h.path.prompt_tokens}-token prompts: prefill path x{h.path.prefill:.2f}, "
            f"token gap x{h.path.decode:.2f} the cost model's (the twin computes at these); "
            f"a busy prefill stage keeps {h.prefill_cpu:.2f} cores busy, a decode node "
            f"{h.decode_cpu:.2f} (their processes' CPU in the replay over the twin's compute)",
            highlight=False,
        )
    if r.real_phases is not None and r.sim_phases is not None:
        _print_phases(r.real_phases, r.sim_phases)


def _print_phases(real: TtftPhases, sim: TtftPhases) -> None:
    """Where TTFT went, phase by phase (the first real run, the master's view)."""
    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(title="TTFT by phase (real: the first run's master)")
    for col in ("phase", "real P50", "sim P50", "real P90", "sim P90"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase in ("queue", "prefill", "first_step"):
        p50, p90 = f"{phase}_p50_s", f"{phase}_p90_s"
        table.add_row(
            phase.replace("_", " "),
            *(_fmt(p50, getattr(x, p50)) for x in (real, sim)),
            *(_fmt(p90, getattr(x, p90)) for x in (real, sim)),
        )
    console.print(table)

"""`mooncake bench faults TRACE`: a trace replayed against a fresh local cluster while one
node fails (killed, or stopped for a while), beside the same replay with no fault."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app

if TYPE_CHECKING:
    from mooncake.bench.faults import FaultResult


@bench_app.command("faults")
def bench_faults(
    trace: Path = typer.Argument(..., help="Mooncake-format JSONL trace."),
    faults: str = typer.Option(
        "none,decode-kill,store-kill,prefill-stage1-kill,master-kill,decode-stop",
        "--faults",
        help="Comma-separated faults, each on a fresh cluster: none (the baseline), "
        "decode-kill, store-kill, prefill-stage1-kill, master-kill (SIGKILL; the supervisor "
        "starts the node again), decode-stop (SIGSTOP for 30 s, then SIGCONT).",
    ),
    limit: int = typer.Option(150, "--limit", min=1, help="Replay the first N requests."),
    scale: float = typer.Option(0.0625, "--scale", help="Prompt scale (see `mooncake replay`)."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Cap on output tokens."),
    speed: float = typer.Option(2.0, "--speed", help="Arrival speed-up."),
    at: float = typer.Option(8.0, "--at", min=0, help="Seconds into the replay the fault strikes."),
    hang: float = typer.Option(
        120.0, "--hang", min=1, help="Seconds without an answer that make a request hung."
    ),
    model: str = typer.Option("dummy:tiny", "--model", help="Model the cluster serves."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Replay TRACE against a fresh `up --local` cluster (master, a 2-stage prefill group,
    a decode node, a store node; a supervisor restarting nodes that exit) once per fault,
    the fault striking --at seconds in. Reports requests completed (ok) / rejected (429) /
    failed (an error answer) / hung (no answer within --hang s), "back in": the seconds from
    the fault until a one-token probe (sent every 0.25 s, queued behind the backlog) is
    answered, the restarts the supervisor made, and the median TTFT of completed requests.
    The `none` row is the same replay with no fault."""
    from mooncake.bench.faults import FaultRun, parse_faults, run_fault
    from mooncake.cli.output import err_console, print_json
    from mooncake.local.cost import ensure_cost_model
    from mooncake.local.launcher import LocalPlan
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import load_trace

    chosen = parse_faults(faults)
    records = load_trace(trace, limit=limit)
    prompts = PromptConfig(scale=scale, output_scale=scale, max_tokens=max_tokens)
    prompts.validate()
    block_tokens = prompts.block_tokens
    run = FaultRun(at_s=at, hang_s=hang)
    results = []
    with tempfile.TemporaryDirectory(prefix="mooncake-faults-") as tmp:
        base = Path(tmp)
        for fault in chosen:
            plan = LocalPlan(
                model=model,
                api_port=0,
                block_tokens=block_tokens,
                run_dir=base / fault.name,
                extra={"scheduler.rejection": "none"},
            )
            cost = ensure_cost_model(plan, Path(tempfile.gettempdir()) / "mooncake-costmodels")
            err_console.print(f"[bold]{fault.name}[/]: starting a cluster", highlight=False)
            result = run_fault(
                fault,
                plan,
                cost,
                records,
                prompts,
                run,
                lambda s: err_console.print(f"  {s}", highlight=False),
            )
            results.append(result)
    if as_json:
        print_json(results)
        return
    _print(results)


def _print(results: list[FaultResult]) -> None:
    from rich import box
    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(
        title="Replay under faults (a fresh cluster per row; none = no fault)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("fault", no_wrap=True)
    for col in ("sent", "ok", "429", "failed", "hung", "back in", "restarts", "TTFT p50"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        again = "-" if r.serve_again_s is None else f"{r.serve_again_s:.1f} s"
        ttft = "-" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f} s"
        table.add_row(
            r.fault,
            str(r.sent),
            str(r.completed),
            str(r.rejected),
            str(r.failed),
            str(r.hung),
            again,
            str(r.restarts),
            ttft,
        )
    console.print(table)
    for r in results:
        for error, n in sorted(r.errors.items(), key=lambda kv: -kv[1])[:3]:
            console.print(f"  {r.fault}: {n} x {error}", highlight=False)

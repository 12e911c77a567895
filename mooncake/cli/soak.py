"""`mooncake soak`: a trace replayed for a set time against `up --local --masters N` while
nodes, the leading master and network links fail, one fault at a time."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import app

if TYPE_CHECKING:
    from rich.console import Console

    from mooncake.bench.soak.run import SoakConfig, SoakReport
    from mooncake.local.launcher import LocalPlan
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import TraceRecord


@app.command("soak")
def soak_cmd(
    duration: float = typer.Option(600.0, "--duration", min=1, help="Seconds to replay for."),
    fault_interval: float = typer.Option(
        30.0, "--fault-interval", min=1, help="Seconds between faults (the first after one)."
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        help="Mooncake-format JSONL trace, looped to fill --duration. Default: a synthesized "
        "mix of conversations, agents and document QA (`trace synth`), about a request a "
        "second.",
    ),
    faults: str = typer.Option(
        "master,prefill,decode,store,link",
        "--faults",
        help="Fault kinds, dealt in shuffled rounds: master (SIGKILL the leading master), "
        "prefill, decode, store (SIGKILL such a node at random; it is started again), link "
        "(degrade a namespaced node's veth link for --degrade-s).",
    ),
    masters: int = typer.Option(2, "--masters", min=1, help="Masters on the local etcd."),
    netns_nodes: str = typer.Option(
        "decode-0,store-0",
        "--netns-nodes",
        help="Nodes run each in a network namespace behind a veth link (needs root, "
        "iproute2); '' = every node on loopback, no link faults.",
    ),
    netem_delay: float = typer.Option(30.0, "--netem-delay", help="Degraded link: delay, ms."),
    netem_jitter: float = typer.Option(10.0, "--netem-jitter", help="Degraded link: jitter, ms."),
    netem_loss: float = typer.Option(2.0, "--netem-loss", help="Degraded link: loss, %."),
    netem_rate: str = typer.Option(
        "", "--netem-rate", help="Degraded link: a rate limit such as 20mbit ('' = none)."
    ),
    degrade_s: float = typer.Option(
        15.0, "--degrade-s", min=0, help="Seconds a link stays degraded."
    ),
    settle: float = typer.Option(
        25.0, "--settle", min=1, help="Seconds the cluster is given to come back from a fault."
    ),
    warmup: float = typer.Option(
        60.0, "--warmup", min=0, help="Seconds after a process starts whose RSS is not judged."
    ),
    hang_grace: float = typer.Option(
        30.0,
        "--hang-grace",
        min=0,
        help="A request unanswered this long past the cluster's deadline for it is hung.",
    ),
    scale: float = typer.Option(0.0625, "--scale", help="Prompt scale (see `mooncake replay`)."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Cap on output tokens."),
    speed: float = typer.Option(1.0, "--speed", help="Arrival speed-up of the trace."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fault order, targets and trace."),
    model: str = typer.Option("dummy:tiny", "--model", help="Model the cluster serves."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Soak a fresh local cluster: `up --local --masters N` (a local etcd, N masters, a
    2-stage prefill group, a decode and a store node; the nodes in --netns-nodes each in a
    network namespace with its own /dev/shm, behind a veth link on a bridge), a supervisor
    restarting what dies, the trace replayed for --duration, a fault every
    --fault-interval. A degraded link gets `tc netem` delay, jitter and loss both ways (on
    a kernel without netem: loss by a BPF filter and the rate limit, no delay).

    Reports requests completed / rejected / failed (by error kind) / hung (unanswered
    --hang-grace past the cluster's deadline), every fault with the cluster's return
    (master: a new leader answering, every node back, a request served, pool objects
    before and after), each process's RSS over time with growth after --warmup, and
    whether every master serves at the end. Exits 1 when a check fails (a hung request, an
    unclear error, RSS growth over 20%, a failover over 5 s or losing objects, not
    serving at the end)."""
    from mooncake.bench.soak.faults import KINDS, FaultPlan
    from mooncake.bench.soak.netns import Degrade
    from mooncake.bench.soak.run import SoakConfig, default_trace
    from mooncake.cli.output import err_console, print_json
    from mooncake.errors import ConfigError
    from mooncake.local.cost import ensure_cost_model
    from mooncake.local.launcher import LocalPlan
    from mooncake.replay.prompts import PromptConfig
    from mooncake.sim.trace import load_trace

    names = [k.strip() for k in faults.split(",") if k.strip()]
    kinds = tuple(k for k in KINDS if k in names)
    if not names or (bad := [k for k in names if k not in KINDS]):
        raise ConfigError(f"--faults: name kinds among {', '.join(KINDS)}, got {faults!r}")
    records = load_trace(trace) if trace is not None else default_trace(seed)
    prompts = PromptConfig(scale=scale, output_scale=scale, max_tokens=max_tokens)
    prompts.validate()
    degrade = Degrade(netem_delay, netem_jitter, netem_loss, netem_rate)
    degrade.validate()
    nodes = tuple(n.strip() for n in netns_nodes.split(",") if n.strip())
    cfg = SoakConfig(
        duration_s=duration,
        fault_interval_s=fault_interval,
        warmup_s=warmup,
        speed=speed,
        seed=seed,
        netns_nodes=nodes,
        faults=FaultPlan(kinds=kinds, settle_s=settle, degrade=degrade, degrade_s=degrade_s),
        hang_grace_s=hang_grace,
    )
    with tempfile.TemporaryDirectory(prefix="mooncake-soak-") as tmp:
        plan = LocalPlan(
            model=model,
            api_port=0,
            block_tokens=prompts.block_tokens,
            num_masters=masters,
            run_dir=Path(tmp),
            extra={"scheduler.rejection": "none"},
        )
        known = {
            f"{r}-{i}"
            for r, n in (
                ("prefill", plan.num_prefill),
                ("decode", plan.num_decode),
                ("store", plan.num_store),
            )
            for i in range(n)
        }
        if bad := [n for n in nodes if n not in known]:
            raise ConfigError(f"--netns-nodes: no node {bad}; nodes: {', '.join(sorted(known))}")
        cost = ensure_cost_model(plan, Path(tempfile.gettempdir()) / "mooncake-costmodels")
        report = _run_with_progress(plan, cost, records, prompts, cfg, err_console)
    if as_json:
        print_json(report)
    else:
        _print(report)
    if not all(report.checks.values()):
        raise typer.Exit(1)


def _run_with_progress(
    plan: LocalPlan,
    cost: Path,
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: SoakConfig,
    console: Console,
) -> SoakReport:
    """`run_soak` under a rich progress bar: the figures so far, each event as a line."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from mooncake.bench.soak.run import SoakProgress, run_soak

    with Progress(
        TextColumn("soak"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    ) as progress:
        task = progress.add_task("starting the cluster", total=cfg.duration_s)

        def tick(p: SoakProgress) -> None:
            text = (
                f"sent {p.sent} ok {p.completed} failed {p.failed} hung {p.hung} "
                f"faults {p.num_faults} | {p.last}"
            )
            progress.update(task, completed=p.elapsed_s, description=text)

        return run_soak(
            plan,
            cost,
            records,
            prompts,
            cfg,
            lambda s: progress.console.print(f"  {s}", highlight=False),
            tick,
        )


def _print(r: SoakReport) -> None:
    from rich import box
    from rich.table import Table

    from mooncake.cli.output import console

    console.print(
        f"requests: {r.sent} sent, {r.completed} completed, {r.rejected} rejected, "
        f"{r.failed} failed, {r.hung} hung; {r.restarts} restarts",
        highlight=False,
    )
    for kind, n in sorted(r.errors.items(), key=lambda kv: -kv[1]):
        console.print(f"  {n} x {kind}: {r.error_examples.get(kind, '')}", highlight=False)
    table = Table(title="Faults", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("at", "kind", "target", "how", "leader", "nodes", "serves", "objects"):
        table.add_column(col, no_wrap=col != "how")

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} s"

    for f in r.faults:
        objects = "-" if f.objects_before is None else f"{f.objects_before} -> {f.objects_after}"
        table.add_row(
            f"{f.at_s:.0f}",
            f.kind,
            f.target,
            f.error or f.how,
            secs(f.leader_s),
            secs(f.nodes_s),
            secs(f.serve_s),
            objects,
        )
    console.print(table)
    mem = Table(title=f"RSS (growth after {r.warmup_s:g} s of warm-up)", box=box.SIMPLE_HEAD)
    for col in ("process", "pid", "lived", "peak RSS", "RSS growth", "private growth"):
        mem.add_column(col, justify="left" if col == "process" else "right")

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1%}"

    for p in r.rss:
        mem.add_row(
            p.name,
            str(p.pid),
            f"{p.first_s:.0f}-{p.last_s:.0f} s",
            f"{p.peak_rss_bytes / 2**20:.0f} MiB",
            pct(p.rss_growth),
            pct(p.anon_growth),
        )
    console.print(mem)
    console.print(f"serves at the end: {'yes' if r.serves_at_end else 'no: ' + r.end_error}")
    for name, ok in r.checks.items():
        console.print(f"  {'pass' if ok else 'FAIL'} {name}", highlight=False)

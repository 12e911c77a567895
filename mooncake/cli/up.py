"""`mooncake up`: start this node in its role, or (`--local`) a whole cluster on this machine."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import app
from mooncake.cli.config_cmd import SET_HELP, _load


@app.command("up")
def up(
    role: str = typer.Option(
        "", "--role", "-r", help="master, prefill, decode or store; default: node.role."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", envvar="MOONCAKE_CONFIG", help="TOML config file."
    ),
    sets: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    local: bool = typer.Option(
        False,
        "--local",
        help="Start a whole cluster on this machine: master, prefill "
        "nodes (one pipeline group), decode node(s) and a store node, on loopback.",
    ),  # fmt: skip
    num_prefill: int = typer.Option(2, "--prefill", min=1, help="--local: prefill nodes."),
    group_size: int = typer.Option(
        2, "--group-size", min=1, help="--local: prefill nodes per pipeline group."
    ),
    num_decode: int = typer.Option(1, "--decode", min=1, help="--local: decode nodes."),
    num_store: int = typer.Option(1, "--store", min=0, help="--local: store nodes."),
    model: str = typer.Option("dummy:tiny", "--model", help="--local: model path."),
    port: int = typer.Option(
        8000, "--port", min=0, max=65535, help="--local: HTTP API port (0 = any free one)."
    ),  # fmt: skip
    block_tokens: int = typer.Option(
        32, "--block-tokens", min=1, help="--local: tokens per KV block."
    ),  # fmt: skip
    pool: bool = typer.Option(
        True, "--pool/--no-pool", help="--local: the KV pool (off = recompute every prefix)."
    ),  # fmt: skip
    cost_model: Path | None = typer.Option(
        None,
        "--cost-model",
        help="--local: the Conductor's cost model file (default: "
        "profile the model once and cache the result).",
    ),  # fmt: skip
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="--local: where the generated config goes (default: a "
        "directory under the user's runtime dir).",
    ),  # fmt: skip
) -> None:
    """Start one node in its role and serve until SIGINT/SIGTERM (then drain and deregister),
    or with --local a whole cluster as separate processes on loopback, printing the URL
    to send OpenAI-compatible requests to. Ctrl-C stops every process."""
    if local:
        _up_local(num_prefill, group_size, num_decode, num_store, model, port, block_tokens,
                  pool, run_dir, sets, cost_model)  # fmt: skip
        return
    import logging

    from mooncake.roles import run_node

    cfg = _load(config, sets).config
    the_role = role or cfg.node.role
    if the_role not in ("master", "prefill", "decode", "store"):
        raise typer.BadParameter(f"{the_role!r}: expected master, prefill, decode or store",
                                 param_hint="--role")  # fmt: skip
    logging.getLogger(__name__).info("starting %s node", the_role)
    run_node(cfg, the_role)


def _up_local(num_prefill: int, group_size: int, num_decode: int, num_store: int, model: str,
              port: int, block_tokens: int, pool: bool, run_dir: Path | None,
              sets: list[str], cost_model: Path | None) -> None:  # fmt: skip
    import signal
    import threading

    from mooncake.cli.output import console, err_console
    from mooncake.config import parse_set_option
    from mooncake.roles.local import LocalLauncher, LocalPlan, ensure_cost_model
    from mooncake.roles.runfile import read_runfile, runfile_path

    running = read_runfile()
    if running is not None:
        raise typer.BadParameter(f"a local cluster already runs at {running.url} (master pid "
                                 f"{running.pids.get('master')}); stop it first")  # fmt: skip
    base = run_dir or runfile_path().parent
    plan = LocalPlan(model=model, num_prefill=num_prefill, group_size=min(group_size, num_prefill),
                     num_decode=num_decode, num_store=num_store, api_port=port,
                     block_tokens=block_tokens, pool=pool, run_dir=base,
                     cost_model_path=str(cost_model or ""),
                     extra=dict(parse_set_option(s) for s in sets))  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with err_console.status("starting the local cluster") as status:
        cost = ensure_cost_model(plan, base / "cache", lambda s: status.update(s))
        launcher = LocalLauncher(plan, lambda s: status.update(s))
        info = launcher.start(str(cost))
    console.print(f"[bold green]mooncake local cluster ready[/]: {info.url}  "
                  f"({num_prefill} prefill, {num_decode} decode, "
                  f"{num_store if pool else 0} store; model {model})")  # fmt: skip
    console.print(
        f"  try: curl {info.url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\''
    )
    console.print("  watch: mooncake status    load: mooncake replay TRACE    stop: Ctrl-C")
    code = 0
    watcher = threading.Thread(target=lambda: stop.set() if launcher.wait() else None,
                               daemon=True)  # fmt: skip
    watcher.start()
    stop.wait()
    crashed = [c for c in launcher.children if c.proc.poll() not in (None, 0)]
    if crashed:
        code = 1
        err_console.print(f"[red]{crashed[0].node_id} exited; stopping the cluster[/]")
    err_console.print("stopping the local cluster")
    launcher.stop()
    if code:
        raise typer.Exit(code)

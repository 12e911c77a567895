"""`mooncake doctor`: this node's readiness, check by check, with the fix for each."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import app
from mooncake.cli.output import sysfs_root_option

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


@app.command(
    "doctor",
    help="Check whether this node is ready to serve: the NVIDIA driver and NVML (a GPU that "
    "torch sees but NVML does not report fails, naming the fix), "
    "CUDA_VISIBLE_DEVICES against NVML's GPUs, each RDMA device (port state, link layer, a "
    "RoCE v2 GID, active MTU), GPU memory registration (nvidia-peermem or dma-buf), "
    "RLIMIT_MEMLOCK and each GPU's NIC (PCIe and NUMA pairing); with --config also the SSD "
    "tier's directory (O_DIRECT, free space), the ports, and the master (reached, cluster "
    "secret accepted). Each check passes, warns or fails with its fix in one line; checks "
    "that do not apply are skipped. A node without GPU or RDMA gets warnings, not failures. "
    "Exits 1 when a check fails, else 0.",
)
def doctor(
    config: Path | None = typer.Option(
        None, "--config", metavar="FILE", help="Also check what this node's config needs."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='Print {"checks": [{name, status, detail, fix}], "summary": {pass, warn, fail, '
        'skip}, "ok": bool} instead of the table.',
    ),
    sysfs_root: Path = sysfs_root_option("NVML, limits and the environment"),
) -> None:
    """Run the checks and print them."""
    from rich.table import Table

    from mooncake.cli.output import console, print_json
    from mooncake.hw.doctor import check_node, gather, summary

    checks = check_node(gather(sysfs_root))
    if config is not None:
        from mooncake.config.load import load_config
        from mooncake.hw.doctorconfig import check_config

        checks += check_config(load_config(config).config)
    counts = summary(checks)
    if as_json:
        print_json({"checks": checks, "summary": counts, "ok": counts["fail"] == 0})
    else:
        table = Table(title="mooncake doctor", show_lines=False)
        for column in ("", "check", "found", "fix"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(f"[{_STYLE[c.status]}]{c.status}[/]", c.name, c.detail, c.fix)
        console.print(table)
        console.print(", ".join(f"{n} {status}" for status, n in counts.items()))
    raise typer.Exit(1 if counts["fail"] else 0)

"""`mooncake bench dropin`: one workload through upstream's Python API, on this package and
on upstream's wheel in the same run, side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import bench_app
from mooncake.errors import ConfigError

if TYPE_CHECKING:
    from rich.table import Table

    from mooncake.bench.dropin import DropinRow

SIDES = ("ours", "upstream")


@bench_app.command("dropin")
def bench_dropin(
    upstream: str = typer.Option(
        "",
        "--upstream",
        envvar="MOONCAKE_UPSTREAM_PYTHON",
        help="Python of a venv with upstream Mooncake's wheel (scripts/upstream-venv makes "
        "one): its mooncake_master, store and Transfer Engine are the baseline.",
    ),
    sides: str = typer.Option(
        "ours,upstream", "--sides", help="Which sides to run: ours, upstream or both."
    ),
    duration: float = typer.Option(
        1.0, "--duration", min=0.05, help="Seconds of each timed phase."
    ),
    warmup: float = typer.Option(
        1.0, "--warmup", min=0.0, help="Untimed seconds of 4 KiB put/get before the cells."
    ),
    segment: str = typer.Option(
        "512MiB", "--segment", help="Segment the store node of each side contributes."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the rows and each side's error as JSON instead of a table."
    ),
) -> None:
    """Run the same small workload through upstream Mooncake's Python API on each side:
    put/get of 4 KiB and 1 MiB values, batch_put_from/batch_get_into of 64 x 64 KiB from
    and into registered buffers, and a Transfer Engine's transfer_sync_write of 1 MiB to a
    second engine, all over tcp on 127.0.0.1. Ours runs with this package's
    mooncake_master; upstream's with its wheel's. GB/s is bytes over summed call time; p50
    is per call. Exits 1 when a side fails (its reason is shown; the other still reports).
    """
    from mooncake.bench.dropin import SideResult, SideSpec, compare, ours_available, run_side
    from mooncake.cli.output import console, err_console, print_json
    from mooncake.config.sizes import parse_size

    wanted = [s.strip() for s in sides.split(",") if s.strip()]
    if not wanted or any(s not in SIDES for s in wanted):
        raise ConfigError(f"--sides: expected ours, upstream or both, got {sides!r}")
    if "upstream" in wanted and not upstream:
        raise ConfigError(
            "--upstream: give the Python of an upstream venv (scripts/upstream-venv), "
            "or --sides ours"
        )
    segment_bytes = parse_size(segment)
    results = {name: SideResult(name, error="not run") for name in SIDES}
    for name in wanted:
        if name == "ours" and (lack := ours_available()):
            results[name] = SideResult(name, error=f"this package lacks upstream's API: {lack}")
            continue
        spec = SideSpec.ours() if name == "ours" else SideSpec.upstream(upstream)
        results[name] = run_side(spec, duration, warmup, segment_bytes)
    rows = compare(results["ours"], results["upstream"])
    errors = {n: r.error for n, r in results.items() if n in wanted and r.error}
    if as_json:
        print_json({"rows": rows, "errors": errors})
    else:
        console.print(_table(rows, f"upstream's API, tcp on 127.0.0.1, {duration:g} s per phase"))
        for name, error in errors.items():
            err_console.print(f"[red]{name}[/red]: {error}")
    if errors:
        raise typer.Exit(1)


def _table(rows: list[DropinRow], title: str) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "cell",
        "op",
        "ours GB/s",
        "upstream GB/s",
        "ours/upstream",
        "p50 us ours/upstream",
    ):
        table.add_column(col, justify="left" if col in ("cell", "op") else "right")

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in rows:
        table.add_row(
            r.cell,
            r.op,
            num(r.ours_gbps, ".3f"),
            num(r.upstream_gbps, ".3f"),
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            f"{num(r.ours_p50_us, ',.0f')}/{num(r.upstream_p50_us, ',.0f')}",
        )
    return table

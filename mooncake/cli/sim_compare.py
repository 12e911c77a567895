"""`mooncake sim compare`: one cluster, one setting varied, over several replay speeds.

    mooncake sim compare TRACE --prefill 9 --decode 2 --vary rejection=none,basic,predictive \
        --speeds 3.5,4,4.5

The paper's Table 3 (rejections per early-rejection mode) and Figure 8 (TTFT per policy)
are comparisons of this kind; each row is a whole `mooncake sim` run of the same trace.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from mooncake.cli.sim import OPT, TRACE_HELP, _config, sim_app
from mooncake.errors import ConfigError


def _binding(value: str) -> bool:
    if value not in ("late", "arrival"):
        raise ValueError("binding is late or arrival")
    return value == "late"


VARIABLE: dict[str, tuple[str, Callable[[str], Any]]] = {  # --vary NAME -> (field, parser)
    "rejection": ("rejection", str),
    "policy": ("policy", str),
    "threshold": ("balancing_threshold", float),
    "binding": ("late_binding", _binding),
    "defer": ("defer_s", float),
}
COLUMNS = (  # (SimResult field, header, format)
    ("completed", "done", "{:,}"),
    ("rejected", "rejected", "{:,}"),
    ("rejected_ttft_slo", "arr:TTFT", "{:,}"),  # at arrival, predicted TTFT over the SLO
    ("rejected_decode_load", "arr:dec", "{:,}"),  # at arrival, decode load over the limit
    ("rejected_at_prefill_start", "start", "{:,}"),  # when the prefill was about to start
    ("rejected_after_prefill", "late", "{:,}"),  # by the decode instance, prefill spent
    ("waited", "waited", "{:,}"),  # admitted after waiting for an idle group (defer_s)
    ("wasted_prefill_gpu_s", "wasted GPU-s", "{:,.0f}"),
    ("ttft_mean_s", "TTFT mean", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90", "{:.2f}"),
    ("tbt_p90_s", "TBT p90", "{:.3f}"),
    ("slo_attainment", "SLO", "{:.3f}"),
)


def parse_vary(spec: str) -> tuple[str, str, list[tuple[str, Any]]]:
    """ "name=a,b,c" -> (name, SimConfig field, [(value as given, parsed)]); ConfigError
    when bad (unknown values of rejection and policy are named by SimConfig itself)."""
    name, _, values = spec.partition("=")
    if name not in VARIABLE or not values:
        raise ConfigError(
            f"--vary: expected NAME=V1,V2,... with NAME one of {', '.join(VARIABLE)}, got {spec!r}"
        )
    field, parse = VARIABLE[name]
    try:
        parsed = [(v.strip(), parse(v.strip())) for v in values.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--vary {name}: cannot read {values!r} ({e})") from e
    return name, field, parsed


@sim_app.command("compare")
def sim_compare(
    trace: Path = typer.Argument(..., help=TRACE_HELP, show_default=False),
    vary: str = typer.Option(
        "rejection=none,basic,predictive",
        "--vary",
        help="The setting compared and its values: rejection=..., policy=..., "
        "threshold=..., binding=late,arrival or defer=0,10 (scheduler.defer_s).",
    ),
    speeds: str = typer.Option("1", "--speeds", help="Replay speeds, comma-separated."),
    prefill: int = OPT["prefill"],
    decode: int = OPT["decode"],
    coupled: int = OPT["coupled"],
    policy: str = OPT["policy"],
    rejection: str = OPT["rejection"],
    late_binding: bool = OPT["late_binding"],
    threshold: float = OPT["threshold"],
    gpu: str = OPT["gpu"],
    model: str = OPT["model"],
    tp: int = OPT["tp"],
    cost_model: Path | None = OPT["cost_model"],
    pool_blocks: int | None = OPT["pool_blocks"],
    dram_bytes: str = OPT["dram_bytes"],
    ssd_bytes: str = OPT["ssd_bytes"],
    limit: int | None = OPT["limit"],
    ttft_slo: float = OPT["ttft_slo"],
    tbt_slo: float = OPT["tbt_slo"],
    chunk_tokens: int = OPT["chunk_tokens"],
    block_tokens: int = OPT["block_tokens"],
    seed: int = OPT["seed"],
    json_out: bool = OPT["json"],
) -> None:
    """Replay TRACE once per (speed, value of --vary) on the same cluster and print one
    row each: requests completed and rejected (where: at arrival for TTFT or decode load,
    at prefill start, after prefill), prefill wasted on late rejections, TTFT and TBT."""
    import msgspec

    from mooncake.sim.simulator import run_sim
    from mooncake.sim.trace import load_trace

    name, field, values = parse_vary(vary)
    try:
        speed_list = [float(s) for s in speeds.split(",") if s.strip()]
    except ValueError as e:
        raise ConfigError(f"--speeds: expected comma-separated numbers, got {speeds!r}") from e
    base = _config(dict(locals()))
    records = load_trace(trace, limit=limit, block_tokens=block_tokens)
    rows = []
    for speed in speed_list:
        for label, value in values:
            cfg = msgspec.structs.replace(base, speed=speed, **{field: value})
            rows.append((speed, label, run_sim(cfg, records).result))
    print_comparison(name, rows, json_out)


def print_comparison(name: str, rows: list[tuple[float, Any, Any]], json_out: bool) -> None:
    from mooncake.cli.output import console, print_json

    if json_out:
        import msgspec

        print_json([{"speed": s, name: v, **msgspec.structs.asdict(r)} for s, v, r in rows])
        return
    from rich.table import Table

    table = Table(
        title=f"sim compare: {name}",
        caption="rejected = arr:TTFT + arr:dec (at arrival) + start (at prefill start) + late "
        "(after prefill, by the decode instance); times in seconds",
    )
    for header in ("speed", name, *(h for _, h, _ in COLUMNS)):
        table.add_column(header, justify="right", no_wrap=True)
    for speed, value, r in rows:
        cells = [fmt.format(getattr(r, f)) for f, _, fmt in COLUMNS]
        table.add_row(f"x{speed:g}", str(value), *cells)
    console.print(table)

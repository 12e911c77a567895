"""What `mooncake status` draws: a `Status` snapshot as rich renderables.

Pure functions of the snapshot and the terminal width, so tests render to text. Below
`WIDE` columns the view fits 80: GPU and NIC names become counts and bars shorten; from
`WIDE` it shows the names, and from `SIDE_BY_SIDE` the pool sits beside the figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # rich is imported inside the functions: every verb module loads at start
    from rich.console import RenderableType
    from rich.table import Table
    from rich.text import Text

    from mooncake.api.status import KVBlockShares, NodeStatus, Status

WIDE = 110  # columns from which nodes show GPU and NIC names and pool bars are longer
SIDE_BY_SIDE = 140  # columns from which the pool table sits beside the serving figures
SloVerdict = Literal["within", "over", "unknown"]
STATE_STYLE = {
    "ready": "green",
    "starting": "yellow",
    "draining": "yellow",
    "failed": "bold red",
    "down": "bold red",
}


def slo_verdict(value_s: float | None, slo_s: float) -> SloVerdict:
    """`within` when a latency meets its SLO (<=), `over` when not, `unknown` before data."""
    if value_s is None:
        return "unknown"
    return "within" if value_s <= slo_s else "over"


def slo_style(value_s: float | None, slo_s: float) -> str:
    return {"within": "green", "over": "bold red", "unknown": "dim"}[slo_verdict(value_s, slo_s)]


def usage_style(fraction: float) -> str:
    """Color of a load or fill bar: green below 70 %, yellow below 90 %, red above."""
    return "green" if fraction < 0.7 else "yellow" if fraction < 0.9 else "red"


def human_bytes(num_bytes: float) -> str:
    """Binary units, as memory is sized: 1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    """Decimal units, as links are rated: 1.25e9 -> "1.25 GB/s"."""
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if bytes_per_s < 1000 or unit == "GB/s":
            return f"{bytes_per_s:.0f} {unit}" if unit == "B/s" else f"{bytes_per_s:.2f} {unit}"
        bytes_per_s /= 1000
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """0.42 -> "0.4s", 75 -> "1m15s", 7384 -> "2h03m", 200000 -> "2d07h"."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def latency(value_s: float | None) -> str:
    if value_s is None:
        return "-"
    return f"{value_s * 1000:.0f} ms" if value_s < 1 else f"{value_s:.2f} s"


def bar(fraction: float, width: int) -> Text:
    """A `width`-cell bar and the percentage, colored by `usage_style`."""
    from rich.text import Text

    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    text = Text("█" * filled + "░" * (width - filled), style=usage_style(fraction))
    text.append(f" {fraction * 100:3.0f}%")
    return text


def _gpus(gpus: list[str]) -> str:
    if not gpus:
        return "-"
    if len(set(gpus)) == 1:
        return f"{len(gpus)}× {gpus[0].removeprefix('NVIDIA ')}"
    return f"{len(gpus)} mixed"


def _nics(nics: list[str]) -> str:
    names = ",".join(nics) or "-"
    return names if len(names) <= 24 else f"{len(nics)} NICs"


def _counts(gpus: list[str], nics: list[str]) -> str:
    """The narrow layout's "GPU/NIC" cell: "8/4", or "-" for a node with neither."""
    return f"{len(gpus)}/{len(nics)}" if gpus or nics else "-"


def _table(title: str, is_wide: bool) -> Table:
    from rich import box
    from rich.table import Table

    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1 if is_wide else 0),  # columns 2 apart when wide, 1 apart in 80
        collapse_padding=True,
        pad_edge=False,
    )


def header(status: Status, url: str) -> Text:
    from rich.text import Text

    text = Text.assemble(
        ("mooncake ", "bold"),
        (status.cluster, "bold cyan"),
        "  model ",
        (status.model, "bold"),
        f"  up {human_duration(status.uptime_s)}",
    )
    text.append(f"  {url}", style="dim")
    if len(status.masters) > 1:  # NOTE: one master is the plain case: nothing to say
        text.append("\nmasters ")
        for m in status.masters:
            text.append(f" {m.id}@{m.address} pid {m.pid}", style="bold" if m.is_leader else "dim")
            text.append(
                " (leads)" if m.is_leader else " (standby)", style="green" if m.is_leader else "dim"
            )
    return text


def nodes_table(nodes: list[NodeStatus], width: int) -> Table:
    from rich.markup import escape
    from rich.text import Text

    from mooncake.api.status import host_port

    is_wide = width >= WIDE
    table = _table(f"nodes ({len(nodes)})", is_wide)
    for name in ("node", "role", "address"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    table.add_column("state", no_wrap=True)
    if is_wide:
        table.add_column("GPUs", no_wrap=True, overflow="ellipsis")
        table.add_column("NICs", no_wrap=True, overflow="ellipsis")
    else:
        table.add_column("GPU/NIC", justify="right", no_wrap=True)
    table.add_column("q/run", justify="right", no_wrap=True)
    table.add_column("load", no_wrap=True)
    table.add_column("seen", justify="right", no_wrap=True)
    table.add_column("group", no_wrap=True, overflow="ellipsis")
    order = {"master": 0, "prefill": 1, "decode": 2, "store": 3}
    for n in sorted(nodes, key=lambda n: (order.get(n.role, 9), n.node_id)):
        hardware = [escape(_gpus(n.gpus)), escape(_nics(n.nics))] if is_wide else []
        table.add_row(
            escape(n.node_id),
            escape(n.role),
            escape(host_port(n.address)) or "-",
            Text(n.state, style=STATE_STYLE.get(n.state, "")),
            *(hardware or [_counts(n.gpus, n.nics)]),
            f"{n.num_queued}/{n.num_running}",
            bar(n.load, 10 if is_wide else 4),
            human_duration(n.last_seen_s),
            escape(n.pipeline_group) or "-",
            style="dim" if n.state == "down" else None,
        )
    return table


def pool_table(status: Status, width: int) -> Table:
    from rich.markup import escape

    table = _table("KV pool", width >= WIDE)
    for name, justify in (("tier", "left"), ("used / capacity", "right"), ("fill", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    table.add_column("objects", justify="right", no_wrap=True)
    table.add_column("hits", justify="right", no_wrap=True)
    tiers = sorted(status.pool, key=lambda t: {"vram": 0, "dram": 1, "ssd": 2}.get(t.tier, 9))
    num_hits = sum(t.num_hits for t in tiers)
    for t in tiers:
        fill = t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        used = f"{human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)}"
        hits = f"{t.num_hits:,} ({t.num_hits / num_hits:.0%})" if num_hits else "0"
        table.add_row(
            escape(t.tier), used, bar(fill, 12 if width >= WIDE else 8), f"{t.num_objects:,}", hits
        )
    if not tiers:
        table.add_row("-", "no pool memory registered", "", "", "")
    elif status.num_demotions or status.num_promotions:
        table.caption = (
            f"{status.num_demotions:,} moved down a tier (DRAM -> SSD), "
            f"{status.num_promotions:,} up on a hit"
        )
    return table


def pool_nodes_table(status: Status, width: int) -> Table | None:
    """What each node gives the pool, per tier (None when no node gives any)."""
    from rich.markup import escape

    givers = [n for n in status.nodes if n.pool_bytes]
    if not givers:
        return None
    # NOTE: every serving node is listed, so one whose memory left the pool shows as "-"
    rows = sorted((n for n in status.nodes if n.role != "master"), key=lambda n: n.node_id)
    table = _table("KV pool by node", width >= WIDE)
    table.add_column("node", no_wrap=True, overflow="ellipsis")
    tiers = [t for t in ("vram", "dram", "ssd") if any(t in n.pool_bytes for n in givers)]
    for t in tiers:
        table.add_column(t, justify="right", no_wrap=True)
    for n in rows:
        cells = [human_bytes(n.pool_bytes[t]) if t in n.pool_bytes else "-" for t in tiers]
        table.add_row(escape(n.node_id), *cells)
    return table


TRANSPORT_ORDER = ("shm", "rdma", "tcp", "local")


def transfers_table(status: Status, width: int) -> Table | None:
    """Bytes each node moved per transport since it started (None before any moved): shm
    means peers on this host were reached through shared memory, not the network."""
    from rich.markup import escape

    movers = sorted(
        (n for n in status.nodes if any(n.transfer_bytes.values())), key=lambda n: n.node_id
    )
    if not movers:
        return None
    used = {t for n in movers for t, b in n.transfer_bytes.items() if b}
    names = [t for t in TRANSPORT_ORDER if t in used] + sorted(used - set(TRANSPORT_ORDER))
    table = _table("KV moved by node", width >= WIDE)
    table.add_column("node", no_wrap=True, overflow="ellipsis")
    for t in names:
        table.add_column(escape(t), justify="right", no_wrap=True)
    for n in movers:
        cells = [
            human_bytes(n.transfer_bytes[t]) if n.transfer_bytes.get(t) else "-" for t in names
        ]
        table.add_row(escape(n.node_id), *cells)
    return table


def metrics_table(status: Status) -> Table:
    from rich.table import Table
    from rich.text import Text

    s = status
    table = Table.grid(padding=(0, 2))
    table.title, table.title_justify, table.title_style = "serving", "left", "bold"
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    # NOTE: two measures, labelled by what they count (api/status.py): the API's cached
    # tokens, and the blocks the Conductor's index showed when it placed each request
    tokens = (
        f"  ({s.num_cached_tokens:,} of {s.num_prompt_tokens:,})" if s.num_prompt_tokens else ""
    )
    table.add_row(
        "cached tokens",
        f"{s.cached_token_share * 100:.1f}% of prompt tokens served from cache{tokens}",
    )
    lookups = f"  ({s.pool_hits:,} of {s.pool_lookups:,})" if s.pool_lookups else ""
    table.add_row(
        "pool hits", f"{s.hit_rate * 100:.1f}% of blocks in the pool at placement{lookups}"
    )
    table.add_row("local hits", f"{s.local_hit_rate * 100:.1f}% of blocks on the chosen node")
    if (kv := s.kv_blocks) is not None and kv.blocks:
        table.add_row("blocks", misses_line(kv))
    waits = f"  ({s.num_waiting:,} waiting for an idle group)" if s.num_waiting else ""
    table.add_row("queues", f"{s.num_queued:,} queued  {s.num_running:,} running{waits}")
    if s.num_waited or s.num_waited_out:
        table.add_row("waited", f"{s.num_waited:,} placed, {s.num_waited_out:,} refused")
    for name, p50, p90, slo in (
        ("TTFT", s.ttft_p50_s, s.ttft_p90_s, s.ttft_slo_s),
        ("TBT", s.tbt_p50_s, s.tbt_p90_s, s.tbt_slo_s),
    ):
        row = Text.assemble(
            "P50 ",
            (latency(p50), slo_style(p50, slo)),
            "  P90 ",
            (latency(p90), slo_style(p90, slo)),
            (f"  SLO {latency(slo)}", "dim"),
        )
        table.add_row(name, row)
    if (ph := s.ttft_phases) is not None and ph.num_requests:
        ratio = ph.predicted_over_actual_p50
        predicted = f"  Conductor's prediction x{ratio:.2f}" if ratio is not None else ""
        table.add_row(
            "TTFT P50 in",
            f"queue {latency(ph.queue_p50_s)}  prefill {latency(ph.prefill_p50_s)}  "
            f"first step {latency(ph.first_step_p50_s)}{predicted}",
        )
    table.add_row(
        "requests",
        Text.assemble(
            f"{s.num_requests:,} received  {s.num_completed:,} completed  ",
            (f"{s.rejected:,} rejected", "yellow" if s.rejected else ""),
            "  ",
            (f"{s.num_failed:,} failed", "red" if s.num_failed else ""),
            (f"  {s.num_refused:,} refused (4xx)", "dim"),
        ),
    )
    table.add_row("transfer", human_rate(s.transfer_bytes_per_s))
    return table


def misses_line(kv: KVBlockShares) -> str:
    """The prefills' blocks by cause as shares (roles/master/attribution.py)."""
    from mooncake.conductor.misses import CAUSES

    sh = kv.shares
    parts = "  ".join(f"{c} {sh.get(c, 0.0) * 100:.1f}%" for c in CAUSES)
    return f"{parts}  ({kv.blocks:,} blocks of {kv.requests:,} prefills)"


def render_status(status: Status, url: str, width: int) -> RenderableType:
    """The whole view of one snapshot for a terminal `width` columns wide."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    # NOTE: the nodes table grows with the cluster, so it comes last: a short terminal
    # crops it, never the figures.
    parts: list[RenderableType] = [header(status, url), Text()]
    pool: list[RenderableType] = [pool_table(status, width)]
    by_node = pool_nodes_table(status, width)
    if by_node is not None:
        pool += [Text(), by_node]
    moved = transfers_table(status, width)
    if moved is not None:
        pool += [Text(), moved]
    if width >= SIDE_BY_SIDE:
        side = Table.grid(padding=(0, 4))
        side.add_row(metrics_table(status), Group(*pool))
        parts.append(side)
    else:
        parts += [metrics_table(status), Text(), *pool]
    parts += [Text(), nodes_table(status.nodes, width)]
    return Group(*parts)


def render_unreachable(
    url: str, error: str, down_for_s: float, interval_s: float, last: Status | None, width: int
) -> RenderableType:
    """The view while the master does not answer: why, for how long, and the last snapshot."""
    from rich.console import Group
    from rich.text import Text

    banner = Text.assemble(
        ("master unreachable", "bold red"),
        f" for {human_duration(down_for_s)} at {url}: {error}\n",
        (f"retrying every {interval_s:g}s (Ctrl-C to quit)", "dim"),
    )
    if last is None:
        return banner
    return Group(banner, Text("last snapshot:", style="dim"), render_status(last, url, width))

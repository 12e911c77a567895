"""`mooncake status`'s view: a Status rendered to text at 80 and 120 columns, SLO colors, units."""

from __future__ import annotations

import io

from rich.console import Console, RenderableType

from mooncake.api.status import KVBlockShares, NodeStatus, Status, TierStatus
from mooncake.cli.statusview import (
    human_bytes,
    human_duration,
    human_rate,
    render_status,
    slo_style,
    slo_verdict,
)

H800 = ["NVIDIA H800 80GiB"] * 8


def make_status(**changes: object) -> Status:
    nodes = [
        NodeStatus(node_id="master-0", role="master", address="10.0.0.1:7100", state="ready"),
        NodeStatus(
            node_id="prefill-0",
            role="prefill",
            address="10.0.0.11:7001",
            state="ready",
            gpus=H800,
            nics=["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
            num_queued=3,
            num_running=1,
            load=0.62,
            last_seen_s=0.4,
            pipeline_group="pp0",
            pool_bytes={"dram": 256 << 20},
        ),
        NodeStatus(
            node_id="prefill-1",
            role="prefill",
            address="10.0.0.12:7001",
            state="draining",
            gpus=H800,
            nics=["mlx5_0", "mlx5_1"],
            num_running=1,
            load=0.95,
            last_seen_s=1.2,
            pipeline_group="pp0",
        ),
        NodeStatus(
            node_id="decode-0",
            role="decode",
            address="10.0.0.21:7001",
            state="ready",
            gpus=H800,
            nics=["mlx5_0"],
            num_queued=2,
            num_running=48,
            load=0.75,
        ),
        NodeStatus(
            node_id="store-0",
            role="store",
            address="10.0.0.31:7001",
            state="down",
            last_seen_s=75.0,
            pool_bytes={"dram": 1 << 30, "ssd": 1 << 39},
        ),
    ]
    pool = [
        TierStatus(
            tier="dram",
            used_bytes=300 << 30,
            capacity_bytes=512 << 30,
            num_objects=123456,
            num_hits=60000,
        ),
        TierStatus(tier="vram", used_bytes=10 << 30, capacity_bytes=80 << 30, num_objects=2000),
        TierStatus(
            tier="ssd",
            used_bytes=1900 << 30,
            capacity_bytes=2 << 40,
            num_objects=999999,
            num_hits=20000,
        ),
    ]
    fields: dict[str, object] = dict(
        cluster="prod-a",
        model="llama2-70b",
        uptime_s=7384.0,
        nodes=nodes,
        pool=pool,
        hit_rate=0.62,
        local_hit_rate=0.41,
        num_queued=5,
        num_running=50,
        num_requests=12000,
        num_completed=11800,
        rejected=150,
        num_failed=3,
        ttft_p50_s=1.2,
        ttft_p90_s=35.0,
        tbt_p50_s=0.05,
        tbt_p90_s=0.09,
        ttft_slo_s=30.0,
        tbt_slo_s=0.1,
        transfer_bytes_per_s=3.2e9,
        pool_hits=80000,
        pool_lookups=129000,
        num_prompt_tokens=2110,
        num_cached_tokens=2080,
        cached_token_share=2080 / 2110,
    )
    fields.update(changes)
    return Status(**fields)  # type: ignore[arg-type]


def to_text(renderable: RenderableType, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(renderable)
    return out.getvalue()


def _node_rows(text: str) -> list[str]:
    """The lines of the nodes table (the last part; "KV pool by node" names nodes too)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("nodes ("))
    return lines[start:]


def flat(text: str) -> str:
    """Text with every run of whitespace (incl. wrapped lines) as one space."""
    return " ".join(text.split())


def test_view_at_80_columns_fits_and_keeps_every_cell_whole() -> None:
    text = to_text(render_status(make_status(), "http://10.0.0.1:8000", 80), 80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "mooncake prod-a  model llama2-70b  up 2h03m" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isalpha()}
    rows |= {line.split()[0]: line.split() for line in _node_rows(text)}
    assert rows["prefill-0"] == [
        "prefill-0",
        "prefill",
        "10.0.0.11:7001",
        "ready",
        "8/4",
        "3/1",
        "██░░",
        "62%",
        "0.4s",
        "pp0",
    ]
    assert rows["prefill-1"][3] == "draining" and rows["prefill-1"][4] == "8/2"
    assert rows["decode-0"][4:6] == ["8/1", "2/48"]
    assert rows["store-0"][3:6] == ["down", "-", "0/0"] and "1m15s" in rows["store-0"]
    # pool tiers in vram, dram, ssd order, whole cells
    assert rows["vram"][1:6] == ["10.0", "GiB", "/", "80.0", "GiB"]
    assert rows["vram"][-3:] == ["2,000", "0", "(0%)"]  # objects, hits and their share
    assert rows["dram"][-3:] == ["123,456", "60,000", "(75%)"] and "59%" in rows["dram"]
    assert rows["ssd"][1:6] == ["1.9", "TiB", "/", "2.0", "TiB"] and "93%" in rows["ssd"]
    assert rows["ssd"][-2:] == ["20,000", "(25%)"]  # hits served from SSD, their share
    assert [ln.split()[0] for ln in lines if ln.split()[:1] in (["vram"], ["dram"], ["ssd"])] == [
        "vram",
        "dram",
        "ssd",
    ]
    body = flat(text)
    assert "pool hits 62.0% of blocks in the pool at placement (80,000 of 129,000)" in body
    assert "local hits 41.0% of blocks on the chosen node" in body
    assert "cached tokens 98.6% of prompt tokens served from cache (2,080 of 2,110)" in body
    # what each node gives the pool, every serving node listed ("-" for none)
    assert "KV pool by node node dram ssd" in body
    assert "decode-0 - - prefill-0 256.0 MiB -" in body
    assert "store-0 1.0 GiB 512.0 GiB" in body
    assert "queues 5 queued 50 running" in body
    assert "TTFT P50 1.20 s P90 35.00 s SLO 30.00 s" in body
    assert "TBT P50 50 ms P90 90 ms SLO 100 ms" in body
    assert "12,000 received 11,800 completed 150 rejected 3 failed" in body
    assert "transfer 3.20 GB/s" in body


def test_view_at_120_columns_names_gpus_and_nics() -> None:
    text = to_text(render_status(make_status(), "http://10.0.0.1:8000", 120), 120)
    assert max(len(line) for line in text.splitlines()) <= 120
    row = next(line for line in _node_rows(text) if line.startswith("prefill-1"))
    assert row.split()[:9] == [
        "prefill-1",
        "prefill",
        "10.0.0.12:7001",
        "draining",
        "8×",
        "H800",
        "80GiB",
        "mlx5_0,mlx5_1",
        "0/1",
    ]
    prefill_0 = next(line for line in _node_rows(text) if line.startswith("prefill-0"))
    assert "4 NICs" in prefill_0  # four names do not fit their column: a count instead
    assert "P90 35.00 s SLO 30.00 s" in flat(text)


def test_view_before_any_request_shows_dashes_and_an_empty_pool() -> None:
    status = make_status(
        pool=[],
        ttft_p50_s=None,
        ttft_p90_s=None,
        tbt_p50_s=None,
        tbt_p90_s=None,
        pool_lookups=0,
        num_prompt_tokens=0,
        num_cached_tokens=0,
        cached_token_share=0.0,
    )
    body = flat(to_text(render_status(status, "http://m:8000", 80), 80))
    assert "TTFT P50 - P90 - SLO 30.00 s" in body
    assert "no pool memory registered" in body
    # no counts before any lookup or prompt
    assert "cached tokens 0.0% of prompt tokens served from cache pool hits" in body
    assert "placement local hits 41.0% of blocks on the chosen node queues" in body


def test_slo_verdict_is_within_at_or_below_the_slo_and_over_above_it() -> None:
    assert slo_verdict(0.09, 0.1) == "within"
    assert slo_verdict(0.1, 0.1) == "within"
    assert slo_verdict(0.1001, 0.1) == "over"
    assert slo_verdict(None, 0.1) == "unknown"
    assert (slo_style(1.0, 30.0), slo_style(35.0, 30.0), slo_style(None, 30.0)) == (
        "green",
        "bold red",
        "dim",
    )


def test_human_units() -> None:
    assert [human_bytes(n) for n in (512, 1536, 3 << 30, 5 << 40)] == [
        "512 B",
        "1.5 KiB",
        "3.0 GiB",
        "5.0 TiB",
    ]
    assert [human_rate(r) for r in (999, 1.25e6, 3.2e9)] == ["999 B/s", "1.25 MB/s", "3.20 GB/s"]
    assert [human_duration(s) for s in (0.42, 42, 75, 7384, 200000)] == [
        "0.4s",
        "42s",
        "1m15s",
        "2h03m",
        "2d07h",
    ]


def test_addresses_show_as_host_port_and_kv_moved_per_transport_fits_80() -> None:
    """Every address is host:port (a scheme is dropped, a node with none shows "-"), and
    each node that moved KV gets a line with its bytes per transport."""
    nodes = [
        NodeStatus(node_id="master-0", role="master", address="10.0.0.1:7100", state="ready"),
        NodeStatus(
            node_id="prefill-0",
            role="prefill",
            address="tcp://10.0.0.11:41234",
            state="ready",
            transfer_bytes={"shm": 9 << 20, "tcp": 4700, "local": 0},
        ),
        NodeStatus(
            node_id="decode-0",
            role="decode",
            address="tcp://10.0.0.21:41000",
            state="ready",
            transfer_bytes={"rdma": 3 << 30},
        ),
        NodeStatus(node_id="store-0", role="store", address="10.0.0.31:40100", state="ready"),
        NodeStatus(node_id="store-1", role="store", address="", state="ready"),
    ]
    status = make_status(nodes=nodes)
    for width in (80, 120):
        text = to_text(render_status(status, "http://10.0.0.1:8000", width), width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert "tcp://" not in text
        rows = {line.split()[0]: line.split() for line in _node_rows(text) if line[:1].isalpha()}
        assert rows["prefill-0"][2] == "10.0.0.11:41234"
        assert rows["decode-0"][2] == "10.0.0.21:41000"
        assert rows["store-0"][2] == "10.0.0.31:40100"
        assert rows["store-1"][2] == "-"
        body = flat(text)
        # columns in shm, rdma, tcp order; only transports some node used; "-" for none
        assert "KV moved by node node shm rdma tcp" in body
        assert "decode-0 - 3.0 GiB - prefill-0 9.0 MiB - 4.6 KiB" in body
    # no line before any node moved bytes
    assert "KV moved" not in to_text(render_status(make_status(), "http://m:8000", 80), 80)


def test_view_shows_where_ttft_went_against_the_conductors_prediction() -> None:
    from mooncake.api.status import TtftPhases

    phases = TtftPhases(
        num_requests=40,
        queue_p50_s=2.5,
        queue_p90_s=9.0,
        prefill_p50_s=1.25,
        prefill_p90_s=3.0,
        first_step_p50_s=0.04,
        first_step_p90_s=0.1,
        predicted_over_actual_p50=0.62,
    )
    body = flat(to_text(render_status(make_status(ttft_phases=phases), "http://m:8000", 80), 80))
    assert (
        "TTFT P50 in queue 2.50 s prefill 1.25 s first step 40 ms Conductor's prediction x0.62"
        in body
    )
    empty = flat(to_text(render_status(make_status(), "http://m:8000", 80), 80))
    assert "TTFT P50 in" not in empty  # no phases before any request (or from `serve`)


def test_the_blocks_line_shows_each_cause_as_a_share() -> None:
    """The prefills' blocks by cause (the master's miss attribution), shares of the
    blocks they could have reused; no line before any prefill was attributed."""
    counts = {"hit": 600, "cold": 250, "evicted": 100, "elsewhere": 40, "unverified": 10}
    kv = KVBlockShares(
        requests=20, blocks=1000, counts=counts, shares={k: v / 1000 for k, v in counts.items()}
    )
    body = flat(to_text(render_status(make_status(kv_blocks=kv), "http://m:8000", 120), 120))
    assert (
        "blocks hit 60.0% cold 25.0% evicted 10.0% elsewhere 4.0% unverified 1.0% "
        "(1,000 blocks of 20 prefills)"
    ) in body
    assert "blocks hit" not in flat(
        to_text(render_status(make_status(), "http://m:8000", 120), 120)
    )

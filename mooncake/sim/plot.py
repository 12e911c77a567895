"""PNG figures of a simulation: TTFT and TBT CDFs, and hit rate against pool size.

matplotlib is an optional extra (`pip install matplotlib`), imported only when plotting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mooncake.errors import MooncakeError
from mooncake.sim.lru import global_lru_hit_rate
from mooncake.sim.metrics import SimReport
from mooncake.sim.trace import TraceRecord

DEFAULT_POOL_SIZES = (1_000, 10_000, 30_000, 50_000, 100_000, None)  # blocks; None = unbounded


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MooncakeError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from e
    return plt


def _cdf(
    plt: Any, values: Sequence[float], slo: float, xlabel: str, title: str, path: Path
) -> None:
    xs = sorted(values)
    n = len(xs)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [(i + 1) / n for i in range(n)], drawstyle="steps-post")
    ax.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g} s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of completed requests")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hit_rate_curve(
    records: Sequence[TraceRecord], sizes: Sequence[int | None] = DEFAULT_POOL_SIZES
) -> list[tuple[int | None, float]]:
    """(pool blocks, global LRU hit rate) for each size."""
    return [(size, global_lru_hit_rate(records, size)) for size in sizes]


def write_plots(
    out_dir: str | Path,
    report: SimReport | None,
    curve: list[tuple[int | None, float]],
    *,
    ttft_slo_s: float,
    tbt_slo_s: float,
    label: str = "",
) -> list[Path]:
    """Write ttft_cdf.png and tbt_cdf.png (when `report` is given) and hit_rate.png."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if report is not None and report.ttft_s:
        path = out / "ttft_cdf.png"
        _cdf(plt, report.ttft_s, ttft_slo_s, "TTFT (s)", f"TTFT CDF\n{label}", path)
        written.append(path)
        path = out / "tbt_cdf.png"
        _cdf(
            plt,
            report.tbt_s,
            tbt_slo_s,
            "TBT (s, mean of slowest 10% gaps)",
            f"TBT CDF\n{label}",
            path,
        )
        written.append(path)
    bounded = [(s, h) for s, h in curve if s is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s for s, _ in bounded], [h for _, h in bounded], marker="o", label="global LRU")
    for size, hit in curve:
        if size is None:
            ax.axhline(hit, color="gray", linestyle="--", label=f"unbounded {hit:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity (blocks)")
    ax.set_ylabel("hit rate (prefix blocks)")
    ax.set_title("Hit rate of one global LRU pool")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "hit_rate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written

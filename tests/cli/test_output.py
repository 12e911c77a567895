"""The shared rich consoles: off a terminal (a pipe, a file, a CI log) lines and tables are
as wide as they need, so figures are never cut and commands stay pasteable."""

from __future__ import annotations

import io

import pytest
from rich.table import Table

from mooncake.cli.output import OFF_TERMINAL_WIDTH, _Console

HEADERS = (
    "GB/s",
    "requests/s",
    "p50 us",
    "p99 us",
    "memcpy GB/s",
    "ratio",
    "retries",
    "RSS start/end/peak MiB",
    "target peak MiB",
)
FIGURES = ("12.34", "123,456", "12", "34", "15.00", "0.82", "0", "100/120/130", "90")


def _table() -> Table:
    table = Table(title="transfer read over shm: 65536 B blocks x 32 per batch, 1 threads")
    for header in HEADERS:
        table.add_column(header, justify="right")
    table.add_row(*FIGURES)
    return table


def test_off_a_terminal_a_table_keeps_every_header_and_figure_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = _Console(file=io.StringIO())
    assert not out.is_terminal and out.width == OFF_TERMINAL_WIDTH
    out.print(_table())
    text = out.file.getvalue()  # type: ignore[attr-defined]
    header_line = next(line for line in text.splitlines() if "GB/s" in line)
    assert all(h in header_line for h in HEADERS), header_line
    figure_line = next(line for line in text.splitlines() if "123,456" in line)
    assert all(f in figure_line for f in FIGURES), figure_line
    assert "…" not in text


def test_a_width_asked_for_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """COLUMNS, or a width given to the console, still rules (tests and users who set it)."""
    monkeypatch.setenv("COLUMNS", "50")
    assert _Console(file=io.StringIO()).width == 50
    monkeypatch.delenv("COLUMNS")
    assert _Console(file=io.StringIO(), width=40).width == 40

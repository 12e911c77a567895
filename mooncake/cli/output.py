"""Shared rich consoles and JSON printing for the verbs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.console import Console, ConsoleDimensions

OFF_TERMINAL_WIDTH = 1000  # columns: as wide as a table or a command line needs


class _Console(Console):
    """A rich console that, writing to a pipe or a file with no COLUMNS set, lays out lines
    as long as they need: rich would wrap at 80 columns and cut table cells to fit."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or self._width is not None or "COLUMNS" in os.environ:
            return size
        return ConsoleDimensions(OFF_TERMINAL_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


console: Console = _Console()
err_console: Console = _Console(stderr=True)


def print_json(data: Any) -> None:
    """Print `data` as indented JSON on stdout (msgspec encodes structs, enums, numpy ints)."""
    text = msgspec.json.format(msgspec.json.encode(data), indent=2).decode()
    print(text)


def sysfs_root_option(live: str) -> Any:
    """The `--sysfs-root PATH` option of verbs that read sysfs; `live`: what they still
    read from this machine."""
    return typer.Option(
        Path("/sys"),
        "--sysfs-root",
        metavar="PATH",
        help=f"Read sysfs from PATH instead of /sys, for debugging a recorded tree; {live} "
        "still come from this machine.",
    )

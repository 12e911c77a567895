"""Shared rich consoles and JSON printing for the verbs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


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

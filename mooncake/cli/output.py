"""Shared rich consoles and JSON printing for the verbs."""

from __future__ import annotations

from typing import Any

import msgspec
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Print `data` as indented JSON on stdout (msgspec encodes structs, enums, numpy ints)."""
    text = msgspec.json.format(msgspec.json.encode(data), indent=2).decode()
    print(text)

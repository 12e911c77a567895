"""Command lines in gflags' syntax (the flags library of upstream Mooncake's C++ binaries).

    values = parse_gflags(["--port", "50051", "--enable_ha", "--eviction_ratio=0.1"], FLAGS)

gflags accepts `--flag=value`, `--flag value`, a single dash (`-flag`), and for booleans
`--flag` (true), `--noflag` (false) and `--flag=true|false|1|0|yes|no|t|f|y|n`; a boolean
never takes the next word as its value. An unknown flag is an error, as in gflags.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mooncake.errors import ConfigError

Kind = Literal["bool", "int", "float", "str", "duration_ms"]
_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_MS_PER_UNIT = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_EXPECTED = {"int": "expected an integer", "float": "expected a number", "str": ""}


@dataclass(frozen=True)
class FlagSpec:
    kind: Kind
    help: str


def parse_duration_ms(text: str) -> int:
    """Milliseconds from upstream's duration syntax: raw milliseconds ("500") or a number
    with ms, s, m or h ("2s", "1.5m"); ValueError otherwise."""
    m = _DURATION_RE.match(text)
    if m is None:
        raise ValueError("expected milliseconds or a duration such as 500ms, 2s, 1m, 1h")
    return round(float(m.group(1)) * _MS_PER_UNIT[m.group(2) or "ms"])


def _convert(kind: Kind, text: str) -> object:
    if kind == "bool":
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("expected true or false")
    if kind == "int":
        return int(text.strip())
    if kind == "float":
        return float(text.strip())
    if kind == "duration_ms":
        return parse_duration_ms(text)
    return text


def parse_gflags(argv: Sequence[str], specs: Mapping[str, FlagSpec]) -> dict[str, object]:
    """Flag name -> converted value for each flag given (the last one wins, as in gflags).
    Raises ConfigError listing every malformed, unknown or valueless flag."""
    values: dict[str, object] = {}
    errors: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            if i < len(words):
                errors.append(f"{' '.join(words[i:])}: positional arguments are not accepted")
            break
        if not word.startswith("-") or word == "-":
            errors.append(f"{word}: positional arguments are not accepted")
            continue
        name, has_value, text = word.lstrip("-").partition("=")
        spec = specs.get(name)
        if spec is None and not has_value and name.startswith("no"):
            neg = specs.get(name[2:])
            if neg is not None and neg.kind == "bool":
                values[name[2:]] = False
                continue
        if spec is None:
            close = difflib.get_close_matches(name, list(specs), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            errors.append(f"unknown command line flag '{name}'{hint}")
            continue
        if not has_value:
            if spec.kind == "bool":
                values[name] = True
                continue
            if i >= len(words):
                errors.append(f"flag '{name}' is missing its argument")
                continue
            text = words[i]
            i += 1
        try:
            values[name] = _convert(spec.kind, text)
        except ValueError as e:
            why = str(e) if spec.kind in ("bool", "duration_ms") else _EXPECTED[spec.kind]
            errors.append(f"illegal value '{text}' for flag '{name}': {why}")
    if errors:
        raise ConfigError(errors)
    return values

"""Byte sizes in settings and flags: "512MB", "64KiB", 4096, and memory budgets that are
either bytes, a share of what the node finds free ("80%"), or (where a key allows it)
"auto": the node decides (the KV caches: `roles/node/kvsize.py`)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

import msgspec

from mooncake.errors import ConfigError

# unit (lower-case) -> bytes; bare K/M/G/T are binary, as `ls -h` and most tools read them
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[f"{_p}b"] = 1000**_i
    _UNITS[f"{_p}ib"] = _UNITS[_p] = 1024**_i
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")
SIZE_HELP = 'bytes as an integer or with a unit: "4096", "512MB", "64KiB", "1.5TiB"'
PERCENT_HELP = 'a percentage of free memory in 0%..100% ("80%")'


def parse_size(text: str | int) -> int:
    """Bytes in `text`: an integer or a number with a unit (B, KB/MB/GB/TB = powers of 1000,
    KiB/MiB/GiB/TiB and bare K/M/G/T = powers of 1024; case-insensitive; decimals allowed and
    rounded down to whole bytes). Raises ConfigError on anything else, including negatives."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"expected a size >= 0, got {text}")
        return text
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}")
    try:
        return int(Decimal(m.group(1)) * _UNITS[unit])
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}") from e


def format_size(num_bytes: int) -> str:
    """Shortest exact spelling of `num_bytes`: "64KiB", "512MB", "1000" (parse_size inverts it)."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB", "PB", "TB", "GB", "MB", "KB"):
        scale = _UNITS[unit.lower()]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


class Size(msgspec.Struct, frozen=True):
    """A memory budget: absolute bytes, a share of the free bytes the node finds, or
    "auto" (the node decides: only where a key's knob allows it)."""

    num_bytes: int = 0  # bytes; used when fraction is None and not is_auto
    fraction: float | None = None  # share of free bytes in [0, 1] ("80%" -> 0.8), or None
    is_auto: bool = False  # "auto": sized by the node that uses it (see the key's help)

    @classmethod
    def parse(cls, text: str | int, allow_auto: bool = False) -> Size:
        """A Size from `text` ("80%", "64GiB", 4096, and "auto" when `allow_auto`); raises
        ConfigError naming every allowed form when malformed."""
        if isinstance(text, str) and text.strip().lower() == "auto":
            if not allow_auto:
                raise ConfigError(f'"auto" is not allowed here: expected {_allowed(False)}')
            return cls(is_auto=True)
        if isinstance(text, str) and "%" in text:
            m = _PERCENT_RE.match(text)
            if m is None or Decimal(m.group(1)) > 100:
                raise ConfigError(f"expected {_allowed(allow_auto)}, got {text!r}")
            return cls(fraction=float(Decimal(m.group(1)) / 100))
        try:
            return cls(num_bytes=parse_size(text))
        except ConfigError as e:
            raise ConfigError(f"expected {_allowed(allow_auto)}, got {text!r}") from e

    @property
    def is_zero(self) -> bool:
        """True when this tier is disabled (0 bytes or 0%)."""
        return not self.is_auto and not self.fraction and self.num_bytes == 0

    def resolve(self, free_bytes: int) -> int:
        """Bytes to use on a node that finds `free_bytes` free (pure, no I/O). An "auto"
        size has no meaning of its own: its user resolves it (`roles/node/kvsize.py`)."""
        assert not self.is_auto, "an auto size is resolved by the node that uses it"
        if self.fraction is None:
            return self.num_bytes
        return int(free_bytes * self.fraction)

    def __str__(self) -> str:
        if self.is_auto:
            return "auto"
        if self.fraction is None:
            return format_size(self.num_bytes)
        return f"{self.fraction * 100:g}%"


def _allowed(allow_auto: bool) -> str:
    forms = f"a size ({SIZE_HELP}) or {PERCENT_HELP}"
    return f'"auto", {forms}' if allow_auto else forms

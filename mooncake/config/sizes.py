"""Byte sizes in settings and flags: "512MB", "64KiB", 4096, and memory budgets that are
either bytes or a share of what the topology reports free ("80%")."""

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
    """A memory budget: absolute bytes, or a share of the free bytes the topology reports."""

    num_bytes: int = 0  # bytes; used when fraction is None
    fraction: float | None = None  # share of free bytes in [0, 1] ("80%" -> 0.8), or None

    @classmethod
    def parse(cls, text: str | int) -> Size:
        """A Size from `text` ("80%", "64GiB", 4096); raises ConfigError when malformed."""
        if isinstance(text, str) and "%" in text:
            m = _PERCENT_RE.match(text)
            if m is None or Decimal(m.group(1)) > 100:
                raise ConfigError(
                    f'expected a percentage of free memory in 0%..100% like "80%", got {text!r}'
                )
            return cls(fraction=float(Decimal(m.group(1)) / 100))
        return cls(num_bytes=parse_size(text))

    @property
    def is_zero(self) -> bool:
        """True when this tier is disabled (0 bytes or 0%)."""
        return not self.fraction and self.num_bytes == 0

    def resolve(self, free_bytes: int) -> int:
        """Bytes to use on a node whose topology reports `free_bytes` free (pure, no I/O)."""
        if self.fraction is None:
            return self.num_bytes
        return int(free_bytes * self.fraction)

    def __str__(self) -> str:
        if self.fraction is None:
            return format_size(self.num_bytes)
        return f"{self.fraction * 100:g}%"

"""What every settings struct is made of: `knob` (a field's documented metadata) and the
struct options (frozen, unknown keys refused, keyword-only)."""

from __future__ import annotations

from typing import Any

from msgspec import Meta


def knob(doc: str, kind: str = "", **constraints: Any) -> Meta:
    """Field metadata: `doc` (meaning, unit) plus msgspec constraints (ge, le, gt, pattern...).
    `kind` marks types TOML cannot say: "size" (Size), "bytes" (int from a size string),
    "hostport", "secret" (never printed)."""
    return Meta(description=doc, extra={"kind": kind} if kind else None, **constraints)


STRUCT: dict[str, Any] = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}

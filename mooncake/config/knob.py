"""`knob()`: the field metadata of every settings struct (`mooncake.config.settings`,
`mooncake.config.roles`): a key's meaning, unit, kind and constraints, in one place."""

from __future__ import annotations

from typing import Any

from msgspec import Meta


def knob(doc: str, kind: str = "", *, allows_auto: bool = False, **constraints: Any) -> Meta:
    """Field metadata: `doc` (meaning, unit) plus msgspec constraints (ge, le, gt, pattern...).
    `kind` marks types TOML cannot say: "size" (Size), "bytes" (int from a size string),
    "hostport", "secret" (never printed), "count" (an int >= 1 or "auto"). `allows_auto`: a
    "size" key that takes "auto"."""
    extra: dict[str, Any] = {"kind": kind} if kind else {}
    if allows_auto:
        assert kind == "size", f"only a size takes auto, not {kind!r}"
        extra["allows_auto"] = True
    return Meta(description=doc, extra=extra or None, **constraints)


STRUCT = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}

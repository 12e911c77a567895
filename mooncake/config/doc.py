"""The per-key table of the config, read from the `Annotated` fields of `mooncake.config.settings`.

One `FieldSpec` per key says its type, default, meaning and allowed values; the loader
validates against it, and the example file and `mooncake config show` are rendered from it,
so documentation and validation cannot drift apart.
"""

from __future__ import annotations

import json
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from mooncake.config.settings import Config
from mooncake.config.sizes import Size, format_size


@dataclass(frozen=True)
class FieldSpec:
    """One config key and everything the loader and the docs need to know about it."""

    section: str  # "store"
    key: str  # "replicas"
    kind: str  # str | int | float | bool | enum | list | size | bytes
    tag: str  # "" | hostport | secret | modelpath | portrange | count: checks beyond the kind
    default: Any  # the value in Config()
    doc: str  # meaning and unit, one sentence or two
    choices: tuple[str, ...] = ()  # allowed values of an enum
    ge: float | None = None  # inclusive lower bound
    gt: float | None = None  # exclusive lower bound
    le: float | None = None  # inclusive upper bound
    pattern: str | None = None  # regex a str must match
    min_length: int | None = None  # shortest allowed str
    allows_auto: bool = False  # a size that also takes "auto"

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env_var(self) -> str:
        return f"MOONCAKE_{self.section.upper()}_{self.key.upper()}"

    def expected(self) -> str:
        """What a value must look like: "an integer >= 1", "one of auto, tcp"."""
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bytes":
            low = f" >= {format_size(int(self.ge))}" if self.ge else ""
            return f'a size in bytes{low} ("64KiB", 65536; no %)'
        base = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "list": 'a list of strings (env: comma-separated "a,b")',
            "size": ('"auto", ' if self.allows_auto else "")
            + 'a size in bytes (4096, "512MB", "64GiB", "1.5TiB") or a percentage ("80%")',
            "str": "a string",
        }[self.kind]
        if self.tag == "hostport":
            return "host:port with a port in 1..65535"
        if self.tag == "count":
            return '"auto" or an integer >= 1'
        if self.tag == "portrange":
            return '"LOW-HIGH" with 1 <= LOW <= HIGH <= 65535, or "" for any free port'
        if self.tag == "modelpath":
            return 'a model directory, a .gguf file, a built-in name or "dummy:NAME"'
        if self.pattern == "^[a-z0-9-]+$":
            return 'a non-empty name of lower-case letters, digits and "-"'
        if self.min_length:
            return "a non-empty string"
        return base + _range(self.ge, self.gt, self.le)


def _num(x: float) -> str:
    return f"{x:g}"


def _range(ge: float | None, gt: float | None, le: float | None) -> str:
    if ge is not None and le is not None:
        return f" in {_num(ge)}..{_num(le)}"
    if gt is not None and le is not None:
        return f" in ({_num(gt)}, {_num(le)}]"
    if ge is not None:
        return f" >= {_num(ge)}"
    if gt is not None:
        return f" > {_num(gt)}"
    return ""


def _kind(tp: Any) -> tuple[str, tuple[str, ...]]:
    if typing.get_origin(tp) is typing.Literal:
        return "enum", tuple(typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "list", ()
    return {str: "str", int: "int", float: "float", bool: "bool", Size: "size"}[tp], ()


def _section_specs(name: str, struct: type[msgspec.Struct]) -> dict[str, FieldSpec]:
    hints = typing.get_type_hints(struct, vars(sys.modules[struct.__module__]), include_extras=True)
    defaults = struct()
    specs = {}
    for field in msgspec.structs.fields(struct):
        tp, *metas = typing.get_args(hints[field.name])
        (meta,) = (m for m in metas if isinstance(m, msgspec.Meta))
        kind, choices = _kind(tp)
        extra = meta.extra or {}
        tag = extra.get("kind", "")
        if tag in ("size", "bytes"):
            kind, tag = tag, ""
        specs[field.name] = FieldSpec(
            section=name,
            key=field.name,
            kind=kind,
            tag=tag,
            default=getattr(defaults, field.name),
            doc=meta.description or "",
            choices=choices,
            ge=meta.ge,
            gt=meta.gt,
            le=meta.le,
            pattern=meta.pattern,
            min_length=meta.min_length,
            allows_auto=bool(extra.get("allows_auto")),
        )
    return specs


SECTIONS: dict[str, type[msgspec.Struct]] = {
    f.name: f.default.__class__ for f in msgspec.structs.fields(Config)
}
SECTION_DOCS = {s: (t.__doc__ or "").split(": ", 1)[-1].strip() for s, t in SECTIONS.items()}
SECTION_DOCS = {s: d[:1].upper() + d[1:] for s, d in SECTION_DOCS.items()}
FIELDS: dict[str, dict[str, FieldSpec]] = {s: _section_specs(s, t) for s, t in SECTIONS.items()}
ALL_FIELDS: dict[str, FieldSpec] = {f.dotted: f for fs in FIELDS.values() for f in fs.values()}


def toml_value(spec: FieldSpec, value: Any) -> str:
    """`value` spelled as a TOML literal ("64KiB" for slice_bytes, "50%" for a Size)."""
    if spec.kind == "bool":
        return "true" if value else "false"
    if spec.kind in ("int", "float"):
        return repr(value)
    if spec.kind == "list":
        return json.dumps(list(value))
    if spec.kind == "bytes":
        return json.dumps(format_size(value))
    return json.dumps(str(value))


def show_value(spec: FieldSpec, value: Any) -> str:
    """`value` for a human: sizes with their bytes, secrets hidden."""
    if spec.tag == "secret":
        if not value:
            return "(not set)"
        return f"{len(value)} keys (hidden)" if spec.kind == "list" else "(set, hidden)"
    if spec.kind == "size" and value.is_auto:
        return "auto"
    if spec.kind == "size" and value.fraction is not None:
        return f"{value} of free"
    if spec.kind in ("size", "bytes"):
        num_bytes = value.num_bytes if spec.kind == "size" else value
        text = toml_value(spec, value).strip('"')
        return text if text == str(num_bytes) else f"{text} ({num_bytes:,} bytes)"
    return toml_value(spec, value)


def json_value(spec: FieldSpec, value: Any) -> dict[str, Any]:
    """{"value": ...} for `config show --json`, plus "bytes" for absolute sizes."""
    if spec.tag == "secret":
        hidden = ["<hidden>"] * len(value) if spec.kind == "list" else ("<hidden>" if value else "")
        return {"value": hidden}
    if spec.kind == "size":
        out: dict[str, Any] = {"value": str(value)}
        if value.fraction is None and not value.is_auto:
            out["bytes"] = value.num_bytes
        return out
    if spec.kind == "bytes":
        return {"value": format_size(value), "bytes": value}
    return {"value": list(value) if spec.kind == "list" else value}


def render_example() -> str:
    """The text of mooncake.toml.example: every key, its documentation and its default."""
    lines = [
        "# mooncake.toml.example: every setting, each set to its default.",
        "# Generated by `mooncake config example`; check a file with `mooncake config check FILE`.",
        "# Precedence: defaults < this file < MOONCAKE_<SECTION>_<KEY> environment variables",
        "# (MOONCAKE_STORE_REPLICAS=2, lists comma-separated) < flags (--set KEY=VALUE).",
    ]
    wrap = textwrap.TextWrapper(width=96, initial_indent="# ", subsequent_indent="# ")
    for section, specs in FIELDS.items():
        lines += ["", "", *wrap.wrap(SECTION_DOCS[section]), f"[{section}]"]
        for spec in specs.values():
            allowed = spec.expected()
            lines += ["", *wrap.wrap(spec.doc)]
            if allowed != "a string":
                lines += wrap.wrap(f"Allowed: {allowed}.")
            lines.append(f"{spec.key} = {toml_value(spec, spec.default)}")
    return "\n".join(lines) + "\n"

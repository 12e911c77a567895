"""Layer defaults, a TOML file, MOONCAKE_* variables and flags into one validated Config.

Every layer is checked key by key against `configdoc.FIELDS`; problems are collected, not
raised one at a time, so `ConfigError.errors` lists everything wrong with a setup at once.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from mooncake.config.doc import ALL_FIELDS, FIELDS, SECTIONS, FieldSpec
from mooncake.config.portrange import PortRange
from mooncake.config.settings import MIN_SECRET_LEN, Config
from mooncake.config.sizes import Size, parse_size
from mooncake.errors import ConfigError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_INT_RE = re.compile(r"^[+-]?\d+$")


class _Bad(Exception):
    """A value does not fit its key; the message completes "KEY: ..."."""


def _got(spec: FieldSpec, value: Any) -> str:
    if spec.tag == "secret":
        return "<hidden>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | list | tuple | dict):
        return json.dumps(value if not isinstance(value, tuple) else list(value))
    return str(value)


def _coerce(spec: FieldSpec, value: Any, is_text: bool) -> Any:
    """`value` converted to the key's type; `is_text` lets strings stand for numbers, bools
    and lists (environment and --set). Raises _Bad."""
    kind, text = spec.kind, value if isinstance(value, str) else None
    if kind in ("size", "bytes"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise _Bad("")
        if kind == "bytes" and text is not None and "%" in text:
            raise _Bad("a percentage is not allowed here")
        if text is not None and text.strip().lower() == "auto" and not spec.allows_auto:
            raise _Bad('"auto" is not allowed here')
        try:
            if kind == "size":
                return Size.parse(value, allow_auto=spec.allows_auto)
            return parse_size(value)
        except ConfigError as e:
            over = text is not None and re.match(r"^\s*[\d.]+\s*%\s*$", text)
            raise _Bad("a percentage is at most 100%" if over else "") from e
    if kind in ("str", "enum"):
        if spec.tag == "count" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # NOTE: `instances = 4` in TOML; "auto" is the other value
        if text is None:
            raise _Bad("")
        if kind == "enum" and text not in spec.choices:
            close = difflib.get_close_matches(text, spec.choices, n=1)
            raise _Bad(f"did you mean {close[0]}?" if close else "")
        return text
    if text is not None and not is_text:  # TOML has typed values; a string is a mistake
        if kind == "list":
            raise _Bad('write a TOML list, e.g. ["a", "b"]')
        try:
            _coerce(spec, value, is_text=True)
        except _Bad:
            raise _Bad("") from None
        raise _Bad("a quoted string; write it without quotes")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if text is not None and text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise _Bad("")
    if kind == "list":
        if text is not None:
            return tuple(item.strip() for item in text.split(",") if item.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise _Bad("")
    if isinstance(value, bool):
        raise _Bad("")
    if kind == "int":
        if text is not None and _INT_RE.match(text.strip()):
            return int(text)
        if isinstance(value, int):
            return value
        raise _Bad("")
    assert kind == "float", spec
    try:
        number = float(value) if isinstance(value, int | float | str) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise _Bad("")
    return number


def _check(spec: FieldSpec, value: Any) -> None:
    """Raise _Bad if a well-typed `value` is outside the key's allowed values."""
    if spec.kind in ("int", "float", "bytes") and (
        (spec.ge is not None and value < spec.ge)
        or (spec.gt is not None and value <= spec.gt)
        or (spec.le is not None and value > spec.le)
    ):
        raise _Bad("")
    if spec.kind == "str" and (
        (spec.pattern and not re.match(spec.pattern, value))
        or (spec.min_length and len(value) < spec.min_length)
    ):
        raise _Bad("")
    if spec.kind == "list" and not all(item.strip() for item in value):
        raise _Bad("an empty entry")
    if spec.tag == "hostport":
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _Bad("")
    if spec.tag == "modelpath" and (not value or value == "dummy:"):
        raise _Bad("")
    if spec.tag == "portrange":
        try:
            PortRange.parse(value)
        except ConfigError:
            raise _Bad("") from None


def _suggest(word: str, options: Any, fmt: str = "{}") -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {fmt.format(close[0])}?" if close else ""


# Keys an earlier release accepted -> what replaced them (said instead of a guess).
RETIRED_KEYS = {
    "transfer.max_handshakes_per_peer": "replaced by transfer.max_pending_handshakes, one "
    "budget of unauthenticated handshakes for all source addresses",
}


def _unknown_key(section: str, key: str, env_var: str = "") -> str:
    known = ", ".join(FIELDS[section])
    what = (
        f"{env_var}: unknown variable, no key {key!r}"
        if env_var
        else f"{section}.{key}: unknown key"
    )
    if (retired := RETIRED_KEYS.get(f"{section}.{key}")) is not None:
        return f"{what}: {retired}"
    return f"{what} (known keys in [{section}]: {known}){_suggest(key, FIELDS[section])}"


class _Layers:
    """Typed values per key with their source, and every problem met on the way."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {k: f.default for k, f in ALL_FIELDS.items()}
        self.sources: dict[str, str] = dict.fromkeys(ALL_FIELDS, "default")
        self.invalid: set[str] = set()  # keys whose value was rejected
        self.errors: list[str] = []

    def set(self, spec: FieldSpec, value: Any, source: str, is_text: bool, origin: str) -> None:
        try:
            typed = _coerce(spec, value, is_text)
            _check(spec, typed)
        except _Bad as e:
            why = f" ({e})" if str(e) else ""
            self.errors.append(
                f"{spec.dotted}: expected {spec.expected()}, got {_got(spec, value)}{why}{origin}"
            )
            self.invalid.add(spec.dotted)
            return
        self.values[spec.dotted] = typed
        self.sources[spec.dotted] = source

    def read_file(self, path: Path) -> None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            self.errors.append(f"{path}: cannot read the config file: {e.strerror or e}")
            return
        except tomllib.TOMLDecodeError as e:
            self.errors.append(f"{path}: invalid TOML: {e}")
            return
        for section, table in data.items():
            if section not in FIELDS:
                if not isinstance(table, dict):
                    homes = [s for s in FIELDS if section in FIELDS[s]]
                    where = f"; put it under [{homes[0]}]" if homes else ""
                    self.errors.append(f"{section}: a key outside any section{where}")
                    continue
                known = ", ".join(FIELDS)
                self.errors.append(
                    f"[{section}]: unknown section (known: {known})"
                    f"{_suggest(section, FIELDS, '[{}]')}"
                )
                continue
            if not isinstance(table, dict):
                self.errors.append(f"{section}: expected a [{section}] table, got a value")
                continue
            for key, value in table.items():
                if key not in FIELDS[section]:
                    self.errors.append(_unknown_key(section, key))
                    continue
                self.set(FIELDS[section][key], value, f"file:{path}", False, "")

    def read_env(self, env: Mapping[str, str]) -> None:
        for name in sorted(env):
            rest = name.removeprefix("MOONCAKE_")
            section = next((s for s in FIELDS if rest.startswith(s.upper() + "_")), None)
            if rest == name or section is None:
                continue  # MOONCAKE_LOG_LEVEL and friends belong to others
            key = rest[len(section) + 1 :].lower()
            if key not in FIELDS[section]:
                self.errors.append(_unknown_key(section, key, name))
                continue
            spec = FIELDS[section][key]
            self.set(spec, env[name], f"env:{name}", True, f" (from {name})")

    def read_overrides(self, overrides: Mapping[str, object]) -> None:
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            if section not in FIELDS:
                self.errors.append(
                    f"{dotted}: unknown section [{section}] (known: {', '.join(FIELDS)})"
                    f"{_suggest(section, FIELDS, '[{}]')}"
                )
            elif key not in FIELDS[section]:
                self.errors.append(_unknown_key(section, key))
            else:
                self.set(ALL_FIELDS[dotted], value, "flag", True, " (from a flag)")

    def check_together(self) -> None:
        """Rules that tie keys together; skipped for keys already reported invalid."""
        v, bad = self.values, self.invalid
        if not bad & {"store.low_watermark", "store.high_watermark"} and (
            v["store.low_watermark"] >= v["store.high_watermark"]
        ):
            self.errors.append(
                f"store.low_watermark: must be below store.high_watermark "
                f"(got {v['store.low_watermark']} >= {v['store.high_watermark']})"
            )
        secret = v["cluster.secret"]
        if "cluster.secret" not in bad and secret and len(secret) < MIN_SECRET_LEN:
            self.errors.append(
                f"cluster.secret: expected at least {MIN_SECRET_LEN} characters, got {len(secret)}"
            )
        if secret and v["cluster.secret_file"]:
            self.errors.append(
                "cluster.secret_file: set either cluster.secret or cluster.secret_file, not both"
            )

        self.errors += _etcd_problems(v, self.sources)

    def build(self) -> Config:
        sections: dict[str, Any] = {
            s: t(**{k: self.values[f"{s}.{k}"] for k in FIELDS[s]}) for s, t in SECTIONS.items()
        }
        return Config(**sections)


def _etcd_problems(v: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """The etcd client's credentials that cannot work together (files are read later)."""
    out = []
    if sources["cluster.etcd_password"] == "flag":
        out.append(
            "cluster.etcd_password: not accepted as a flag (every local user sees a command "
            "line); set MOONCAKE_CLUSTER_ETCD_PASSWORD or cluster.etcd_password_file"
        )
    has_password = bool(v["cluster.etcd_password"] or v["cluster.etcd_password_file"])
    if v["cluster.etcd_password"] and v["cluster.etcd_password_file"]:
        out.append(
            "cluster.etcd_password_file: set either cluster.etcd_password or "
            "cluster.etcd_password_file, not both"
        )
    if v["cluster.etcd_user"] and not has_password:
        out.append(
            "cluster.etcd_user: needs a password: set cluster.etcd_password_file or "
            "MOONCAKE_CLUSTER_ETCD_PASSWORD"
        )
    if has_password and not v["cluster.etcd_user"]:
        out.append("cluster.etcd_user: a password is set for etcd but no user to log in as")
    if bool(v["cluster.etcd_cert_file"]) != bool(v["cluster.etcd_key_file"]):
        out.append("cluster.etcd_cert_file: set it together with cluster.etcd_key_file")
    tls = [k for k in ("ca_file", "cert_file", "key_file") if v[f"cluster.etcd_{k}"]]
    plain = [u for u in v["cluster.etcd"] if u.startswith("http://")]
    if tls and plain:
        out.append(
            f"cluster.etcd_{tls[0]}: TLS is set but cluster.etcd has http:// URLs "
            f"({', '.join(plain)}); write them as https://"
        )
    return out


def typed_override(dotted: str, value: object) -> object:
    """The value of a `--set SECTION.KEY=VALUE` flag (text, or already typed) as TOML would
    hold it for that key: a bool, int, float, list of strings, or a string (sizes, names).
    Raises ConfigError naming the key when it is unknown or the value does not fit it."""
    layers = _Layers()
    layers.read_overrides({dotted: value})
    if layers.errors:
        raise ConfigError(layers.errors)
    typed = layers.values[dotted]
    if isinstance(typed, Size):
        return str(typed)  # "64MiB", "80%": what Size.parse reads back
    return list(typed) if isinstance(typed, tuple) else typed


class LoadedConfig(msgspec.Struct, frozen=True):
    """A validated Config and where each value came from."""

    config: Config
    sources: dict[str, str]  # "store.replicas" -> "default" | "file:PATH" | "env:VAR" | "flag"


def load_config(
    path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> LoadedConfig:
    """Defaults < TOML file at `path` < `MOONCAKE_<SECTION>_<KEY>` in `env` (None = os.environ)
    < `overrides` (dotted keys, typed or string values, e.g. from --set). Reads the file; raises
    ConfigError listing every problem found."""
    layers = _Layers()
    if path is not None:
        layers.read_file(Path(path))
    layers.read_env(os.environ if env is None else env)
    layers.read_overrides(overrides or {})
    layers.check_together()
    if layers.errors:
        raise ConfigError(layers.errors)
    return LoadedConfig(config=layers.build(), sources=layers.sources)


def parse_set_option(text: str) -> tuple[str, str]:
    """("store.replicas", "2") from a `--set store.replicas=2` flag; ConfigError if malformed."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or key.count(".") != 1 or not all(key.split(".")):
        raise ConfigError(f"--set {text}: expected SECTION.KEY=VALUE, e.g. store.replicas=2")
    return key, value.strip()

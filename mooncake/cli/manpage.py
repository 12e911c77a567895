"""Render man/mooncake.1 from the CLI itself, so `--help` and the manual share one source.

Regenerate with `python -m mooncake.cli.manpage > man/mooncake.1`; a test fails when the
committed page differs from what the CLI would render.
"""

from __future__ import annotations

from typing import Any

import typer

from mooncake import __version__

_PROLOGUE = r""".TH MOONCAKE 1 "" "mooncake {version}" "User Commands"
.SH NAME
mooncake \- KVCache\-centric disaggregated LLM serving
.SH SYNOPSIS
.B mooncake
[\fB\-\-log\-level\fR \fILEVEL\fR] \fICOMMAND\fR [\fIARGS\fR]...
.SH DESCRIPTION
mooncake turns bare\-metal GPU nodes into one serving cluster built around a shared KVCache
pool, after Mooncake (Kimi; arXiv 2407.00079, FAST'25). Every node runs the same command in a
role given in TOML (master, prefill, decode or store), detects its own GPUs, RDMA NICs and
NUMA layout, and contributes its spare VRAM, DRAM and SSD to the pool.
.PP
Settings come, in increasing precedence, from built\-in defaults, the TOML file, environment
variables \fBMOONCAKE_\fISECTION\fB_\fIKEY\fR, and command\-line flags. See
\fImooncake.toml.example\fR for every key with its default.
"""

_EPILOGUE = r""".SH DEPLOYING ON N MACHINES
Write one TOML file per node and start each with \fBmooncake up \-\-config\fR \fIFILE\fR
(the role from \fBnode.role\fR or \fB\-\-role\fR). Every node must share
\fBcluster.name\fR, \fBcluster.master\fR (host:port of the master's control plane),
\fBcluster.secret\fR (or a \fBcluster.secret_file\fR with the same content),
\fBmodel.path\fR (the same weights), \fBmodel.dtype\fR and \fBmodel.block_tokens\fR;
\fBprefill.pipeline_group_size\fR, \fBprefill.chunk_tokens\fR and
\fBscheduler.cost_model_path\fR should match too (a cost model file, when set, must exist
on the master and on decode nodes).
.PP
The master reads [cluster], [model], [prefill], [decode], [scheduler], [store] (the pool's
policies), [api] and [metrics]; prefill, decode and store nodes read [cluster], [node],
[model], their own section, [store] (their own pool share) and [transfer]. Every prefill,
decode and store node gives the pool \fBstore.dram_bytes\fR of host memory (default 50% of
what is free): set it explicitly where several nodes share a host.
.PP
Start the master first, then the other nodes in any order; prefill nodes form pipeline
groups in the order they register. \fBGET /health\fR on the master answers 200 once a
prefill group and a decode node can take requests, and \fBmooncake status \-\-url\fR
\fIhttp://MASTER:8000\fR shows every node. SIGTERM drains a node (a decode node finishes
its requests, up to \fBdecode.drain_s\fR); start a new version with the same
\fBnode.id\fR. Upgrade the master last.
.SH ENVIRONMENT
.TP
.B MOONCAKE_\fISECTION\fB_\fIKEY\fR
Overrides one configuration key, e.g. \fBMOONCAKE_STORE_REPLICAS=2\fR.
.TP
.B MOONCAKE_LOG_LEVEL
Default for \fB\-\-log\-level\fR.
.SH EXIT STATUS
0 on success; 2 on invalid input (configuration, arguments, trace lines) or any other
reported error; 1 on an unexpected failure.
.SH FILES
.TP
.I mooncake.toml
The node's configuration; \fImooncake.toml.example\fR documents every key.
.SH SEE ALSO
The project README and docs/structure.md.
"""


def _escape(text: str) -> str:
    """Escape text for roff: backslashes, hyphens, and control characters at line start."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return "\n".join(lines)


def _paragraphs(text: str) -> str:
    """Help text to roff: blank lines become .PP, the rest flows."""
    blocks = [b for b in (text or "").strip().split("\n\n") if b.strip()]
    return "\n.PP\n".join(_escape(b) for b in blocks)


# NOTE: typer >= 0.22 vendors click as a private module, so this file uses click's objects
# only through their attributes (duck typing) and typer.Context, never `import click`.
Command = Any


def _metavar(param: Any) -> str:
    if param.metavar:
        return str(param.metavar)
    click_type = getattr(param, "type", None)  # click, and typer < 0.22
    if click_type is not None:
        return str(click_type.name).upper()
    annotation = param.type_descriptor.annotation  # typer's vendored click
    return getattr(annotation, "__name__", "VALUE").upper()


def _option_line(param: Any) -> str:
    names = ", ".join(f"\\fB{_escape(o)}\\fR" for o in [*param.opts, *param.secondary_opts])
    if not param.is_flag:
        names += f" \\fI{_escape(_metavar(param))}\\fR"
    return names


def _render_params(command: Command) -> list[str]:
    out: list[str] = []
    for param in command.params:
        if getattr(param, "hidden", False) or param.name in ("help",):
            continue
        help_text = getattr(param, "help", None) or ""
        if param.param_type_name == "argument":
            out += [".TP", f"\\fI{_escape((param.metavar or param.name).upper())}\\fR"]
        else:
            out += [".TP", _option_line(param)]
            default = param.default
            if (
                default not in (None, False, (), [])
                and not callable(default)
                and not getattr(param, "is_flag", False)
            ):
                help_text = f"{help_text} (default: {default})".strip()
            envvar = getattr(param, "envvar", None)
            if envvar:
                help_text = f"{help_text} [env: {envvar}]".strip()
        out.append(_paragraphs(help_text) or "\\&")
    return out


def _usage(command: Command) -> str:
    pieces = []
    if any(p.param_type_name == "option" and not p.hidden for p in command.params):
        pieces.append("[OPTIONS]")
    for p in command.params:
        if p.param_type_name == "argument":
            name = (p.metavar or p.name).upper() + ("..." if p.nargs == -1 else "")
            pieces.append(name if p.required else f"[{name}]")
    if hasattr(command, "list_commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def iter_commands(
    group: Command, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Command]]:
    """Every visible command and group under `group`, depth first, with its name path."""
    found: list[tuple[tuple[str, ...], Command]] = []
    if hasattr(group, "list_commands"):
        ctx = typer.Context(group)
        for name in sorted(group.list_commands(ctx)):
            sub = group.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            found.append(((*path, name), sub))
            found += iter_commands(sub, (*path, name))
    return found


def render(root: Command) -> str:
    lines = [_PROLOGUE.format(version=__version__).rstrip("\n")]
    lines += [".SH GLOBAL OPTIONS", *_render_params(root), ".SH COMMANDS"]
    for path, command in iter_commands(root):
        usage = _usage(command)
        lines += [f'.SS "mooncake {" ".join(path)}"', f".B mooncake {' '.join(path)}"]
        if usage:
            lines.append(_escape(usage))
        lines += [".PP", _paragraphs(command.help or command.short_help or "")]
        lines += _render_params(command)
    lines.append(_EPILOGUE.rstrip("\n"))
    return "\n".join(lines) + "\n"


def build_click_app() -> Command:
    from mooncake.cli.app import app, load_verbs

    load_verbs()
    return typer.main.get_command(app)


if __name__ == "__main__":
    print(render(build_click_app()), end="")

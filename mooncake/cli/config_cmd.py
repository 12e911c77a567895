"""`mooncake config check|show|example`: validate, inspect and document the TOML configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mooncake.cli.app import app

config_app = typer.Typer(
    help="Validate, inspect and document the TOML configuration "
    "(precedence: defaults < file < MOONCAKE_<SECTION>_<KEY> environment < --set flags).",
    no_args_is_help=True,
)
app.add_typer(config_app, name="config")

FILE_HELP = "TOML config file. Defaults to $MOONCAKE_CONFIG when set."
SET_HELP = (
    "Override one key, as SECTION.KEY=VALUE (e.g. --set store.replicas=2); repeatable; "
    "wins over the file and the environment."
)


def _load(file: Path | None, sets: list[str]) -> Any:
    """LoadedConfig from FILE, os.environ and --set; on ConfigError prints every problem and
    exits 2."""
    from mooncake.config.load import load_config, parse_set_option
    from mooncake.errors import ConfigError

    try:
        overrides = dict(parse_set_option(s) for s in sets)
        return load_config(file, overrides=overrides)
    except ConfigError as e:
        where = str(file) if file is not None else "config"
        count = len(e.errors)
        typer.echo(f"{where}: {count} problem{'s' if count > 1 else ''}", err=True)
        for line in e.errors:  # plain echo: a rich console would wrap long lines
            typer.echo(line, err=True)
        raise typer.Exit(2) from None


@config_app.command(
    "check",
    help="Validate FILE as a whole, with the MOONCAKE_* environment and --set applied.\n\n"
    'Prints "FILE: ok" and exits 0, or prints every problem on stderr (one line each, naming '
    "the key and what is allowed) and exits 2. Beyond the keys' syntax it checks what would "
    "stop the node at start: model.path must load here, and for node.role = master the cost "
    "model (scheduler.cost_model_path, read on the master's machine) must load.",
)
def check(
    file: Path = typer.Argument(..., envvar="MOONCAKE_CONFIG", help=FILE_HELP, show_default=False),
    sets: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
) -> None:
    """Validate a config file; exit 0 or print every problem and exit 2."""
    problems = start_problems(_load(file, sets).config)
    if problems:
        count = len(problems)
        typer.echo(f"{file}: {count} problem{'s' if count > 1 else ''}", err=True)
        for line in problems:
            typer.echo(line, err=True)
        raise typer.Exit(2)
    typer.echo(f"{file}: ok")


def start_problems(config: Any) -> list[str]:
    """What would stop this node's role at start although every key is valid: a model
    path that does not load, and on the master a cost model that cannot be built (through
    the function the master itself calls, so the two cannot disagree)."""
    from mooncake.conductor.roofline import master_cost_model
    from mooncake.errors import ConfigError
    from mooncake.model.info import load_model_info

    try:
        info = load_model_info(config.model.path)
    except ConfigError as e:
        return [line if line.startswith("model") else f"model.path: {line}" for line in e.errors]
    if config.node.role != "master":  # only the master reads scheduler.cost_model_path
        return []
    try:
        master_cost_model(config, info)
    except ConfigError as e:
        return e.errors
    return []


@config_app.command(
    "show",
    help="Show every key's resolved value and where it came from (default, file, env or flag)."
    "\n\nSizes show what was written and, when absolute, the bytes. Secrets (cluster.secret, "
    "api.api_keys) are never printed, only whether they are set. Exits 2 if the configuration "
    "is invalid.",
)
def show(
    file: Path | None = typer.Argument(
        None, envvar="MOONCAKE_CONFIG", help=FILE_HELP + " Without one, only defaults apply."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='Print {"SECTION": {"KEY": {"value": ..., "source": ...}}} instead of a table '
        '(absolute sizes also carry "bytes").',
    ),
    sets: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help=SET_HELP),
    docs: bool = typer.Option(False, "--doc", help="Add a column with each key's meaning."),
) -> None:
    """Print the resolved configuration as a table or JSON."""
    from mooncake.config.doc import ALL_FIELDS, FIELDS, json_value, show_value

    loaded = _load(file, sets)
    config, sources = loaded.config, loaded.sources
    if as_json:
        from mooncake.cli.output import print_json

        out = {
            section: {
                key: {
                    **json_value(spec, getattr(getattr(config, section), key)),
                    "source": sources[spec.dotted],
                }
                for key, spec in specs.items()
            }
            for section, specs in FIELDS.items()
        }
        print_json(out)
        return

    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(title=f"mooncake configuration ({file or 'defaults'})", title_justify="left")
    table.add_column("key", style="bold", no_wrap=True, min_width=max(map(len, ALL_FIELDS)))
    table.add_column("value", overflow="fold")
    table.add_column("source", style="dim", overflow="fold")
    if docs:
        table.add_column("meaning", ratio=1)
    for section, specs in FIELDS.items():
        for key, spec in specs.items():
            value = show_value(spec, getattr(getattr(config, section), key))
            source = sources[spec.dotted]
            table.add_row(spec.dotted, value, source, *([spec.doc] if docs else []))
        table.add_section()
    console.print(table)


@config_app.command(
    "example",
    help="Print a complete config file: every key with its meaning, allowed values and "
    "default.\n\nThe repository's mooncake.toml.example is this output; start a cluster's "
    "file with `mooncake config example > mooncake.toml`.",
)
def example() -> None:
    """Print the documented default config file."""
    from mooncake.config.doc import render_example

    typer.echo(render_example(), nl=False)

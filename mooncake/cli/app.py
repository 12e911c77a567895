"""Root of the CLI: global options, logging (rich on a terminal, else plain lines), and
discovery of the verb modules."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys

import typer

from mooncake import __version__
from mooncake.errors import MooncakeError

app = typer.Typer(
    name="mooncake",
    help="KVCache-centric disaggregated LLM serving: one command for every node of the cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bench_app = typer.Typer(help="Measure a part of the system against a baseline in the same run.")
app.add_typer(bench_app, name="bench")

LOG_LEVELS = ("debug", "info", "warning", "error")


class _PlainHandler(logging.StreamHandler):
    """Plain lines to whatever `sys.stderr` is when a record comes (as rich's console
    does): a CLI run in-process, as by a test runner, must not keep its closed stream."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # emit runs under the handler's lock
        super().emit(record)


def setup_logging(level: str) -> None:
    """Send library logging to stderr; library code never prints. On a terminal through
    rich; otherwise (systemd's journal, which sets JOURNAL_STREAM, a pipe, a file) one
    plain line per record, tracebacks as plain text, since the journal stamps the time."""
    handler: logging.Handler
    if sys.stderr.isatty() and not os.environ.get("JOURNAL_STREAM"):
        from rich.logging import RichHandler

        from mooncake.cli.output import err_console

        handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=True)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s", datefmt="[%X]"))
    else:
        handler = _PlainHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mooncake {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    log_level: str = typer.Option(
        "warning",
        "--log-level",
        envvar="MOONCAKE_LOG_LEVEL",
        metavar="LEVEL",
        help="debug, info, warning or error.",
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """KVCache-centric disaggregated LLM serving."""
    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    setup_logging(log_level)


def load_verbs() -> None:
    """Import every verb module of `mooncake.cli` so each registers its commands."""
    import mooncake.cli as pkg

    modules = pkgutil.walk_packages(pkg.__path__, prefix="mooncake.cli.")
    for info in sorted(modules, key=lambda m: m.name):
        if info.name not in ("mooncake.cli.app", "mooncake.cli.output"):
            importlib.import_module(info.name)


def main() -> None:
    """Console-script entry point: turns a MooncakeError into a message and its exit code
    (2; 3 for a port in use)."""
    load_verbs()
    try:
        app()
    except MooncakeError as e:
        from mooncake.cli.output import err_console

        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()

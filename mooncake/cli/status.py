"""`mooncake status`: a live view of the cluster, polled from the master's `GET /v1/status`.

Finding the master: `--url`, else `--config FILE` (api.host, or cluster.master's host
when api.host is a wildcard such as 0.0.0.0; api.port; the first of api.api_keys, then
of api.api_keys_file), else the `mooncake up --local` cluster of this machine (its
runfile).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import app
from mooncake.errors import ApiError, ConfigError

if TYPE_CHECKING:
    import httpx
    from rich.console import RenderableType

    from mooncake.api.status import Status

MAX_STATUS_BYTES = 16 << 20  # a larger answer is not a status snapshot
HTTP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Master:
    url: str  # base URL of the master's HTTP API, without a trailing "/"
    api_key: str  # "" = send no Authorization header
    source: str  # how it was found, for messages: "--url", "--config FILE", "runfile PATH"


def find_master(url: str, config: Path | None, api_key: str | None) -> Master:
    """The master to poll: --url, else --config, else the local cluster's runfile; an
    explicit `api_key` wins over the one found. Raises ConfigError when none applies."""
    from mooncake.local.runfile import read_runfile, runfile_path

    if url:
        if not _is_http_url(url):
            raise ConfigError(f"--url: expected http://HOST:PORT or https://..., got {url!r}")
        found = Master(url.rstrip("/"), "", "--url")
    elif config is not None:
        from mooncake.config.load import load_config

        cfg = load_config(config).config
        api = cfg.api
        # a wildcard bind address is not a destination: the master's host is cluster.master's
        wildcards = ("0.0.0.0", "::", "")
        host = api.host
        if host in wildcards:
            host = cfg.cluster.master.rpartition(":")[0].strip("[]")
            host = "127.0.0.1" if host in wildcards else host
        host = f"[{host}]" if ":" in host else host
        key = next(iter(api.load_keys()), "")
        found = Master(f"http://{host}:{api.port}", key, f"--config {config}")
    elif (cluster := read_runfile()) is not None:
        found = Master(cluster.url.rstrip("/"), cluster.api_key, f"runfile {runfile_path()}")
    else:
        raise ConfigError(
            "no master to read: pass --url http://HOST:PORT, or --config FILE (the master's "
            "mooncake.toml; api.host or cluster.master's host, api.port and the first of "
            "api.api_keys or api.api_keys_file are used), or start a local cluster with "
            "`mooncake up --local` "
            f"(it writes {runfile_path()}, which is found with no arguments)"
        )
    return found if api_key is None else Master(found.url, api_key, found.source)


def _is_http_url(url: str) -> bool:
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host)


def fetch_status(client: httpx.Client, master: Master) -> Status:
    """One snapshot from `GET {url}/v1/status`; raises ApiError saying what went wrong."""
    import httpx
    import msgspec

    from mooncake.api.status import decode_status

    where = f"{master.url}/v1/status"
    headers = {"Authorization": f"Bearer {master.api_key}"} if master.api_key else {}
    try:
        with client.stream("GET", where, headers=headers) as resp:
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_STATUS_BYTES:
                    raise ApiError(f"{where} sent more than {MAX_STATUS_BYTES} bytes: not a status")
    except httpx.HTTPError as e:
        raise ApiError(f"cannot reach the master at {where} ({master.source}): {e}") from e
    if resp.status_code in (401, 403):
        raise ApiError(
            f"{where} refused the API key (HTTP {resp.status_code}); pass --api-key KEY "
            "or --config with the master's api.api_keys"
        )
    if resp.status_code != 200:
        snippet = bytes(body[:200]).decode(errors="replace")
        raise ApiError(f"{where} answered HTTP {resp.status_code}: {snippet}")
    try:
        return decode_status(bytes(body))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ApiError(
            f"{where} answered something that is not a mooncake status snapshot ({e}); "
            "is it a mooncake master?"
        ) from e


def run_live(
    fetch: Callable[[], Status],
    show: Callable[[RenderableType], None],
    master: Master,
    interval_s: float,
    width: Callable[[], int],
    max_frames: int | None = None,
) -> None:
    """Fetch and `show` a frame every `interval_s` seconds; while the master does not answer,
    show why and keep retrying. Stops after `max_frames` frames (None = never)."""
    from mooncake.cli.statusview import render_status, render_unreachable

    last: Status | None = None
    down_since: float | None = None
    num_frames = 0
    while max_frames is None or num_frames < max_frames:
        started = time.monotonic()
        try:
            last = fetch()
            down_since = None
            show(render_status(last, master.url, width()))
        except ApiError as e:
            down_since = started if down_since is None else down_since
            down_for = started - down_since
            show(render_unreachable(master.url, str(e), down_for, interval_s, last, width()))
        num_frames += 1
        if max_frames is None or num_frames < max_frames:
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


@app.command("status")
def status(
    url: str = typer.Option(
        "",
        "--url",
        metavar="URL",
        help="Base URL of the master's HTTP API, e.g. http://10.0.0.1:8000.",
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        metavar="FILE",
        help="The master's config file: the URL comes from api.host (cluster.master's host when "
        "api.host is a wildcard such as 0.0.0.0) and api.port, the key from the first of "
        "api.api_keys, then of api.api_keys_file. Used when --url is not given.",
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", metavar="KEY", help="Bearer key for the API; overrides the one found."
    ),
    interval: float = typer.Option(
        1.0, "--interval", min=0.1, help="Seconds between refreshes of the live view."
    ),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    as_json: bool = typer.Option(
        False, "--json", help="Print one snapshot as JSON (the fields of GET /v1/status) and exit."
    ),
) -> None:
    """Show the cluster live: nodes, KV pool tiers, cache hit rate, queues, TTFT and TBT
    against their SLOs, request counts and transfer throughput.

    The master is --url, else the one --config describes, else the cluster `mooncake up
    --local` started on this machine. With --once or --json, exits 1 when the master cannot
    be reached or does not answer a status snapshot; the live view instead says so and keeps
    retrying. Ctrl-C quits.
    """
    import httpx
    from rich.markup import escape

    from mooncake.cli.output import console, err_console, print_json
    from mooncake.cli.statusview import render_status

    master = find_master(url, config, api_key)
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        if once or as_json:
            try:
                snapshot = fetch_status(client, master)
            except ApiError as e:
                err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
                raise typer.Exit(1) from None
            if as_json:
                print_json(snapshot)
            else:
                console.print(render_status(snapshot, master.url, console.width))
            return
        _live(client, master, interval)


def _live(client: httpx.Client, master: Master, interval_s: float) -> None:
    from rich.live import Live

    from mooncake.cli.output import console

    with Live(console=console, screen=True, auto_refresh=False) as live:

        def show(frame: RenderableType) -> None:
            live.update(frame, refresh=True)

        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the view is left
            run_live(
                lambda: fetch_status(client, master),
                show,
                master,
                interval_s,
                lambda: console.width,
            )

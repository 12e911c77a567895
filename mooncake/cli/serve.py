"""`mooncake serve`: one process serving a whole model over the OpenAI API (the coupled,
vLLM-like baseline to compare a disaggregated cluster against)."""

from __future__ import annotations

from pathlib import Path

import typer

from mooncake.cli.app import app

LOCALHOST = "127.0.0.1"


@app.command("serve")
def serve(
    config_file: Path | None = typer.Option(
        None,
        "--config",
        envvar="MOONCAKE_CONFIG",
        help="TOML config; serve reads its model, prefill, decode, scheduler, api and "
        "metrics sections. Flags win over it.",
    ),
    model: str = typer.Option(
        "",
        "--model",
        help="Model (model.path): a built-in name (smollm2-135m-instruct), a .gguf file, "
        'a local HF directory or "dummy:NAME".',
    ),
    host: str = typer.Option(
        "",
        "--host",
        help="Address to listen on (api.host). Unless set here, in the config or the "
        "environment: 127.0.0.1, this machine only (0.0.0.0 = every interface). /metrics on "
        "its own port (metrics.port) listens on 127.0.0.1 too unless metrics.host is set.",
    ),
    port: int | None = typer.Option(
        None, "--port", min=0, max=65535, help="TCP port (api.port); 0 = any free port."
    ),
    api_keys: list[str] = typer.Option(
        [],
        "--api-key",
        help="Bearer key clients must send; repeatable (api.api_keys). Every local user can "
        "read a command line (ps): prefer MOONCAKE_API_API_KEYS or api.api_keys_file.",
    ),
    max_batch: int | None = typer.Option(
        None, "--max-batch", min=1, help="Most requests decoded together (decode.max_batch)."
    ),
    kv_cache: str = typer.Option(
        "512MiB", "--kv-cache", help="Memory of the paged KV cache, e.g. 512MiB or 4GiB."
    ),
    served_model_name: str = typer.Option(
        "",
        "--served-model-name",
        help="Model id clients name (api.served_model_name; default: the model path).",
    ),
    threads: int = typer.Option(
        0, "--threads", min=0, help="torch CPU threads; 0 = torch's default."
    ),
    prefix_caching: bool = typer.Option(
        True,
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV of full blocks an earlier request computed for the same prefix "
        "(LRU eviction of unused ones), as vLLM's automatic prefix caching.",
    ),
    sets: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override one config key, as SECTION.KEY=VALUE; repeatable.",
    ),
) -> None:
    """Serve a model from this process over the OpenAI-compatible HTTP API.

    POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models,
    /v1/status, /health, /openapi.json and /metrics (on the API port, behind the API key,
    when metrics.port is 0; else on its own port, without a key; none when
    metrics.enabled is false). Prints the address it listens on once it accepts
    connections; stops on Ctrl-C or SIGTERM.
    """
    import asyncio
    import sys
    import time

    from prometheus_client import CollectorRegistry

    from mooncake.api.app import create_app
    from mooncake.api.engine_backend import EngineBackend
    from mooncake.api.server import ApiServer, check_open_api
    from mooncake.api.stats import RequestStats
    from mooncake.api.status import Status
    from mooncake.cli.output import console
    from mooncake.config.load import load_config, parse_set_option
    from mooncake.config.sizes import parse_size
    from mooncake.errors import ConfigError
    from mooncake.store.server.metrics import MetricsServer

    overrides: dict[str, object] = dict(parse_set_option(s) for s in sets)
    flags = {
        "model.path": model,
        "api.host": host,
        "api.api_keys": api_keys,
        "decode.max_batch": max_batch,
        "api.served_model_name": served_model_name,
    }
    overrides.update({k: v for k, v in flags.items() if v})
    loaded = load_config(config_file, overrides=overrides)
    cfg = loaded.config
    # NOTE: the config's 0.0.0.0 suits a cluster's master; one process started by hand
    # serves this machine unless told otherwise
    is_default = {k: loaded.sources[k] == "default" for k in ("api.host", "metrics.host")}
    api_host = LOCALHOST if is_default["api.host"] else cfg.api.host
    metrics_host = LOCALHOST if is_default["metrics.host"] else cfg.metrics.host
    keys = cfg.api.load_keys()  # api_keys (--api-key) and api_keys_file
    check_open_api(api_host, keys, cfg.api.allow_unauthenticated)
    backend = EngineBackend(
        cfg.model,
        max_batch=cfg.decode.max_batch,
        chunk_tokens=cfg.prefill.chunk_tokens,
        kv_cache_bytes=parse_size(kv_cache),
        served_model_name=cfg.api.served_model_name,
        num_threads=threads or None,
        prefix_caching=prefix_caching,
    )
    registry = CollectorRegistry() if cfg.metrics.enabled else None
    metrics_server = None
    if registry is not None and cfg.metrics.port:
        metrics_server = MetricsServer(registry=registry, host=metrics_host, port=cfg.metrics.port)
    stats, started = RequestStats(), time.monotonic()

    async def status() -> Status:
        return backend.status(
            stats,
            uptime_s=time.monotonic() - started,
            cluster=cfg.cluster.name,
            ttft_slo_s=cfg.scheduler.ttft_slo_s,
            tbt_slo_s=cfg.scheduler.tbt_slo_s,
        )

    api = create_app(
        backend,
        api_keys=keys,
        status_fn=status,
        stats=stats,
        metrics_registry=registry,
        default_max_tokens=cfg.decode.max_tokens_default,
        serve_metrics=metrics_server is None,
    )
    server = ApiServer(
        api, api_host, cfg.api.port if port is None else port, drain_s=cfg.api.drain_s
    )

    def ready() -> None:
        metrics = f"{server.url}/metrics" if registry is not None else "off"
        if metrics_server is not None:
            metrics = metrics_server.url
        everywhere = ", every interface" if server.host in ("0.0.0.0", "::") else ""
        console.print(
            f"mooncake serve: {backend.model_name} listening on {server.bound_url}{everywhere} "
            f"(OpenAI API at {server.url}/v1, metrics {metrics})",
            highlight=False,
            soft_wrap=True,
        )
        sys.stdout.flush()

    try:
        if metrics_server is not None:
            try:
                metrics_server.start()
            except OSError as e:
                raise ConfigError(
                    f"metrics: cannot listen on {metrics_host}:{cfg.metrics.port}: "
                    f"{e.strerror}; set metrics.port to a free port, or to 0 to serve /metrics "
                    "on the API port"
                ) from e
        asyncio.run(server.serve(ready))
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        backend.close()

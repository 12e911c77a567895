"""One EngineBackend over dummy:tiny behind a real uvicorn server on 127.0.0.1 (port 0),
shared by the API tests; API keys are on, so every client below sends KEY."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch", reason="EngineBackend needs torch (CPU build)")

from prometheus_client import CollectorRegistry  # noqa: E402

from mooncake.api.app import create_app  # noqa: E402
from mooncake.api.engine_backend import EngineBackend  # noqa: E402
from mooncake.api.server import ApiServer  # noqa: E402
from mooncake.api.stats import RequestStats  # noqa: E402
from mooncake.api.status import Status  # noqa: E402
from mooncake.config.settings import ModelConfig  # noqa: E402

torch.set_num_threads(1)
KEY = "sk-test-key"
MODEL = "dummy:tiny"
BLOCK = 16  # tokens per KV block
KV_BYTES = 8 * 1024 * 1024  # 2048 tokens of dummy:tiny (4 KiB per token)


@dataclass
class Served:
    url: str  # base URL, e.g. http://127.0.0.1:PORT
    engine: EngineBackend
    stats: RequestStats
    registry: CollectorRegistry


def make_engine() -> EngineBackend:
    return EngineBackend(
        ModelConfig(path=MODEL, block_tokens=BLOCK), max_batch=8, kv_cache_bytes=KV_BYTES
    )


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    engine = make_engine()
    stats, registry = RequestStats(), CollectorRegistry()

    async def status() -> Status:
        return engine.status(stats, uptime_s=1.0, ttft_slo_s=1.0, tbt_slo_s=0.1)

    app = create_app(
        engine, api_keys=[KEY], status_fn=status, metrics_registry=registry, stats=stats
    )
    server = ApiServer(app, "127.0.0.1", 0)
    server.start_in_thread()
    try:
        yield Served(server.url, engine, stats, registry)
    finally:
        server.stop()
        engine.close()

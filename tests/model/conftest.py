"""Shared engine fixtures: one tiny dummy model per session, one torch thread."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the engine tests need torch (CPU build)")

from mooncake.model.info import ModelInfo, kv_fingerprint, load_model_info  # noqa: E402
from mooncake.model.kvcache import PagedKVCache  # noqa: E402
from mooncake.model.llama import Model  # noqa: E402
from mooncake.model.weights import create_model  # noqa: E402

torch.set_num_threads(1)
BLOCK = 8  # tokens per KV block in these tests
# transformers config fields of the tiny random HF checkpoints the parity tests write
HF_SHAPES: dict[str, int] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="session")
def tiny_info() -> ModelInfo:
    return load_model_info("dummy:tiny")


@pytest.fixture(scope="session")
def tiny(tiny_info: ModelInfo) -> Model:
    return create_model(tiny_info, "float32", "cpu")


@pytest.fixture(scope="session")
def fingerprint(tiny_info: ModelInfo) -> bytes:
    return kv_fingerprint(tiny_info, "float32")


@pytest.fixture
def cache(tiny: Model) -> PagedKVCache:
    return PagedKVCache.for_model(tiny, num_blocks=48, block_tokens=BLOCK)


def prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """A deterministic pseudo-random prompt of `n` token ids."""
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % vocab for i in range(n)]

"""Shared engine fixtures: one tiny dummy model per session, one torch thread."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the engine tests need torch (CPU build)")

from mooncake.model.decode import DecodeRunner  # noqa: E402
from mooncake.model.info import ModelInfo, kv_fingerprint, load_model_info  # noqa: E402
from mooncake.model.kvcache import PagedKVCache  # noqa: E402
from mooncake.model.llama import Model  # noqa: E402
from mooncake.model.prefill import PrefillRunner  # noqa: E402
from mooncake.model.sampler import SamplingParams  # noqa: E402
from mooncake.model.sequence import Sequence  # noqa: E402
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


def assert_logits_equal(model: Model, reference: torch.nn.Module, ids: list[int]) -> None:
    """Our chunked prefill's last logits, then decode steps fed the prompt one token at a time
    (step i yields position i's logits), equal the reference's within 1e-5."""
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]  # (len(ids), vocab)
    cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=8)
    result = PrefillRunner(model, cache, chunk_tokens=16).prefill(ids)
    assert result.logits is not None
    torch.testing.assert_close(result.logits, expected[-1], atol=1e-5, rtol=1e-5)
    cache.free(result.block_ids)
    runner = DecodeRunner(model, cache, max_batch=1)
    seq = Sequence(0, ids[:1], SamplingParams(max_tokens=1, temperature=0))
    runner.add(seq)
    runner._schedule()
    for i in range(len(ids)):
        seq.token_ids[-1] = ids[i]
        torch.testing.assert_close(runner._run()[0], expected[i], atol=1e-5, rtol=1e-5)
        seq.token_ids.append(0)
        runner._schedule()

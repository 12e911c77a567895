"""Our model computes the same logits as transformers' reference implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.weights import create_model
from tests.model.conftest import prompt

transformers = pytest.importorskip(
    "transformers", reason="test-only dependency: pip install transformers safetensors"
)

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so short prompts cross every band
}


def _checkpoint(tmp_path: Path, kind: str) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE)
        model = transformers.LlamaForCausalLM(config)
    else:  # qwen2: q/k/v biases, tied embeddings
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # make the (zero-initialised) biases matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefill_and_decode_logits_equal_transformers(tmp_path: Path, kind: str) -> None:
    """Chunked prefill (last-token logits) and every decode step's logits equal
    transformers' on the same random checkpoint, within 1e-5."""
    path, reference = _checkpoint(tmp_path, kind)
    info = load_model_info(str(path))
    assert info.qkv_bias == (kind == "qwen2")
    model = create_model(info, "float32", "cpu")
    ids = prompt(37, vocab=300)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]  # (37, vocab)

    cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=8)
    result = PrefillRunner(model, cache, chunk_tokens=16).prefill(ids)
    assert result.logits is not None
    torch.testing.assert_close(result.logits, expected[-1], atol=1e-5, rtol=1e-5)
    cache.free(result.block_ids)

    # decode: feed the prompt one token at a time; step i yields the logits at position i
    runner = DecodeRunner(model, cache, max_batch=1)
    seq = Sequence(0, ids[:1], SamplingParams(max_tokens=1, temperature=0))
    runner.add(seq)
    runner._schedule()
    for i in range(len(ids)):
        seq.token_ids[-1] = ids[i]
        logits = runner._run()[0]
        torch.testing.assert_close(logits, expected[i], atol=1e-5, rtol=1e-5)
        seq.token_ids.append(0)
        runner._schedule()

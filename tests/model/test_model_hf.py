"""Our model computes the same logits as transformers' reference implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mooncake.model.info import load_model_info
from mooncake.model.weights import create_model
from tests.model.conftest import assert_logits_equal, prompt

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
    assert_logits_equal(model, reference, prompt(37, vocab=300))

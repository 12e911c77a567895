"""The model families we load compute transformers' logits on tiny random checkpoints that
transformers writes: Mistral's sliding window (prefill chunks and decode steps past it, on
the torch and Triton backends), Qwen2's window, Qwen3's q/k norms, YaRN RoPE, Llama 3.2's
tied embeddings; and what we would compute wrongly is refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch", reason="the engine tests need torch")
if not torch.cuda.is_available():  # NOTE: before triton's import, which reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mooncake.errors import ConfigError  # noqa: E402
from mooncake.kv.hashing import model_fingerprint  # noqa: E402
from mooncake.model.decode import DecodeRunner  # noqa: E402
from mooncake.model.info import kv_fingerprint, load_model_info  # noqa: E402
from mooncake.model.kvcache import PagedKVCache  # noqa: E402
from mooncake.model.llama import rope_inv_freq  # noqa: E402
from mooncake.model.prefill import PrefillRunner  # noqa: E402
from mooncake.model.sampler import SamplingParams  # noqa: E402
from mooncake.model.sequence import Sequence  # noqa: E402
from mooncake.model.weights import create_model  # noqa: E402
from tests.model.conftest import HF_SHAPES, prompt  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="test-only dependency: pip install transformers safetensors"
)

TINY = HF_SHAPES
VOCAB = TINY["vocab_size"]
WINDOW = 10  # tokens; prompts of 37 cross it several times
BLOCK = 8
ATOL = 1e-5  # fp32 (differences seen: below 4e-7; `-s` prints each)


def _save(tmp_path: Path, kind: str, **config: Any) -> tuple[Path, torch.nn.Module]:
    """A random transformers model of `kind` with TINY shapes (overridden by `config`),
    saved to `tmp_path`; q/k/v biases, where it has them, are made non-zero."""
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    model = model_cls(config_cls(**{**TINY, **config})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.5)  # not the init's ones/zeros
    model.save_pretrained(tmp_path)
    return tmp_path, model


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    diff = (actual - expected).abs().max().item()
    print(f"{what}: max |diff| {diff:.2e}")
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=ATOL, msg=f"{what}: {diff}")
    return diff


def _check_logits(path: Path, reference: torch.nn.Module, backend: str = "torch", n: int = 37):
    """Prefill in chunks of 16 (last-token logits) and teacher-forced decode steps (the
    logits at every position) equal transformers' full forward over the prompt."""
    info = load_model_info(str(path))
    model = create_model(info, "float32", "cpu", cpu_gemm="torch", attention_backend=backend)
    ids = prompt(n, vocab=VOCAB)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]  # (n, vocab)
    cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=BLOCK)
    result = PrefillRunner(model, cache, chunk_tokens=16).prefill(ids)
    assert result.logits is not None
    _close(result.logits, expected[-1], f"{backend} prefill")
    cache.free(result.block_ids)

    runner = DecodeRunner(model, cache, max_batch=1)
    seq = Sequence(0, ids[:1], SamplingParams(max_tokens=1, temperature=0))
    runner.add(seq)
    runner._schedule()
    for i in range(n):
        seq.token_ids[-1] = ids[i]
        _close(runner._run()[0], expected[i], f"{backend} decode at {i}")
        seq.token_ids.append(0)
        runner._schedule()
    return info, model


def _check_greedy(model: torch.nn.Module, reference: torch.nn.Module, new: int = 12) -> None:
    """Greedy tokens after a prompt equal transformers' `generate`."""
    ids = prompt(29, seed=3, vocab=VOCAB)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(ids) :].tolist()
    cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=BLOCK)
    runner = DecodeRunner(model, cache, max_batch=1, chunk_tokens=16)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    runner.add(Sequence(0, ids, params))
    assert [e.token_id for e in runner.run_until_done()[0]] == expected


# -- sliding window -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return _save(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW)


def test_mistral_sliding_window_matches_transformers(mistral: tuple) -> None:
    """Mistral's window is honoured: prefill chunks and decode steps past it give
    transformers' logits, and greedy decoding its tokens."""
    info, model = _check_logits(*mistral)
    assert info.spec.sliding_window == WINDOW and model.sliding_window == WINDOW
    _check_greedy(model, mistral[1])


def test_mistral_sliding_window_on_triton(mistral: tuple) -> None:
    """The Triton backend (Triton's interpreter without a GPU) applies the window too."""
    pytest.importorskip("triton", reason="the Triton backend tests need triton")
    _check_logits(*mistral, backend="triton")


def test_window_enters_the_kv_fingerprint(mistral: tuple) -> None:
    """KV computed under another window is another model's: the fingerprint differs, while
    a model without a window keeps the fingerprint it had before windows existed."""
    info = load_model_info(str(mistral[0]))
    wider = msgspec.structs.replace(info.spec, sliding_window=2 * WINDOW)
    other = msgspec.structs.replace(info, spec=wider)
    assert kv_fingerprint(info, "float32") != kv_fingerprint(other, "float32")
    tiny = load_model_info("dummy:tiny").spec
    assert kv_fingerprint(load_model_info("dummy:tiny"), "bfloat16") == model_fingerprint(
        tiny.name, tiny.num_layers, tiny.num_kv_heads, tiny.head_dim, "bfloat16"
    )


@pytest.mark.parametrize(
    ("use", "max_window_layers", "window"), [(True, 0, WINDOW), (False, 0, None), (True, 2, None)]
)
def test_qwen2_window_as_transformers_applies_it(
    tmp_path: Path, use: bool, max_window_layers: int, window: int | None
) -> None:
    """Qwen2 slides only with use_sliding_window, on layers >= max_window_layers: on all of
    them the window is honoured (transformers' logits), on none it is ignored."""
    path, reference = _save(
        tmp_path,
        "qwen2",
        use_sliding_window=use,
        sliding_window=WINDOW,
        max_window_layers=max_window_layers,
    )
    info, model = _check_logits(path, reference)
    assert info.spec.sliding_window == window
    _check_greedy(model, reference)


def test_window_on_some_layers_is_refused(tmp_path: Path) -> None:
    path, _ = _save(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    with pytest.raises(ConfigError, match=r"sliding-window attention on layers \[1\] only"):
        load_model_info(str(path))


# -- Qwen3, Llama 3.2, YaRN -----------------------------------------------------------------


def test_qwen3_matches_transformers(tmp_path: Path) -> None:
    """Qwen3: per-head q/k RMSNorm before RoPE, an explicit head_dim (32: q is twice the
    hidden size), no q/k/v bias; logits and greedy tokens equal transformers'."""
    path, reference = _save(tmp_path, "qwen3", head_dim=32)
    info, model = _check_logits(path, reference)
    assert info.spec.qk_norm and info.spec.head_dim == 32 and not info.qkv_bias
    _check_greedy(model, reference)


def test_llama32_tied_embeddings_and_llama3_rope(tmp_path: Path) -> None:
    """Llama 3.2's layout (tied embeddings, llama3 RoPE scaling) loads and matches."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    path, reference = _save(tmp_path, "llama", tie_word_embeddings=True, rope_parameters=rope)
    info, model = _check_logits(path, reference)
    assert info.spec.tie_word_embeddings
    _check_greedy(model, reference)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}


@pytest.mark.parametrize(
    "params",
    [
        {"original_max_position_embeddings": 16},
        {"original_max_position_embeddings": 16, "beta_fast": 16.0, "beta_slow": 2.0},
        {"original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0},
        {"original_max_position_embeddings": 16, "attention_factor": 1.3},
        {"original_max_position_embeddings": 16, "truncate": False},
        {"original_max_position_embeddings": 64, "factor": None},  # 256 / 64
    ],
)
def test_yarn_parameters_equal_transformers(tmp_path: Path, params: dict) -> None:
    """Our YaRN frequencies and attention factor are transformers' for every option."""
    config = transformers.Qwen2Config(**TINY, rope_parameters={**YARN, **params})
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, attention_factor = init(config)
    (tmp_path / "config.json").write_text(config.to_json_string())
    (tmp_path / "model.safetensors").write_bytes(b"")
    info = load_model_info(str(tmp_path))
    assert info.spec.rope_scaling is not None
    assert info.spec.rope_scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    torch.testing.assert_close(rope_inv_freq(info.spec), inv_freq, atol=0, rtol=1e-6)


def test_yarn_model_matches_transformers_past_the_original_context(tmp_path: Path) -> None:
    """A Qwen2 with YaRN (factor 4 over 16 original positions, mscale 0.7) gives
    transformers' logits at positions up to 36, past the original context."""
    rope = {**YARN, "original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0}
    path, reference = _save(tmp_path, "qwen2", rope_parameters=rope)
    info, model = _check_logits(path, reference)
    assert info.spec.rope_scaling is not None
    assert info.spec.rope_scaling.attention_factor != 1.0  # the cos/sin scale matters here
    _check_greedy(model, reference)


# -- refusals -------------------------------------------------------------------------------


def _config_dir(tmp_path: Path, **config: Any) -> str:
    base = transformers.LlamaConfig(**TINY).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq", "bitsandbytes", "compressed-tensors"])
def test_quantized_checkpoint_is_refused(tmp_path: Path, method: str) -> None:
    path = _config_dir(tmp_path, quantization_config={"quant_method": method, "bits": 8})
    with pytest.raises(ConfigError, match=rf"is quantized \(quant_method '{method}'\); the engine"):
        load_model_info(path)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "kimi_k2"])
def test_mla_models_are_refused(tmp_path: Path, model_type: str) -> None:
    path = _config_dir(tmp_path, model_type=model_type)
    with pytest.raises(ConfigError, match=r"latent attention \(MLA\).*supported: llama, mistral"):
        load_model_info(path)


def test_unsupported_types_are_refused_naming_what_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'gpt2' model; supported: llama, mistral, qwen2, qwen3"):
        load_model_info(_config_dir(tmp_path, model_type="gpt2"))
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match=r"'dynamic' is not supported \(default, linear, llama3"):
        load_model_info(_config_dir(tmp_path, rope_parameters=rope))
    with pytest.raises(ConfigError, match="attention_bias"):
        load_model_info(_config_dir(tmp_path, attention_bias=True))

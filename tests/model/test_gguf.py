"""GGUF checkpoints load exactly: our dequantizers equal the `gguf` package's bit for bit,
tiny GGUFs written from transformers models compute transformers' logits, the SmolLM2
Q4_1 file computes what transformers' own GGUF loader computes, and what we cannot load
is refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mooncake.errors import ConfigError
from mooncake.model.decode import DecodeRunner
from mooncake.model.dequant import BLOCKS, dequantize
from mooncake.model.ggufinfo import SUPPORTED_TYPES, llama3_rope_divisors
from mooncake.model.info import ModelInfo, kv_fingerprint, load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.spec import RopeScaling
from mooncake.model.weights import create_model
from tests.model.conftest import HF_SHAPES, prompt
from tests.model.smollm2 import NEW_TOKENS, reference, smollm2_file

gguf = pytest.importorskip("gguf", reason="test-only dependency: pip install gguf")
transformers = pytest.importorskip("transformers", reason="test-only dependency: transformers")
Q = gguf.GGMLQuantizationType


# -- dequantizers ---------------------------------------------------------------------------
def _blocks(name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Bytes of a `name` tensor: gguf's quantizer where it has one, else random blocks
    whose float16 scales are finite (the K quants have no quantizer in gguf-py)."""
    x = rng.standard_normal(shape).astype(np.float32)
    try:
        return np.ascontiguousarray(gguf.quants.quantize(x, Q[name])).view(np.uint8)
    except NotImplementedError:
        elems, nbytes = BLOCKS[name]
        raw = rng.integers(0, 256, (shape[0] * shape[1] // elems, nbytes), dtype=np.uint8)
        scales = rng.uniform(-0.1, 0.1, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        at = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2]}[name]
        for i, off in enumerate(at):
            raw[:, off : off + 2] = scales[:, 2 * i : 2 * i + 2]
        return raw.reshape(shape[0], -1)  # gguf-py dequantizes row by row


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_dequantize_equals_gguf(name: str) -> None:
    """Each type decodes to exactly gguf.quants.dequantize's float32 values, into a fresh
    tensor and into a given one."""
    rng = np.random.default_rng(0)
    shape = (8, 768)  # 3 K-quant super-blocks per row, 24 small blocks
    raw = _blocks(name, shape, rng)
    expected = gguf.quants.dequantize(raw, Q[name])
    ours = dequantize(torch.from_numpy(raw.reshape(-1).copy()), name, shape)
    assert np.array_equal(ours.numpy(), expected)
    out = torch.full(shape, float("nan"))
    dequantize(torch.from_numpy(raw.reshape(-1).copy()), name, shape, out=out)
    assert np.array_equal(out.numpy(), expected)


# -- tiny GGUFs written from transformers models ------------------------------------------
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF's rotate-half q/k rows into interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    qtype: int = Q.F32,
    extra: bool = False,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """Convert a transformers Llama/Qwen2/Qwen3 model as llama.cpp's convert script does."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    tokens[5] = "<|im_end|>"
    w.add_token_list(tokens)
    w.add_token_types([3 if i == 5 else 1 for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.startswith("model.layers."):
            _, _, idx, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{idx}.{layer_names[module]}.{kind}"
        else:
            name = names[hf_name]
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    if extra:
        w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPES)).eval()
    if kind == "qwen3":  # q/k norms (made to matter), head_dim 32: q twice the hidden size
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**HF_SHAPES, head_dim=32))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
        return model.eval()
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**HF_SHAPES, tie_word_embeddings=True)
    ).eval()
    with torch.no_grad():  # make the (zero-initialised) biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _prefill_logits(info: ModelInfo, ids: list[int]) -> torch.Tensor:
    model = create_model(info, "float32", "cpu")
    cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=8)
    result = PrefillRunner(model, cache, chunk_tokens=16).prefill(ids)
    assert result.logits is not None
    return result.logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_computes_transformers_logits(tmp_path: Path, kind: str) -> None:
    """A float32 GGUF converted as llama.cpp does (q/k rows permuted for llama, biases and
    tied embeddings for qwen2, q/k norms and head_dim for qwen3) gives transformers'
    logits of the original model: the permutation is undone and every tensor lands where
    it belongs."""
    reference = _hf_model(kind)
    path = _write_gguf(tmp_path / f"tiny-{kind}.gguf", reference, kind)
    info = load_model_info(str(path))
    assert info.qkv_bias == (kind == "qwen2")
    assert info.spec.tie_word_embeddings == (kind == "qwen2")
    assert info.spec.qk_norm == (kind == "qwen3")
    assert (info.bos_token_id, info.eos_token_ids) == (1, (2, 5))  # EOS and <|im_end|>
    ids = prompt(37, vocab=300)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(_prefill_logits(info, ids), expected, atol=1e-5, rtol=1e-5)


def test_llama31_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    """Llama 3.1's scaling, baked by llama.cpp into a rope_freqs tensor, is recognised: the
    logits equal transformers' with rope_type llama3. Other divisors are refused."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= {"original_max_position_embeddings": 8192}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF_SHAPES, rope_scaling=rope)
    reference = transformers.LlamaForCausalLM(config).eval()
    freqs = llama3_rope_divisors(RopeScaling(), 10000.0, 16)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and len(set(freqs)) > 2  # all 3 bands
    path = _write_gguf(tmp_path / "l31.gguf", reference, "llama", rope_freqs=freqs)
    info = load_model_info(str(path))
    assert info.spec.rope_scaling == RopeScaling()
    ids = prompt(37, vocab=300)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(_prefill_logits(info, ids), expected, atol=1e-5, rtol=1e-5)
    path = _write_gguf(tmp_path / "odd.gguf", reference, "llama", rope_freqs=freqs[::-1])
    with pytest.raises(ConfigError, match="rope_freqs are not Llama 3.1's scaling"):
        load_model_info(str(path))


def test_serving_dtype_is_the_float32_load_cast(tmp_path: Path) -> None:
    """Loading a GGUF in bfloat16 gives the float32 load's weights rounded to bfloat16
    (the permuted q/k rows and fused tensors included)."""
    path = _write_gguf(tmp_path / "tiny.gguf", _hf_model("llama"), "llama", Q.Q4_1)
    info = load_model_info(str(path))
    full = create_model(info, "float32", "cpu", cpu_gemm="torch")
    half = create_model(info, "bfloat16", "cpu", cpu_gemm="torch")
    for name, param in half.named_parameters():
        assert torch.equal(param, full.get_parameter(name).to(torch.bfloat16)), name


def test_stage_loads_only_its_layers(tmp_path: Path) -> None:
    """A pipeline stage built from a GGUF holds exactly the whole model's weights there."""
    path = _write_gguf(tmp_path / "tiny.gguf", _hf_model("llama"), "llama", Q.Q8_0)
    info = load_model_info(str(path))
    whole = create_model(info, "float32", "cpu", cpu_gemm="torch")
    stage = create_model(info, "float32", "cpu", (1, 2), cpu_gemm="torch")
    assert stage.embed_tokens is None
    for name, param in stage.named_parameters():
        global_name = name.replace("layers.0.", "layers.1.")
        assert torch.equal(param, whole.get_parameter(global_name)), name


def test_path_may_name_a_directory_holding_one_gguf(tmp_path: Path) -> None:
    """A directory with one .gguf loads it; with two, the error names both."""
    path = _write_gguf(tmp_path / "a.gguf", _hf_model("llama"), "llama")
    assert load_model_info(str(tmp_path)).spec == load_model_info(str(path)).spec
    (tmp_path / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        load_model_info(str(tmp_path))


# -- refusals -------------------------------------------------------------------------------
def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "x.gguf", _hf_model("llama"), "gpt2")
    with pytest.raises(
        ConfigError, match=r"'gpt2' GGUF; supported architectures: llama, qwen2, qwen3"
    ):
        load_model_info(str(path))


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    """A Q2_K tensor (decoded by no dequantizer of ours) is refused, naming the tensor, its
    type and the accepted types."""
    path = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 84), np.uint8), raw_dtype=Q.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"token_embd.weight is Q2_K; supported .*Q4_1.*Q6_K"):
        load_model_info(str(path))


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "x.gguf", _hf_model("llama"), "llama", extra=True)
    with pytest.raises(ConfigError, match="blk.0.attn_q_norm.weight"):
        load_model_info(str(path))


def test_not_a_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_model_info(str(tmp_path / "x.gguf"))


# -- fingerprints ---------------------------------------------------------------------------
def test_fingerprints_differ_across_formats_and_quantizations(tmp_path: Path) -> None:
    """The same weights as an HF directory, a float32 GGUF and a Q8_0 GGUF have the same
    shapes but three KV fingerprints: their KV never meets in the pool."""
    model = _hf_model("llama")
    (tmp_path / "hf").mkdir()
    model.save_pretrained(tmp_path / "hf")
    infos = [
        load_model_info(str(tmp_path / "hf")),
        load_model_info(str(_write_gguf(tmp_path / "tiny.gguf", model, "llama"))),
        load_model_info(str(_write_gguf(tmp_path / "tiny-q8.gguf", model, "llama", Q.Q8_0))),
    ]
    shapes = {(s.num_layers, s.num_kv_heads, s.head_dim) for s in (i.spec for i in infos)}
    assert len(shapes) == 1
    assert len({kv_fingerprint(i, "float32") for i in infos}) == 3
    assert infos[1].spec.name.startswith("gguf:tiny:")


# -- the real file: SmolLM2-135M-Instruct, Q4_1 ---------------------------------------------
@pytest.mark.timeout(600)
def test_smollm2_q4_1_matches_transformers() -> None:
    """On the real Q4_1 file: first-step logits within 1e-3 of transformers' GGUF loader
    (float32), and the same 32 greedy tokens for each of 5 prompts, run as one batch."""
    file = smollm2_file()
    ref = reference()
    prompts, first_logits, expected_tokens = ref.prompt_ids, ref.first_logits, ref.tokens
    info = load_model_info(str(file))
    model = create_model(info, "float32", "cpu")
    cache = PagedKVCache.for_model(model, num_blocks=64, block_tokens=16)

    for ids, expected in zip(prompts, first_logits, strict=True):
        result = PrefillRunner(model, cache, chunk_tokens=64).prefill(ids)
        assert result.logits is not None
        max_diff = float((result.logits - expected).abs().max())
        assert max_diff < 1e-3, max_diff
        cache.free(result.block_ids)

    runner = DecodeRunner(model, cache, max_batch=len(prompts))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        runner.add(Sequence(i, ids, params))
    events = runner.run_until_done()
    got = [[e.token_id for e in events[i]] for i in range(len(prompts))]
    assert got == expected_tokens


@pytest.mark.timeout(600)
def test_smollm2_pool_objects_serve_it_and_are_refused_by_other_weights() -> None:
    """A system prompt's KV objects in a pool: SmolLM2 reuses them on a repeat with another
    question; a model of the same shapes but other weights, even asking under SmolLM2's
    block hashes, refuses every object (their fingerprint is SmolLM2's) and computes its
    own logits."""
    from msgspec.structs import replace

    from mooncake.kv.hashing import PrefixHasher
    from mooncake.kv.layerio import DramKVPool

    info = load_model_info(str(smollm2_file()))
    fp = kv_fingerprint(info, "float32")
    smol = create_model(info, "float32", "cpu")
    system = prompt(48, seed=3, vocab=info.spec.vocab_size)
    first, repeat = system + prompt(9, seed=4), system + prompt(7, seed=5)
    hasher = PrefixHasher(16, b"secret", fp)

    def runner(model, fingerprint, pool):
        cache = PagedKVCache.for_model(model, num_blocks=16, block_tokens=16)
        return cache, PrefillRunner(
            model,
            cache,
            chunk_tokens=64,
            hasher=hasher,
            source=pool,
            sink=pool,
            fingerprint=fingerprint,
        )

    pool = DramKVPool(PrefillRunner(smol, PagedKVCache.for_model(smol, 4, 16)).layout, fp)
    cache, pooled = runner(smol, fp, pool)
    cache.free(pooled.prefill(first).block_ids)
    assert pool.num_objects == 3  # 57 tokens: three full blocks of 16
    again = pooled.prefill(repeat)
    assert again.stats.num_reused_tokens == 48
    cache.free(again.block_ids)

    other_info = replace(info, is_dummy=True, spec=replace(info.spec, name="other-weights"))
    other = create_model(other_info, "float32", "cpu")
    other_fp = kv_fingerprint(other_info, "float32")
    assert other_fp != fp
    other_cache, other_pooled = runner(other, other_fp, pool)
    refused = other_pooled.prefill(repeat)
    assert refused.stats.num_reused_tokens == 0
    plain = PrefillRunner(other, other_cache, chunk_tokens=64).prefill(repeat)
    torch.testing.assert_close(refused.logits, plain.logits)
    pool.close()

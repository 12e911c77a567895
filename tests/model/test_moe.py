"""Mixture-of-experts models (moe.py): the grouped experts equal a loop over experts,
Mixtral and Qwen3-MoE checkpoints compute transformers' logits (and Mixtral its greedy
tokens), both expert layouts load, and a decode step's ops do not grow with the number of
experts."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mooncake.bench.stepops import count
from mooncake.errors import ConfigError
from mooncake.model.decode import DecodeRunner
from mooncake.model.info import _info_from_hf, load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.moe import Experts, SparseMoE
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.spec import ModelInfo, get_model_spec
from mooncake.model.weights import create_model
from tests.model.conftest import assert_logits_equal, prompt
from tests.model.test_model_hf import COMMON

transformers = pytest.importorskip(
    "transformers", reason="test-only dependency: pip install transformers safetensors"
)
from safetensors.torch import load_file, save_file  # noqa: E402

MIXTRAL = dict(COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


def _experts_loop(experts: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    """The reference: for each expert, its chosen (token, slot) pairs, one at a time."""
    out = torch.zeros(x.shape)
    for e in range(experts.gate_up_proj.shape[0]):
        tokens, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.index_add_(0, tokens, y * w[tokens, slot, None])
    return out


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random Mixtral saved by transformers (one tensor per expert: w1/w3/w2); its
    router is sharpened so that routing decides the output."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("mixtral")
    model.eval().save_pretrained(path)
    return path, model


def _restack(src: Path, dst: Path, num_layers: int, num_experts: int) -> None:
    """Copy checkpoint `src` to `dst` with its experts stacked as transformers 5 holds them:
    mlp.experts.gate_up_proj (E, 2I, H), mlp.experts.down_proj (E, H, I), mlp.gate."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    for i in range(num_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        parts = [
            [tensors.pop(f"{old}experts.{e}.{w}.weight") for e in range(num_experts)]
            for w in ("w1", "w3", "w2")
        ]
        w1, w3, w2 = (torch.stack(p) for p in parts)
        tensors[f"{new}experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        tensors[f"{new}experts.down_proj"] = w2
        tensors[f"{new}gate.weight"] = tensors.pop(f"{old}gate.weight")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_grouped_experts_equal_a_loop_over_experts() -> None:
    """Random routings, including a token sent to one expert twice, experts nobody chose,
    every token on one expert, and a single token, give the loop's result within 1e-5."""
    torch.manual_seed(0)
    experts = Experts(num_experts=6, hidden_size=32, intermediate_size=48)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    routings = [
        torch.tensor([[1, 1], [4, 1], [1, 4], [4, 4], [1, 0]]),  # 2, 3, 5 unused; twice
        torch.full((7, 2), 5),  # one expert takes everything
        torch.tensor([[3, 0, 2]]),  # one token, k = 3
        torch.randint(0, 6, (40, 2)),
    ]
    for ids in routings:
        x = torch.randn(ids.shape[0], 32)
        w = torch.rand(ids.shape, dtype=torch.float32)
        with torch.no_grad():
            got = experts(x, ids, w)
        torch.testing.assert_close(got, _experts_loop(experts, x, ids, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_equals_qwen3_moe_block(norm_topk_prob: bool) -> None:
    """Our SparseMoE with Qwen3-MoE's weights equals transformers' Qwen3MoeSparseMoeBlock,
    with and without renormalised top-k probabilities (8 of 16 experts)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=24,
        num_experts=16,
        num_experts_per_tok=8,
        norm_topk_prob=norm_topk_prob,
    )
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    reference = Qwen3MoeSparseMoeBlock(config).eval()
    spec = msgspec.structs.replace(
        get_model_spec("dummy:mixtral-tiny"),
        hidden_size=32,
        num_experts=16,
        num_experts_per_tok=8,
        moe_intermediate_size=24,
        norm_topk_prob=norm_topk_prob,
    )
    ours = SparseMoE(spec)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.3)
        ours.load_state_dict(reference.state_dict())
        x = torch.randn(9, 32)
        torch.testing.assert_close(ours(x), reference(x[None])[0], atol=1e-5, rtol=1e-5)


def test_mixtral_prefill_and_decode_logits_equal_transformers(mixtral) -> None:
    """Chunked prefill (last-token logits) and every decode step's logits equal
    transformers' on a random Mixtral checkpoint, within 1e-5 (float32)."""
    path, reference = mixtral
    info = load_model_info(str(path))
    assert (info.spec.num_experts, info.spec.num_experts_per_tok) == (4, 2)
    assert_logits_equal(create_model(info, "float32", "cpu"), reference, prompt(29, vocab=300))


def test_mixtral_greedy_tokens_of_a_batch_equal_transformers(mixtral) -> None:
    """Three prompts decoded together (prefill, then 8 steps) give transformers' greedy
    tokens for each prompt alone."""
    path, reference = mixtral
    model = create_model(load_model_info(str(path)), "float32", "cpu")
    prompts = [prompt(n, seed=n, vocab=300) for n in (5, 19, 11)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cache = PagedKVCache.for_model(model, num_blocks=24, block_tokens=8)
    runner = DecodeRunner(model, cache, max_batch=3)
    for i, p in enumerate(prompts):
        runner.add(Sequence(i, p, params))
    got = {i: [e.token_id for e in es] for i, es in runner.run_until_done().items()}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])  # NOTE: an explicit mask: some prompts hold token 0
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        assert got[i] == out[0, len(p) :].tolist(), f"prompt {i}"


def test_qwen3_moe_with_a_dense_layer_equals_transformers(tmp_path: Path) -> None:
    """A random Qwen3-MoE (q/k norm; 8 experts, top 3 without renormalisation; layer 1
    dense through mlp_only_layers) gives transformers' logits at every prompt position
    (prefill in chunks, then decode steps), within 1e-5 (float32)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=256,
    )
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in reference.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.normal_(0, 0.5)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.3)  # not the identity
    reference.save_pretrained(tmp_path)
    info = load_model_info(str(tmp_path))
    assert info.spec.qk_norm and info.spec.dense_layers == (1,)
    assert_logits_equal(create_model(info, "float32", "cpu"), reference, prompt(21, vocab=300))


def test_both_expert_layouts_load_the_same_weights(mixtral, tmp_path: Path) -> None:
    """Per-expert tensors (w1/w3/w2 under block_sparse_moe) and stacked ones
    (mlp.experts.gate_up_proj / down_proj) give the same parameters."""
    path, _ = mixtral
    _restack(path, tmp_path / "stacked", MIXTRAL["num_hidden_layers"], 4)
    models = [
        create_model(load_model_info(str(p)), "float32", "cpu", cpu_gemm="torch")
        for p in (path, tmp_path / "stacked")
    ]
    per_expert, stacked = (dict(m.named_parameters()) for m in models)
    assert per_expert.keys() == stacked.keys()
    assert "layers.1.mlp.experts.gate_up_proj" in stacked
    for name, value in per_expert.items():
        assert torch.equal(value, stacked[name]), name


def _decode_step_ops(num_experts: int) -> tuple[int, int]:
    spec = msgspec.structs.replace(get_model_spec("dummy:mixtral-tiny"), num_experts=num_experts)
    info = ModelInfo(spec=spec, path=spec.name, is_dummy=True)
    model = create_model(info, "float32", "cpu", cpu_gemm="torch")
    cache = PagedKVCache.for_model(model, num_blocks=24, block_tokens=8)
    runner = DecodeRunner(model, cache, max_batch=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(3):
        runner.add(Sequence(i, prompt(6 + i, seed=i), params))
    runner.step()  # prefill and the first token
    c = count(runner.step)
    return c.num_ops, c.num_syncs


def test_decode_step_ops_do_not_grow_with_the_number_of_experts() -> None:
    """A decode step of 3 sequences dispatches as many ops and host syncs with 4 experts
    as with 32 (no loop over experts, no read of routing on the host)."""
    assert _decode_step_ops(4) == _decode_step_ops(32)


def test_moe_layers_run_no_host_sync() -> None:
    """The MoE block alone dispatches no op that makes the host wait for the device."""
    spec = get_model_spec("dummy:mixtral-tiny")
    moe = SparseMoE(spec)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(5, spec.hidden_size)
    with torch.no_grad():
        c = count(lambda: moe(x))
    assert c.num_syncs == 0, dict(c.syncs)


def test_moe_costs_count_every_expert_in_bytes_and_the_chosen_ones_in_flops() -> None:
    """Mixtral-8x7B holds 46.7B weights and multiplies 12.6B per token in its layers; the
    tiny model's spec counts exactly the parameters the engine builds."""
    big = get_model_spec("mixtral-8x7b")
    assert round(big.num_params / 1e9, 1) == 46.7
    assert round(big.num_matmul_params / 1e9, 1) == 12.6
    assert big.weight_bytes() == 2 * big.num_params
    info = load_model_info("dummy:mixtral-tiny")
    model = create_model(info, "float32", "meta")
    assert isinstance(model, Model)
    assert sum(p.numel() for p in model.parameters()) == info.spec.num_params
    dense = msgspec.structs.replace(info.spec, num_experts=0)
    assert dense.num_params < info.spec.num_params


def test_qwen3_moe_config_marks_dense_layers() -> None:
    """mlp_only_layers and decoder_sparse_step choose the dense layers as transformers'
    Qwen3MoeDecoderLayer does; norm_topk_prob and the expert width come through."""
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 192,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "vocab_size": 300,
    }
    spec = _info_from_hf(config, "/x/q", ("m.safetensors",), "0").spec
    assert spec.dense_layers == (0, 2, 3, 4)
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert (spec.moe_intermediate_size, spec.norm_topk_prob) == (32, False)


def test_moe_gguf_is_refused_by_name(tmp_path: Path) -> None:
    """A GGUF with llama.expert_count (Mixtral's GGUFs) is refused, pointing to its HF form."""
    gguf = pytest.importorskip("gguf", reason="test-only dependency: pip install gguf")
    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="mixture-of-experts GGUF"):
        load_model_info(str(path))

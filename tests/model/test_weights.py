"""Dummy weights: real shapes, stage-independent values."""

from __future__ import annotations

import torch

from mooncake.model.info import load_model_info
from mooncake.model.llama import Model
from mooncake.model.weights import create_model


def test_dummy_real_shapes_build_on_the_meta_device():
    """dummy:llama3-70b (the paper's dummy LLaMA) has the real parameter count; a stage
    holds only its layers."""
    info = load_model_info("dummy:llama3-70b")
    model = create_model(info, "bfloat16", "meta")
    assert sum(p.numel() for p in model.parameters()) == info.spec.num_params
    stage: Model = create_model(info, "bfloat16", "meta", (40, 80))
    assert len(stage.layers) == 40 and stage.embed_tokens is None and stage.is_last


def test_a_stage_gets_the_same_weights_as_the_whole_model(tiny_info, tiny):
    stage = create_model(tiny_info, "float32", "cpu", (2, 4))
    assert torch.equal(stage.layer(3).mlp.down_proj.weight, tiny.layer(3).mlp.down_proj.weight)
    assert stage.lm_head is not None and tiny.lm_head is not None
    assert torch.equal(stage.lm_head.weight, tiny.lm_head.weight)
    other_seed = create_model(tiny_info, "float32", "cpu", (2, 4), seed=1)
    assert not torch.equal(
        other_seed.layer(3).mlp.down_proj.weight, tiny.layer(3).mlp.down_proj.weight
    )


def test_weights_filled_on_the_device_are_stage_independent(tiny_info, tiny):
    """fill_on_device (a bench's 8B in seconds) seeds each tensor as the host draw does: a
    stage equals the whole model, and on the CPU the values are the host draw's."""
    whole = create_model(tiny_info, "float32", "cpu", cpu_gemm="torch", fill_on_device=True)
    stage = create_model(tiny_info, "float32", "cpu", (2, 4), cpu_gemm="torch", fill_on_device=True)
    w = whole.layer(3).mlp.down_proj.weight
    assert torch.equal(stage.layer(3).mlp.down_proj.weight, w)
    assert torch.equal(w, tiny.layer(3).mlp.down_proj.weight)
    assert torch.equal(
        whole.layer(0).input_layernorm.weight, torch.ones(tiny_info.spec.hidden_size)
    )

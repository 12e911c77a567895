"""The tensor-parallel degree (`tpdegree`, torch-free): automatic is 1 on a CPU and on GPUs
the smallest power of two whose weight share fits 60% of one GPU (real specs on 80 GiB
GPUs); what a degree does not divide, too few GPUs, and a model no degree fits are refused
by name."""

from __future__ import annotations

import pytest

from mooncake.errors import ConfigError
from mooncake.model.spec import get_model_spec
from mooncake.model.tpdegree import WEIGHT_SHARE, auto_degree, resolve_degree, shard_problem

GIB = 1 << 30
H100 = [80 * GIB] * 8


@pytest.mark.parametrize(
    ("name", "degree"),
    [("llama3-8b", 1), ("mixtral-8x7b", 2), ("llama3-70b", 4), ("llama2-70b", 4)],
)
def test_auto_is_the_smallest_power_of_two_that_fits(name: str, degree: int) -> None:
    """bf16 weights of 16, 93, 141 and 138 GB over 80 GiB GPUs; the chosen share fits
    60%, half the degree's does not."""
    spec = get_model_spec(name)
    assert resolve_degree(0, spec, "bfloat16", H100) == degree
    weight_bytes = spec.weight_bytes(2)
    assert weight_bytes / degree <= WEIGHT_SHARE * H100[0]
    if degree > 1:
        assert weight_bytes / (degree // 2) > WEIGHT_SHARE * H100[0]


def test_auto_is_one_on_a_cpu_and_explicit_degrees_are_kept() -> None:
    spec = get_model_spec("llama3-70b")
    assert resolve_degree(0, spec, "float32", []) == 1  # a CPU node: no GPU to share
    assert resolve_degree(8, spec, "bfloat16", H100) == 8
    assert resolve_degree(2, get_model_spec("dummy:tiny"), "float32", []) == 2  # gloo ranks


def test_auto_skips_degrees_that_do_not_divide_the_model() -> None:
    """A degree that fits by memory but splits no heads is passed over for the next."""
    spec = get_model_spec("dummy:tiny")  # 4 heads, 2 KV heads, MLP 768
    assert shard_problem(spec, 8) == "its 4 attention heads"
    assert auto_degree(spec, weight_bytes=10 * GIB, num_gpus=8, gpu_bytes=10 * GIB) == 2
    with pytest.raises(ConfigError, match=r"no power-of-two degree up to the 8 .* one of 1, 2, 4"):
        auto_degree(spec, weight_bytes=10 * GIB, num_gpus=8, gpu_bytes=2 * GIB)


def test_what_cannot_run_is_refused_by_name() -> None:
    spec = get_model_spec("llama3-70b")
    with pytest.raises(ConfigError, match="tensor_parallel = 0 .*fit in 60% of a GPU's 24.0 GiB"):
        resolve_degree(0, spec, "bfloat16", [24 * GIB] * 4)
    with pytest.raises(ConfigError, match="tensor_parallel = 8 needs 8 GPUs; 4 are visible"):
        resolve_degree(8, spec, "bfloat16", [80 * GIB] * 4)
    with pytest.raises(ConfigError, match="tensor_parallel = 3 does not divide its 64 attention"):
        resolve_degree(3, spec, "bfloat16", H100)

"""oneDNN-packed linears: F.linear's product for every row count, swapped in at load, and
refused (the model left on F.linear) where oneDNN cannot run them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mooncake.model.cpugemm import (
    MIN_ROWS,
    PREFILL_SHAPE_ENTRIES,
    SHAPE_CACHE_VARS,
    PackedLinear,
    limit_shape_caches,
    pack_linears,
)
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.weights import create_model
from tests.model.conftest import BLOCK, prompt

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MIN_ROWS - 1, MIN_ROWS, 37])
def test_a_packed_linear_gives_f_linear_s_product(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        x3 = torch.randn(2, rows, 96)  # leading dims are kept
        torch.testing.assert_close(packed(x3), linear(x3), rtol=1e-5, atol=1e-5)
        strided = torch.randn(rows, 192)[:, ::2]  # a non-contiguous input
        torch.testing.assert_close(packed(strided), linear(strided), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight)
    assert not any(p is linear.weight for p in packed.parameters())


@needs_onednn
def test_the_model_s_linears_are_packed_and_its_logits_unchanged(tiny_info):
    """Every linear of a CPU model is packed by default; prefill logits and KV match the
    F.linear model's."""
    packed = create_model(tiny_info, "float32", "cpu")
    plain = create_model(tiny_info, "float32", "cpu", cpu_gemm="torch")
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert sum(type(m) is PackedLinear for m in packed.modules()) == 4 * len(packed.layers) + 1
    assert not any(type(m) is PackedLinear for m in plain.modules())
    ids = prompt(45)
    results = []
    for model in (packed, plain):
        cache = PagedKVCache.for_model(model, 16, BLOCK)
        out = PrefillRunner(model, cache, chunk_tokens=16).prefill(ids)
        results.append((out.logits, cache.gather(model.first_layer, out.block_ids, 45)))
    (lp, kvp), (lt, kvt) = results
    torch.testing.assert_close(lp, lt, rtol=1e-4, atol=1e-4)
    for a, b in zip(kvp, kvt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_dtype_onednn_cannot_take_stays_on_f_linear(caplog):
    model = nn.Sequential(nn.Linear(8, 8).to(torch.float16))
    with caplog.at_level(logging.INFO, logger="mooncake.model.cpugemm"):
        assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear
    assert "stay on torch's F.linear" in caplog.text and "float16" in caplog.text


def test_torch_keeps_f_linear_and_an_unknown_backend_is_named():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model, "torch") == 0 and type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="'mkl'.*allowed are onednn, torch"):
        pack_linears(model, "mkl")


@needs_onednn
def test_bench_engine_gemm_times_both_backends_on_the_same_weights():
    import json

    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs

    args = "bench engine --parts gemm --model dummy:tiny --block-tokens 16 --prefill-lens 64"
    args += " --decode-batches 1,3 --decode-context 20 --decode-steps 3 --repeat 2 --json"
    load_verbs()
    result = CliRunner().invoke(app, args.split())
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["gemm"]
    assert report["packed"] is True
    assert set(report) == {"packed", "prefill 64", "decode step, batch 1", "decode step, batch 3"}
    for name in ("prefill 64", "decode step, batch 1", "decode step, batch 3"):
        r = report[name]
        assert r["speedup"] == r["torch_s"] / r["onednn_s"] and r["onednn_s"] > 0


SHAPES_PROBE = """
import sys
from mooncake.model.cpugemm import PackedLinear, limit_shape_caches
limit_shape_caches(int(sys.argv[1]))
import torch
from torch import nn

def anon_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
shapes = ((256, 768), (256, 1024), (512, 256))  # dummy:tiny's (in, out)
linears = [PackedLinear(nn.Linear(i, o, bias=False)) for i, o in shapes]
with torch.no_grad():
    for rows in range(1, 301):  # a prefill chunk's row count is any of 1..chunk_tokens
        if rows == 41:
            start = anon_bytes()
        for linear in linears:
            linear(torch.randn(rows, linear.in_features))
print(anon_bytes() - start)
"""


@pytest.mark.cluster
@needs_onednn
def test_a_prefill_node_s_shape_caches_stay_bounded_over_many_row_counts():
    """260 new row counts (780 product shapes) add ~460 MiB to oneDNN's and ideep's caches
    at their default bound of 1,024 each; bounded to 8 they add next to nothing (the limit
    checked with generous slack, in a fresh process: each cache reads its bound once)."""
    env = {k: v for k, v in os.environ.items() if k not in SHAPE_CACHE_VARS}
    out = subprocess.run(
        [sys.executable, "-c", SHAPES_PROBE, "8"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert int(out.stdout) < 64 << 20, out.stdout


def test_the_environment_s_shape_cache_bounds_win(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "2048")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert limit_shape_caches(PREFILL_SHAPE_ENTRIES) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(PREFILL_SHAPE_ENTRIES),
        "LRU_CACHE_CAPACITY": "2048",
    }

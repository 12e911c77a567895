"""The model's attention seam: the Triton backend (in Triton's interpreter without a GPU)
serves the same steps as the torch reference, through the runners, with scattered
blocks, prefill chunks after a prefix and padded decode batches; the decode step of a
CUDA graph compiles without a graph break; backends that cannot run are refused."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="the engine tests need torch")
import torch  # noqa: E402

if not torch.cuda.is_available():  # NOTE: before triton's import, which reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton backend tests need triton")

from mooncake.errors import ConfigError  # noqa: E402
from mooncake.model.attention.backend import select_backend  # noqa: E402
from mooncake.model.cudagraph import bucket_for, decode_fn, graph_buckets  # noqa: E402
from mooncake.model.decode import DecodeRunner  # noqa: E402
from mooncake.model.info import load_model_info  # noqa: E402
from mooncake.model.kvcache import PagedKVCache  # noqa: E402
from mooncake.model.params import SamplingParams  # noqa: E402
from mooncake.model.prefill import PrefillRunner  # noqa: E402
from mooncake.model.sequence import Sequence  # noqa: E402
from mooncake.model.step import Layout, StepBuilder  # noqa: E402
from mooncake.model.weights import create_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BT = 16


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    info = load_model_info("dummy:tiny")
    return {
        name: create_model(info, "float32", DEVICE, cpu_gemm="torch", attention_backend=name)
        for name in ("torch", "triton")
    }


def _scattered_cache(model: torch.nn.Module, num_blocks: int) -> PagedKVCache:
    """A cache whose free blocks are every other one: no sequence gets consecutive ids."""
    cache = PagedKVCache.for_model(model, num_blocks, BT)  # type: ignore[arg-type]
    held = cache.allocator.allocate(num_blocks)
    assert held is not None
    cache.free(held[::2])
    return cache


def test_decode_tokens_and_logits_match_reference(models: dict) -> None:
    """Six requests of different lengths decoded greedily in one batch: the same tokens,
    and the logits of every step within 1e-4 (fp32)."""
    outs, logits = {}, {}
    for name, model in models.items():
        runner = DecodeRunner(model, _scattered_cache(model, 64), max_batch=8, chunk_tokens=24)
        for i in range(6):
            prompt = [(5 * i + 3 * j) % 512 for j in range(9 + 13 * i)]
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            runner.add(Sequence(i, prompt, params))
        seen = []
        run = runner._run

        def spy(run=run, seen=seen):  # type: ignore[no-untyped-def]
            out = run()
            seen.append(out.clone())
            return out

        runner._run = spy  # type: ignore[method-assign]
        events = runner.run_until_done()
        outs[name] = {k: [e.token_id for e in v] for k, v in events.items()}
        logits[name] = seen
    assert outs["torch"] == outs["triton"]
    for a, b in zip(logits["torch"], logits["triton"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_prefill_chunks_after_prefix_match_reference(models: dict) -> None:
    """A 70-token prompt in chunks of 16 (each after a prefix, the last one partial):
    the last token's logits agree."""
    prompt = [(11 * j + 1) % 512 for j in range(70)]
    got = {}
    for name, model in models.items():
        runner = PrefillRunner(model, _scattered_cache(model, 24), chunk_tokens=16)
        result = runner.prefill(prompt)
        assert result.logits is not None
        got[name] = result.logits
    torch.testing.assert_close(got["torch"], got["triton"], atol=1e-4, rtol=1e-4)


def test_padded_bucket_step_equals_eager_and_compiles_whole(models: dict) -> None:
    """The function a CUDA graph captures (a bucket of 4 with 2 real rows, block tables
    as wide as the longest context) equals the eager step on the real rows, leaves the
    cache outside the real slots untouched, and compiles with fullgraph=True."""
    model = models["triton"]
    cache = PagedKVCache.for_model(model, 32, BT)
    for t in cache.k + cache.v:
        t.normal_()
    steps = StepBuilder(model, BT)
    tables, lens, tokens = [[3, 5, 7], [1, 2]], [40, 20], [5, 9]
    width = 8
    model.rope_tables(width * BT)
    with torch.inference_mode():
        eager = model(steps.build(tables, lens, [1, 1], tokens), cache.layer)
        before = [t.clone() for t in cache.k]
        layout = steps.upload(tables, lens, [1, 1], tokens, pad_to=4, width=width)
        forward = decode_fn(model, cache, steps, Layout(layout.flat, 4, 4, width, 1, width * BT))
        padded = forward()
        compiled = torch.compile(forward, fullgraph=True, backend="eager")()
    torch.testing.assert_close(padded[:2], eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled, padded)
    written = {(7, 39 % BT), (2, 19 % BT)}  # each real sequence's new token
    for old, new in zip(before, cache.k, strict=True):
        for block in range(32):
            for pos in range(BT):
                if (block, pos) not in written:
                    assert torch.equal(old[block, pos], new[block, pos]), (block, pos)


def test_graph_buckets() -> None:
    assert graph_buckets(128) == [1, 2, 4, 8, *range(16, 129, 16)]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(3) == [1, 2, 3]
    assert bucket_for(9, graph_buckets(128)) == 16
    assert bucket_for(129, graph_buckets(128)) is None


def test_backends_that_cannot_run_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ConfigError, match="choose one of auto, torch, triton, flash"):
        select_backend("xformers", cpu, f32, 4, 2, 64, 16)
    with pytest.raises(ConfigError, match="'flash' cannot run here: it needs a CUDA GPU"):
        select_backend("flash", cpu, f32, 4, 2, 64, 16)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="'triton' cannot run here: it needs a CUDA GPU"):
        select_backend("triton", cpu, f32, 4, 2, 64, 16)
    assert select_backend("auto", cpu, f32, 4, 2, 64, 16).name == "torch"


def test_cuda_graphs_refused_without_a_gpu(models: dict) -> None:
    model = models["torch"]
    with pytest.raises(ConfigError, match="model.cuda_graphs needs a GPU"):
        DecodeRunner(model, PagedKVCache.for_model(model, 8, BT), cuda_graphs=True)

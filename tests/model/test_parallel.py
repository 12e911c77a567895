"""Tensor parallelism over gloo on the CPU: a model cut over 2 and 4 ranks (follower
processes) computes the logits of the whole model (fp32, 1e-5) through the decode runner,
prefill and decode alike, with KV heads split (2 ranks) and replicated (4 ranks)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch", reason="the engine tests need torch")
import torch  # noqa: E402

from mooncake.errors import ConfigError  # noqa: E402
from mooncake.model.decode import DecodeRunner  # noqa: E402
from mooncake.model.info import load_model_info  # noqa: E402
from mooncake.model.kvcache import PagedKVCache  # noqa: E402
from mooncake.model.parallel import TPGroup, VocabParallelHead, check_shardable  # noqa: E402
from mooncake.model.params import SamplingParams  # noqa: E402
from mooncake.model.sequence import Sequence  # noqa: E402
from mooncake.model.tprun import TensorParallel  # noqa: E402
from mooncake.model.weights import create_model  # noqa: E402
from tests.api.served import serve_process  # noqa: E402

BT, BLOCKS = 16, 48
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 512 for j in range(n)] for i, n in enumerate((5, 23, 40))]


def decode_tp(
    tp: int, path: str = "dummy:tiny", vocab: int = 512
) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Greedy tokens and each step's logits of PROMPTS (ids mod `vocab`) over `tp` ranks:
    rank 0 here, loaded as its slice (`create_model(..., tp=)`), the others in follower
    processes loading theirs."""
    info = load_model_info(path)
    group = None
    if tp > 1:
        model = create_model(info, "float32", "cpu", cpu_gemm="torch", tp=TPGroup(0, tp))
        group = TensorParallel.start(
            model, tp, model_path=path, dtype="float32", num_blocks=BLOCKS, block_tokens=BT
        )
        assert isinstance(model.lm_head, VocabParallelHead)
    else:
        model = create_model(info, "float32", "cpu", cpu_gemm="torch")
    try:
        cache = PagedKVCache.for_model(model, BLOCKS, BT)
        runner = DecodeRunner(model, cache, max_batch=4, chunk_tokens=24)
        seen: list[torch.Tensor] = []
        run = runner._run

        def spy():  # type: ignore[no-untyped-def]
            out = run()
            seen.append(out.clone())
            return out

        runner._run = spy  # type: ignore[method-assign]
        for i, p in enumerate(PROMPTS):
            runner.add(Sequence(i, [t % vocab for t in p], GREEDY))
        events = runner.run_until_done()
        return {k: [e.token_id for e in v] for k, v in events.items()}, seen
    finally:
        if group is not None:
            group.stop()


def assert_same_decode(tp: int, path: str = "dummy:tiny", vocab: int = 512) -> None:
    """`tp` ranks give one rank's greedy tokens and logits (fp32, 1e-5)."""
    want_tokens, want_logits = decode_tp(1, path, vocab)
    got_tokens, got_logits = decode_tp(tp, path, vocab)
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_rank(tp: int) -> None:
    assert_same_decode(tp)


def test_what_does_not_split_is_refused() -> None:
    model = create_model(load_model_info("dummy:tiny"), "float32", "meta")
    check_shardable(model, 4)
    with pytest.raises(ConfigError, match="tensor_parallel = 3 does not divide its 4 attention"):
        check_shardable(model, 3)


def _serve_tokens(tmp_path: Path, tp: int) -> list[int]:
    """Greedy tokens of `mooncake serve --model dummy:tiny --set model.tensor_parallel=N`."""
    workdir = tmp_path / f"tp{tp}"
    workdir.mkdir()
    args = ["--model", "dummy:tiny", "--kv-cache", "16MiB", "--set", f"model.tensor_parallel={tp}"]
    with serve_process(workdir, *args) as url:
        body = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        body["return_token_ids"] = True
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


@pytest.mark.cluster
def test_serve_splits_the_model_over_two_ranks(tmp_path: Path) -> None:
    assert _serve_tokens(tmp_path, 2) == _serve_tokens(tmp_path, 1)

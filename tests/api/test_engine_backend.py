"""EngineBackend: the engine on its own thread behind asyncio gives exactly the engine's
tokens, aborts on close, and refuses bad requests before the first output."""

from __future__ import annotations

import asyncio
import time

import pytest

from mooncake.api.backend import GenerateRequest, Output
from mooncake.api.engine_backend import EngineBackend
from mooncake.errors import ApiError
from mooncake.model.params import SamplingParams
from tests.api.conftest import make_engine
from tests.api.reference import engine_alone

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * n) % 500 for i in range(n)] for n in (5, 40, 17)]


@pytest.fixture(scope="module")
def engine():
    backend = make_engine()
    yield backend
    backend.close()


async def _run(backend: EngineBackend, ids: list[int], params: SamplingParams) -> list[Output]:
    req = GenerateRequest(req_id=f"t-{len(ids)}", prompt_ids=ids, params=params)
    return [out async for out in backend.generate(req)]


def _wait_idle(backend: EngineBackend, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while backend.runner.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not backend.runner.has_work, "the runner still has requests"


def test_concurrent_greedy_requests_get_exactly_the_engine_alone_tokens(engine):
    async def main() -> list[list[Output]]:
        return await asyncio.gather(*[_run(engine, p, GREEDY) for p in PROMPTS])

    for prompt, outs in zip(PROMPTS, asyncio.run(main()), strict=True):
        ids, text = engine_alone(prompt, GREEDY)
        assert [o.token_id for o in outs] == ids
        assert "".join(o.text for o in outs) == text
        assert outs[-1].finish_reason == "length"
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)


def test_closing_the_iterator_aborts_the_request_and_frees_its_blocks(engine):
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def main() -> int:
        it = engine.generate(GenerateRequest(req_id="t", prompt_ids=PROMPTS[1], params=params))
        got = [await it.__anext__() for _ in range(3)]
        await it.aclose()
        return len(got)

    assert asyncio.run(main()) == 3
    _wait_idle(engine)
    engine.prefix_cache.check_integrity()  # every block free or cached for reuse, none held
    assert engine.prefix_cache.num_free == engine.cache.num_blocks


@pytest.mark.parametrize(
    ("ids", "max_tokens", "message"),
    [
        ([1, 2, 600], 4, "token id 600 is outside the model's vocabulary of 512"),
        ([1, 2, -1], 4, "token id -1 is outside"),
        ([1] * 2000, 100, "exceeds max_model_len (2048)"),
    ],
)
def test_bad_requests_raise_api_error_before_any_output(engine, ids, max_tokens, message):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    with pytest.raises(ApiError, match=message.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(_run(engine, ids, params))
    assert not engine.runner.has_work


def test_max_model_len_is_cut_to_what_the_kv_cache_holds(engine):
    assert engine.max_model_len == engine.cache.num_blocks * 16 == 2048
    assert engine.model_name == "dummy:tiny"
    assert asyncio.run(engine.health())["status"] == "ok"


def test_a_repeated_prefix_is_reused_with_the_same_greedy_tokens():
    """Prefix caching: the second request reports its reused prompt tokens on its first
    output and gets exactly the tokens of the first (and of the engine alone)."""
    backend = make_engine()
    try:
        prompt = [(11 * i) % 500 for i in range(70)]  # 4 full blocks of 16, then 6 tokens
        first = asyncio.run(_run(backend, prompt, GREEDY))
        again = asyncio.run(_run(backend, prompt, GREEDY))
        longer = asyncio.run(_run(backend, [*prompt, 5, 6, 7], GREEDY))
    finally:
        backend.close()
    ids, _ = engine_alone(prompt, GREEDY)
    assert [o.token_id for o in first] == [o.token_id for o in again] == ids
    assert [o.token_id for o in longer] == engine_alone([*prompt, 5, 6, 7], GREEDY)[0]
    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == 64
    assert longer[0].num_cached_tokens == 64
    assert [o.num_cached_tokens for o in again[1:]] == [0] * (len(again) - 1)

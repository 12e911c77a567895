"""What the engine alone produces: a DecodeRunner with no API, no thread, no asyncio."""

from __future__ import annotations

from functools import cache

from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.params import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.tokenizer import ByteTokenizer
from mooncake.model.weights import create_model
from tests.api.conftest import BLOCK, KV_BYTES, MODEL


@cache
def _model() -> Model:
    return create_model(load_model_info(MODEL), "float32", "cpu")


def engine_alone(prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """(output token ids, output text) of one request decoded by a bare DecodeRunner."""
    model = _model()
    cache = PagedKVCache.for_model(model, KV_BYTES // (BLOCK * 4096), BLOCK)
    runner = DecodeRunner(model, cache)
    tok = ByteTokenizer()
    runner.add(
        Sequence(
            0,
            prompt_ids,
            params,
            eos_token_ids=tok.eos_token_ids,
            tokenizer=tok,
            max_model_len=cache.num_blocks * BLOCK,
        )
    )
    events = runner.run_until_done()[0]
    return [e.token_id for e in events if e.token_id is not None], "".join(e.text for e in events)

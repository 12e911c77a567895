"""Prompt synthesis: shared hash-id prefixes give identical token prefixes, exact lengths,
scaling keeps the sharing, ids stay inside the vocabulary."""

from pathlib import Path

import pytest

from mooncake.errors import ConfigError
from mooncake.replay.prompts import WORDS, PromptConfig, ids_to_text
from mooncake.replay.runner import ReplayConfig, request_body
from mooncake.sim.trace import TraceRecord, load_trace

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"


def _rec(hash_ids: list[int], input_length: int, output_length: int = 100) -> TraceRecord:
    return TraceRecord(
        timestamp=0, input_length=input_length, output_length=output_length, hash_ids=hash_ids
    )


def _shared_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.03, 1 / 512])
def test_shared_hash_ids_share_exactly_their_blocks_of_tokens(scale):
    cfg = PromptConfig(scale=scale, vocab_size=32000)
    b = cfg.block_tokens
    a = cfg.prompt_ids(_rec([0, 1, 2, 3], 4 * 512))
    same_two = cfg.prompt_ids(_rec([0, 1, 7, 8], 4 * 512))
    other_first = cfg.prompt_ids(_rec([9, 1, 2, 3], 4 * 512))
    assert a[: 2 * b] == same_two[: 2 * b]
    if b >= 8:  # a block of a few random ids could collide by chance; 8 cannot in practice
        assert a[2 * b : 3 * b] != same_two[2 * b : 3 * b]
        assert a[:b] != other_first[:b]
    # The same request twice is the same prompt (deterministic across calls).
    assert cfg.prompt_ids(_rec([0, 1, 2, 3], 4 * 512)) == a


def test_lengths_are_exact_and_the_last_block_is_partial():
    full = PromptConfig(scale=1.0)
    assert full.block_tokens == 512
    assert len(full.prompt_ids(_rec([0, 1, 2], 1025))) == 1025
    assert len(full.prompt_ids(_rec([0], 1))) == 1
    small = PromptConfig(scale=0.0625)
    assert small.block_tokens == 32
    # 12,000 tokens = 23 full blocks + 224 -> 23 * 32 + 224 / 16 = 750 tokens.
    assert small.input_len(_rec(list(range(24)), 12000)) == 750
    assert len(small.prompt_ids(_rec(list(range(24)), 12000))) == 750
    # A last block of 1 token stays a (rounded-up) partial block, never an empty one.
    assert small.input_len(_rec([0, 1], 513)) == 33


def test_every_fixture_request_scales_into_its_blocks():
    cfg = PromptConfig(scale=0.03, vocab_size=512, first_id=3)
    b = cfg.block_tokens
    assert b == 15
    for rec in load_trace(FIXTURE, limit=300):
        n = len(rec.hash_ids)
        ids = cfg.prompt_ids(rec)
        assert (n - 1) * b < len(ids) <= n * b
        assert min(ids) >= 3 and max(ids) < 512


def test_output_lengths_scale_round_and_cap():
    rec = _rec([0], 10, output_length=343)
    assert PromptConfig(output_scale=1.0).output_len(rec) == 343
    assert PromptConfig(output_scale=0.03).output_len(rec) == 10
    assert PromptConfig(output_scale=0.001).output_len(rec) == 1
    assert PromptConfig(output_scale=1.0, max_tokens=4).output_len(rec) == 4


def test_request_body_carries_ids_or_words_and_ignore_eos():
    rec = _rec([5, 6], 600, output_length=50)
    prompts = PromptConfig(scale=0.1, output_scale=0.1, vocab_size=1000)
    body = request_body(rec, prompts, ReplayConfig(url="http://x"), "m")
    assert body["prompt"] == prompts.prompt_ids(rec) and len(body["prompt"]) == 51 + 9
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    text_cfg = ReplayConfig(url="http://x", prompt_format="text", ignore_eos=False)
    text = request_body(rec, prompts, text_cfg, "m")
    assert "ignore_eos" not in text
    assert text["prompt"] == ids_to_text(body["prompt"])
    assert text["prompt"].split() == [WORDS[i % len(WORDS)] for i in body["prompt"]]


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--scale 0.0005 makes blocks of 0 tokens"):
        PromptConfig(scale=0.0005).validate()
    with pytest.raises(ConfigError, match="--first-id"):
        PromptConfig(vocab_size=100, first_id=100).validate()
    with pytest.raises(ConfigError, match="--speed must be > 0"):
        ReplayConfig(url="http://x", speed=0).validate()


def test_fitting_halves_the_scale_until_every_request_fits_the_context():
    """The bundled trace's first 20 requests on `up --local` (dummy:tiny's 8192 tokens):
    10 do not fit at scale 1, all at 0.0625 (32-token blocks, the cluster's own)."""
    records = load_trace(FIXTURE, limit=20)
    one = PromptConfig(fit_context=True)
    assert sum(one.input_len(r) + one.output_len(r) > 8192 for r in records) == 10
    fitted = one.fitted(records, 8192)
    assert (fitted.scale, fitted.output_scale, fitted.block_tokens) == (0.0625, 0.0625, 32)
    assert fitted.fits(records, 8192) and not PromptConfig(scale=0.125).fits(records, 8192)
    assert one.fitted(records[:1], 8192) == one  # already fits: unchanged
    # an output scale of its own is kept; at one-token blocks it stops, fitting or not
    assert PromptConfig(output_scale=0.5).fitted(records, 8192).output_scale == 0.5
    tiny = one.fitted(records, 10)
    assert tiny.block_tokens == 1 and tiny.scale == 1 / 512 and not tiny.fits(records, 10)

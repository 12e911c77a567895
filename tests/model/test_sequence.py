"""A sequence's streamed text: stop strings cut it where the first one completed (none of
a stop string is ever streamed), and the work per token is bounded: only the tokens since
the last text streamed are decoded, and stop strings are limited in number and size."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest

from mooncake.model.params import (
    MAX_STOP_BYTES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    InvalidSamplingParams,
    SamplingParams,
)
from mooncake.model.sequence import Sequence
from mooncake.model.stopmatch import StopMatcher
from mooncake.model.tokenizer import ByteTokenizer, create_tokenizer
from tests.model.test_tokenizer import _bpe_dir


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the token ids it is asked to decode."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_lens: list[int] = []

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True) -> str:
        self.decode_lens.append(len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


def _stream(text: str, stops: tuple[str, ...], *, eos: bool = False) -> tuple[list[str], str]:
    """(the texts streamed per token, the finish reason) of an output spelling `text`."""
    ids = [*text.encode(), *([ByteTokenizer.EOS] if eos else [])]
    params = SamplingParams(stop=stops, max_tokens=len(ids))
    seq = Sequence(1, [1], params, eos_token_ids=[ByteTokenizer.EOS], tokenizer=ByteTokenizer())
    texts = []
    for t in ids:
        event = seq.append(t)
        texts.append(event.text)
        if event.finish_reason is not None:
            return texts, event.finish_reason
    raise AssertionError("the sequence never finished")


def _expected(text: str, stops: tuple[str, ...]) -> tuple[str, str]:
    """OpenAI's semantics as a stream meets them: at the first token after which the text
    holds a stop string, the output ends before the earliest one it holds."""
    for k in range(1, len(text) + 1):
        starts = [i for s in stops if (i := text[:k].find(s)) >= 0]
        if starts:
            return text[: min(starts)], "stop"
    return text, ""


def test_stop_strings_cut_where_the_first_completes_and_none_of_one_streams():
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "é"]
    for _ in range(3000):
        stops = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(3)})
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 12)))
        eos = rng.random() < 0.3
        texts, reason = _stream(text, stops, eos=eos)
        want, want_reason = _expected(text, stops)
        assert "".join(texts) == want, (stops, text, texts)
        assert reason == (want_reason or ("stop" if eos else "length")), (stops, text, reason)
        streamed = ""
        for chunk in texts:  # what was streamed never starts a stop string found later
            streamed += chunk
            assert want.startswith(streamed), (stops, text, texts)


def test_a_stop_string_that_starts_in_held_text_and_ends_in_a_later_token():
    texts, reason = _stream("xx<EN<END>", ("<END>",))
    assert (texts, reason) == (["x", "x", "", "", "", "<EN", "", "", "", ""], "stop")
    # of two found in the same token, the one that starts first ends the text
    matcher = StopMatcher(("bcd", "abcde"))
    assert matcher.feed("xxab") is None and matcher.num_held == 2
    assert matcher.feed("cdeX") == 2  # "abcde" (from 2) though "bcd" ended first


def test_each_token_decodes_a_bounded_window_however_long_the_output():
    """The old decoder decoded the whole output for every token (work growing with it)."""
    tok = CountingTokenizer()
    stops = tuple(f"stop{i}" for i in range(MAX_STOPS))
    seq = Sequence(1, [1], SamplingParams(stop=stops, max_tokens=2000), tokenizer=tok)
    out = []
    for t in (b"hello world " * 200)[:1999]:
        out.append(seq.append(t).text)
    assert "".join(out) == (b"hello world " * 200)[:1999].decode()
    assert max(tok.decode_lens) <= 2, tok.decode_lens[-10:]  # tokens since the last text
    assert seq.stop_matcher is not None and seq.stop_matcher.num_chars == 1999  # read once


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (
            ("x",) * (MAX_STOPS + 1),
            f"stop must be at most {MAX_STOPS} strings, got {MAX_STOPS + 1}",
        ),
        (
            ("ok", "y" * (MAX_STOP_CHARS + 1)),
            f"1 to {MAX_STOP_CHARS} characters, got {MAX_STOP_CHARS + 1} characters in stop[1]",
        ),
        (("", "a"), "got 0 characters in stop[0]"),
        (
            ("é" * MAX_STOP_CHARS,) * 9,
            f"at most {MAX_STOP_BYTES} bytes of UTF-8 together, got {2 * MAX_STOP_CHARS * 9}",
        ),
    ],
)
def test_stop_strings_are_bounded_in_number_and_size(stop: tuple[str, ...], message: str):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(stop=stop)
    assert e.value.param == "stop" and message in str(e.value), str(e.value)
    SamplingParams(stop=("z" * MAX_STOP_CHARS,) * (MAX_STOP_BYTES // MAX_STOP_CHARS))


@pytest.mark.parametrize("pre_tokenizer", ["bytelevel", "metaspace"])
def test_the_text_streamed_token_by_token_is_the_whole_outputs_decoding(tmp_path, pre_tokenizer):
    """With a real BPE tokenizer (leading spaces, characters split across tokens). Any ids
    for the byte-level one; HF's byte fallback turns a byte token next to an invalid one
    into U+FFFD, which no incremental decoder can know before the next token."""
    hf = create_tokenizer(str(_bpe_dir(tmp_path, pre_tokenizer)))
    rng = random.Random(0)
    outputs = [hf.encode(t, False) for t in ("hello wörld, 你好世界 😀 the fox " * 3, "😀你 ßæ ")]
    if pre_tokenizer == "bytelevel":
        outputs += [[rng.randrange(2, 300) for _ in range(40)] for _ in range(50)]
    for ids in outputs:
        seq = Sequence(1, [0], SamplingParams(max_tokens=len(ids)), tokenizer=hf)
        assert "".join(seq.append(t).text for t in ids) == hf.decode(ids), ids

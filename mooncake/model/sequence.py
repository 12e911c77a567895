"""One request's decode state: its tokens, KV blocks, stop conditions and streamed text.

Invariant of a running sequence: the KV of token_ids[:-1] is in the cache
(`num_cached_tokens == len(token_ids) - 1`); the next step feeds token_ids[-1].

Text is decoded incrementally: a token's text is streamed once it is certain, i.e. it
does not end in an incomplete UTF-8 character and cannot be the start of a stop string.
A stop string ends the output before it (OpenAI semantics; the earliest one to start, of
those found); a stop token adds no text. Per token, only the tokens since the last text
streamed are decoded and only the new text is searched for stop strings
(`stopmatch.StopMatcher`), so the work does not grow with the output.

A guided request (`params.guided`) carries its grammar's matcher (`grammar`, set by the
runner that admits it; model/grammar.py), advanced by every token appended. Its output ends
with "stop" as soon as the grammar is complete, whether or not an EOS token came (the
grammar allows EOS only where it may end). With it the other limits stay as they are: a
stop string or a stop token the grammar allows still cuts the text (the JSON may then be
incomplete, as after "length": max_tokens and max_model_len still end it), `ignore_eos`
only keeps EOS from ending the output where the grammar is not complete yet (the grammar's
end ends it), and `min_tokens` cannot hold the output past the grammar's end either (a
complete grammar allows no token to go on with). A token the grammar refuses (only a
broken model row can bring one) ends the output with "abort".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mooncake.model.params import SamplingParams
from mooncake.model.stopmatch import StopMatcher
from mooncake.model.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from mooncake.model.grammar import GuidedMatcher

log = logging.getLogger(__name__)
FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenEvent:
    """What a decode step produced for one request (streamed to the client as it comes)."""

    seq_id: int
    token_id: int | None  # None for an event that only ends the request
    text: str  # new output text made certain by this token (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None  # of this choice
    index: int = 0  # the choice (0 .. params.n - 1)
    more_choices: bool = False  # with finish_reason: other choices of the request go on


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits


class Sequence:
    """A request inside the engine. Mutated only by the runner that owns it."""

    def __init__(
        self,
        seq_id: int,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        eos_token_ids: Seq[int] = (),
        max_model_len: int = 0,
        tokenizer: BaseTokenizer | None = None,
        output_ids: Seq[int] = (),
        block_ids: list[int] | None = None,
        num_cached_tokens: int = 0,
        num_resumed: int = 0,
        index: int = 0,
    ):
        """`num_resumed`: the last this many of `prompt_ids` are output a request produced
        before it was placed again (its grammar replays them). `index`: which of the
        request's `params.n` choices this is (`fork` makes the others); it shifts the seed,
        so each choice draws its own tokens reproducibly."""
        assert prompt_ids, "a prompt needs at least one token"
        assert 0 <= index < params.n, (index, params.n)
        self.seq_id = seq_id
        self.index = index
        self.is_forked = index > 0 or params.n == 1  # its other choices exist (or none do)
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids = [*prompt_ids, *output_ids]
        self.block_ids = block_ids or []
        self.num_cached_tokens = num_cached_tokens  # tokens whose KV is in block_ids
        self.num_reused_tokens = 0  # prompt tokens whose KV a prefix cache gave at admission
        # what keys the sampler's noise, with the position: the request's seed (plus the
        # choice's index, as a signed 64-bit value), else random
        seed = params.seed
        self.seed = _random_seed() if seed is None else (seed + index + 2**63) % 2**64 - 2**63
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # 0 = no limit
        self.eos_token_ids = tuple(eos_token_ids)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.stop_token_ids = frozenset(stops)
        self._sorted_stops = tuple(sorted(stops))
        self.finish_reason: FinishReason | None = None
        # incremental decoding: output ids [prefix_offset, read_offset) gave the text
        # before the last one streamed; those from read_offset on are not decoded yet
        self.prefix_offset = self.read_offset = 0
        self.held_text = ""  # decoded, not streamed: it may begin a stop string
        self.stop_matcher = StopMatcher(params.stop) if params.stop else None
        self.num_preemptions = 0
        assert 0 <= num_resumed <= self.prompt_len, (num_resumed, self.prompt_len)
        self.num_resumed = num_resumed
        self.grammar: GuidedMatcher | None = None  # set at admission for a guided request

    @property
    def guided_ids(self) -> list[int]:
        """The tokens its grammar has seen: the resumed output, then this run's."""
        return self.token_ids[self.prompt_len - self.num_resumed :]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def min_tokens_stops(self) -> tuple[int, ...]:
        """The stop token ids the sampler masks for the next token: all of them while the
        output is shorter than `min_tokens`, none after (vLLM's MinTokensLogitsProcessor)."""
        if len(self.token_ids) - self.prompt_len < self.params.min_tokens:
            return self._sorted_stops
        return ()

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(
        self,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> TokenEvent:
        """Add a sampled token; decide whether the request ends; return what to stream."""
        self.token_ids.append(token_id)
        num_out = len(self.token_ids) - self.prompt_len
        grammar = self.grammar
        # NOTE: before min_tokens output tokens no stop token ends the output (vLLM's
        # check_stop; the sampler masks them until then); a complete grammar ends it
        is_stop = token_id in self.stop_token_ids and num_out >= self.params.min_tokens
        if grammar is not None and not grammar.accept(token_id):
            log.warning("req %d: token %d breaks its %s", self.seq_id, token_id, grammar.kind)
            self.finish_reason = "abort"
        elif is_stop or (grammar is not None and grammar.is_done):
            self.finish_reason = "stop"
        elif num_out >= self.params.max_tokens or (
            self.max_model_len and len(self.token_ids) >= self.max_model_len
        ):
            self.finish_reason = "length"
        text = self._new_text(is_stop)
        return TokenEvent(
            self.seq_id, token_id, text, logprob, top_logprobs, self.finish_reason, self.index
        )

    def _new_text(self, is_stop: bool) -> str:
        if self.tokenizer is None:
            return ""
        is_done = self.finish_reason is not None
        # NOTE: a stop token adds no text
        num_out = len(self.token_ids) - self.prompt_len
        num_ids = num_out - is_stop
        chunk = self._decode(num_ids, is_done)
        text = self.held_text + chunk  # not streamed yet, in the order decoded
        self.held_text = ""
        if self.stop_matcher is None:
            return text
        start = self.stop_matcher.feed(chunk)
        # NOTE: stop strings count once the output is past min_tokens tokens, as vLLM's
        # detokenizer checks them (`len(output_token_ids) > min_tokens`)
        if start is not None and num_out > self.params.min_tokens:
            # cut before the stop string
            self.finish_reason = "stop"
            cut = start - (self.stop_matcher.num_chars - len(text))
            assert 0 <= cut <= len(text), (start, self.stop_matcher.num_chars, len(text))
            return text[:cut]
        if is_done:
            return text
        num_held = self.stop_matcher.num_held  # hold back what may grow into a stop string
        assert num_held <= len(text), (num_held, len(text))
        if num_held:
            text, self.held_text = text[:-num_held], text[-num_held:]
        return text

    def _decode(self, num_ids: int, is_done: bool) -> str:
        """The text the first `num_ids` output tokens add to what was decoded before
        (as vLLM decodes incrementally): "" while the last token ends in an incomplete
        UTF-8 character, unless the request `is_done`. Decodes only the tokens since the
        text before the last one returned, which give the new ones their context (a
        leading space)."""
        assert self.tokenizer is not None
        ids, base = self.token_ids, self.prompt_len
        window = ids[base + self.prefix_offset : base + num_ids]
        prefix = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset])
        full = self.tokenizer.decode(window)
        if not is_done and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, num_ids
        return full[len(prefix) :]

    def finish(self, reason: FinishReason) -> TokenEvent:
        """End the request from outside (abort, cache too small)."""
        self.finish_reason = reason
        return TokenEvent(self.seq_id, None, "", finish_reason=reason, index=self.index)

    def fork(self, index: int, block_ids: list[int], num_cached_tokens: int) -> Sequence:
        """Choice `index` of this request, before its first output token, reading the
        prompt's KV in `block_ids` (shared: the caller took a reference on each)."""
        assert not self.output_ids, "choices fork before the first output token"
        choice = Sequence(
            self.seq_id,
            self.token_ids,
            self.params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            block_ids=block_ids,
            num_cached_tokens=num_cached_tokens,
            num_resumed=self.num_resumed,
            index=index,
        )
        if self.grammar is not None:  # NOTE: in the state of the shared prompt
            choice.grammar = self.grammar.copy()
        return choice

"""One request's decode state: its tokens, KV blocks, stop conditions and streamed text.

Invariant of a running sequence: the KV of token_ids[:-1] is in the cache
(`num_cached_tokens == len(token_ids) - 1`); the next step feeds token_ids[-1].

Text is decoded incrementally: a token's text is streamed once it is certain, i.e. it
does not end in an incomplete UTF-8 character and cannot be the start of a stop string.
A stop string ends the output before it (OpenAI semantics); a stop token adds no text.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Literal

from mooncake.engine.params import SamplingParams
from mooncake.engine.sampler import make_generator
from mooncake.engine.tokenizer import BaseTokenizer

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenEvent:
    """What a decode step produced for one request (streamed to the client as it comes)."""

    seq_id: int
    token_id: int | None  # None for an event that only ends the request
    text: str  # new output text made certain by this token (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None


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
        generator: Any = None,
        output_ids: Seq[int] = (),
        block_ids: list[int] | None = None,
        num_cached_tokens: int = 0,
    ):
        assert prompt_ids, "a prompt needs at least one token"
        self.seq_id = seq_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids = [*prompt_ids, *output_ids]
        self.block_ids = block_ids or []
        self.num_cached_tokens = num_cached_tokens  # tokens whose KV is in block_ids
        self.num_reused_tokens = 0  # prompt tokens whose KV a prefix cache gave at admission
        if generator is None and not params.is_greedy:
            generator = make_generator(params.seed)
        self.generator = generator  # torch.Generator of a sampled request; None when greedy
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # 0 = no limit
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.stop_token_ids = frozenset(stops)
        self.finish_reason: FinishReason | None = None
        self.text = ""  # output text streamed so far
        self.num_preemptions = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

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
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
        elif num_out >= self.params.max_tokens or (
            self.max_model_len and len(self.token_ids) >= self.max_model_len
        ):
            self.finish_reason = "length"
        text = self._new_text(token_id)
        return TokenEvent(self.seq_id, token_id, text, logprob, top_logprobs, self.finish_reason)

    def _new_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        out = self.output_ids
        if token_id in self.stop_token_ids:
            out = out[:-1]
        full = self.tokenizer.decode(out)
        stops = self.params.stop
        if stops:
            horizon = max(0, len(self.text) - max(len(s) for s in stops))
            hits = [i for s in stops if (i := full.find(s, horizon)) >= 0]
            if hits:
                full = full[: min(hits)]
                self.finish_reason = "stop"
        if self.finish_reason is None:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for the rest
            for s in stops:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        full = full[:-k]
                        break
        if len(full) <= len(self.text):
            return ""
        new, self.text = full[len(self.text) :], full
        return new

    def finish(self, reason: FinishReason) -> TokenEvent:
        """End the request from outside (abort, cache too small)."""
        self.finish_reason = reason
        return TokenEvent(self.seq_id, None, "", finish_reason=reason)

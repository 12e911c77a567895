"""What the HTTP API serves from: a backend that turns a prompt into a stream of tokens.

The API layer (`mooncake.api.app`) owns HTTP: OpenAI request/response bodies, SSE, API
keys, error bodies. A backend owns everything behind it: tokenization rules, scheduling,
the engine. Two backends exist: the master's cluster backend (`roles/master`: Conductor,
prefill and decode nodes) and `EngineBackend` (`api/engine_backend.py`: one in-process
engine, used by `mooncake serve --coupled` and by tests).

Errors a backend raises while starting a request (before the first output):
- `Rejected`: admission refused it (HTTP 429 with Retry-After);
- `ApiError`: the request itself is bad (HTTP 400), e.g. a prompt longer than the model;
- any other `MooncakeError`: the cluster cannot serve it now (HTTP 503).
After the first output a failure ends the stream with `finish_reason="abort"` and `error`.

A request of `params.n` choices streams the outputs of all of them interleaved, each with
its `index`; a choice's finish says whether others go on (`more_choices`). The stream ends
at the finish of the last choice, or at an abort (which ends every choice).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

import msgspec

from mooncake.conductor.misses import MissCounts
from mooncake.errors import MooncakeError
from mooncake.model.params import SamplingParams
from mooncake.model.tokenizer import BaseTokenizer

if TYPE_CHECKING:
    from mooncake.model.grammar import GrammarEngine

FinishReason = Literal["stop", "length", "abort"]


class Rejected(MooncakeError):
    """Admission refused the request before any work was done (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # seconds the client should wait before retrying


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request, tokenized, as the API hands it to the backend."""

    req_id: str  # "cmpl-..." / "chatcmpl-...", unique per request
    prompt_ids: list[int]  # the prompt's token ids (chat template already applied)
    params: SamplingParams
    arrival_s: float = 0.0  # time.time() when the HTTP request arrived


class Output(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a request's output stream (a token, or only the end)."""

    token_id: int | None  # None when the event only ends the stream
    text: str  # new text made certain by this token (may be "")
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    finish_reason: FinishReason | None = None  # set on the last event only
    error: str = ""  # why the stream aborted (finish_reason == "abort")
    # NOTE: on one event, the first that knows them (the cluster: once its prefill node
    # reported, the last event at the latest): prompt tokens whose KV was reused, and the
    # blocks it could have reused by cause (None: the backend does not attribute)
    num_cached_tokens: int = 0
    kv_blocks: MissCounts | None = None
    index: int = 0  # the choice (0 .. params.n - 1)
    more_choices: bool = False  # with a finish_reason: other choices go on

    @property
    def ends_request(self) -> bool:
        """Whether this is the stream's last output."""
        return self.finish_reason == "abort" or (
            self.finish_reason is not None and not self.more_choices
        )


class BaseBackend(ABC):
    """A model server the API can send requests to."""

    model_name: str  # the id `/v1/models` lists and requests must name
    max_model_len: int  # prompt + output tokens at most
    vocab_size: int = 0  # token ids a prompt may use ([0, vocab_size)); 0 = not told
    tokenizer: BaseTokenizer
    grammar: GrammarEngine | None = None  # structured outputs' engine, made on first use
    _grammar_lock = threading.Lock()

    def grammar_engine(self) -> GrammarEngine:
        """The grammar engine of this backend's tokenizer and vocabulary, which compiles
        (and caches) requests' constraints before they start (blocking: call it off the
        event loop); ConfigError when it cannot be made (llguidance missing, a tokenizer it
        cannot read)."""
        from mooncake.model.grammar import create_grammar_engine

        with self._grammar_lock:
            if self.grammar is None:
                self.grammar = create_grammar_engine(self.tokenizer, self.vocab_size)
            return self.grammar

    @abstractmethod
    def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        """Start `req` and yield its outputs until one `ends_request`.

        Raises `Rejected`, `ApiError` or another `MooncakeError` before the first output
        when the request cannot start. Closing the iterator early aborts the request."""

    async def health(self) -> dict[str, object]:
        """What `/health` reports; raises MooncakeError when the backend cannot serve."""
        return {"status": "ok"}

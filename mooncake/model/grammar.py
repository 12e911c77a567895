"""Structured outputs: the grammar engine that holds a guided request's output to its
`Guided` constraint (params.py), torch-free, so the API process compiles what the decode
node will enforce.

    engine = create_grammar_engine(tokenizer, vocab_size)
    engine.compile(guided)                    # cached; GrammarError names what is wrong
    matcher = engine.matcher(guided, replay)  # one per sequence, `replay`: its output so far
    bits = engine.start_masks(rows, batch).result()  # (batch, num_words) int32 bitmask
    matcher.accept(token_id); matcher.is_done

The engine is llguidance (github.com/guidance-ai/llguidance, vLLM's `guidance` backend),
chosen over xgrammar (vLLM's and SGLang's default) for what a cluster node needs:
- torch-free: the master validates and compiles a request's constraint before admitting it,
  and the master never imports torch; xgrammar's package imports torch (and wants
  transformers, triton, pydantic and apache-tvm-ffi), ~1.7 s per process on our CPUs;
- one abi3 wheel of ~3 MB with no Python dependencies, which a GPU node without network
  takes with the project's own wheels;
- nothing precomputed per grammar: it builds the lexer lazily and computes each step's mask
  with an Earley parser over a token trie, so a schema compiles in about a millisecond
  (`mooncake bench grammar`) and its work is bounded by fuel limits (`LLParserLimits`);
- its `LLExecutor` fills a whole batch's masks in Rust threads without the GIL, so the
  masks are computed while the forward pass runs (`start_masks`).

Token tables come from our tokenizers: a `LibraryTokenizer` (HF `tokenizer.json`, GGUF)
hands llguidance its `tokenizers` JSON; `ByteTokenizer` lists each id's bytes (the ids past
the specials print as ASCII, as it decodes them). The table spans the model's vocabulary
(`vocab_size`, at least the tokenizer's): ids the tokenizer lacks are never allowed. EOS is
allowed only where the grammar may end; a matcher `is_done` when the grammar is complete
(the output ends there, with or without an EOS token).

JSON (json_object, json_schema) is written with ", " and ": " between items and no other
whitespace (llguidance's `whitespace_flexible` off, as vLLM's `disable_any_whitespace`): one
spelling per value, so that a model cannot spend its tokens on blank space.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from mooncake.errors import ApiError, ConfigError
from mooncake.model.params import Guided
from mooncake.model.tokenizer import BaseTokenizer, ByteTokenizer, LibraryTokenizer

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer is refused (its compile runs on)
MAX_CACHED = 256  # compiled grammars kept, least recently used dropped
MAX_ERROR_CHARS = 1000  # of llguidance's message in a GrammarError (it may quote the spec)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ApiError):
    """A constraint the engine cannot compile, or tokens its grammar does not allow;
    `kind` is the Guided's."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise ConfigError("structured outputs need `pip install llguidance`") from e
    return llguidance


def to_grammar(guided: Guided) -> str:
    """llguidance's grammar text of `guided` (not compiled yet); GrammarError when the spec
    is not what its kind needs."""
    llg, kind, spec = _llguidance(), guided.kind, guided.spec
    try:
        if kind == "json_object":
            return str(llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_OPTIONS))
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, dict | bool):
                raise GrammarError("the JSON schema must be an object", kind)
            return str(llg.LLMatcher.grammar_from_json_schema(spec, _JSON_OPTIONS))
        if kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(spec))
        if kind == "choice":
            choices = json.loads(spec)
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(c, str) and c for c in choices)
            ):
                raise GrammarError("the choices must be a list of non-empty strings", kind)
            return str(llg.grammar_from("choice", spec))
        return str(llg.grammar_from("grammar", spec))  # GBNF (llama.cpp's) or Lark
    except json.JSONDecodeError as e:
        raise GrammarError(f"not valid JSON: {e}", kind) from e
    except RecursionError as e:
        raise GrammarError("it nests too deeply", kind) from e
    except ValueError as e:
        raise GrammarError(str(e), kind) from e


class GuidedMatcher:
    """One sequence's place in its grammar; owned by the thread that runs the sequence."""

    def __init__(self, matcher: Any, kind: str):
        self._m, self.kind = matcher, kind

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar does not allow it (the
        matcher stays in error from then on)."""
        return bool(self._m.consume_token(token_id))

    def copy(self) -> GuidedMatcher:
        """An independent matcher in the same state (a forked sequence's)."""
        return GuidedMatcher(self._m.deep_copy(), self.kind)

    @property
    def is_done(self) -> bool:
        """The grammar is complete (or in error): no token but EOS may follow."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


class GrammarEngine:
    """Compiles constraints for one tokenizer (cached, bounded in time) and fills token
    masks. Thread-safe: the API's threads compile, a decode loop fills masks."""

    def __init__(
        self,
        tokenizer: Any,  # llguidance.LLTokenizer
        vocab_size: int,
        *,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_cached: int = MAX_CACHED,
        num_mask_threads: int = 1,
    ):
        llg = _llguidance()
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.num_words = (tokenizer.vocab_size + 31) // 32  # int32 words of one mask row
        self.compile_timeout_s, self.max_cached = compile_timeout_s, max_cached
        self.limits = llg.LLParserLimits()  # llguidance's fuel bounds (its defaults)
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._executor = llg.LLExecutor(num_mask_threads)

    def compile(self, guided: Guided) -> Any:
        """The compiled grammar of `guided` (a pristine llguidance matcher; copy it, never
        advance it). Raises GrammarError for a spec it cannot compile or one that takes
        longer than `compile_timeout_s`; remembers both answers."""
        key = (guided.kind, guided.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._compiler.submit(self._build, guided)
                self._cache[key] = future
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(self.compile_timeout_s)
        except FutureTimeout as e:
            raise GrammarError(
                f"the {guided.kind} took longer than {self.compile_timeout_s:g} s to compile; "
                "simplify it",
                guided.kind,
            ) from e

    def _build(self, guided: Guided) -> Any:
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer, to_grammar(guided), log_level=0, limits=self.limits)
        if matcher.is_error():
            why = matcher.get_error()
            why = why if len(why) <= MAX_ERROR_CHARS else why[:MAX_ERROR_CHARS] + "..."
            raise GrammarError(f"cannot compile the {guided.kind}: {why}", guided.kind)
        return matcher

    def matcher(self, guided: Guided, replay: Sequence[int] = ()) -> GuidedMatcher:
        """A fresh matcher of `guided`, advanced by `replay` (the output a resumed request
        produced before: its grammar state is rebuilt, not shipped); GrammarError when the
        grammar does not allow those tokens."""
        m = GuidedMatcher(self.compile(guided).deep_copy(), guided.kind)
        if replay and not m._m.consume_tokens(list(replay)):
            raise GrammarError(
                f"the output so far ({len(replay)} tokens) does not follow the {guided.kind}: "
                f"{m.error}",
                guided.kind,
            )
        return m

    def fill_masks(self, rows: Sequence[tuple[int, GuidedMatcher]], num_rows: int) -> np.ndarray:
        """(num_rows, num_words) int32: bit t of row r set when row r may take token t.
        `rows`: (row, matcher) of the constrained rows; the others allow every token."""
        bits = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        if rows:
            pairs = [(m._m, r) for r, m in rows]
            self._executor.unsafe_compute_mask_ptr(
                pairs, bits.ctypes.data, self.num_words * 4, num_rows
            )
        return bits

    def start_masks(
        self, rows: Sequence[tuple[int, GuidedMatcher]], num_rows: int
    ) -> Future[np.ndarray]:
        """`fill_masks` on the engine's mask thread (llguidance drops the GIL), so that it
        runs beside the forward pass; the caller must not advance these matchers until
        the future is done."""
        return self._masker.submit(self.fill_masks, list(rows), num_rows)

    def close(self) -> None:
        self._masker.shutdown(wait=False)
        self._compiler.shutdown(wait=False, cancel_futures=True)


def create_grammar_engine(tokenizer: BaseTokenizer, vocab_size: int, **kw: Any) -> GrammarEngine:
    """The engine for `tokenizer` over a model of `vocab_size` token ids (0: the
    tokenizer's own). ConfigError for a tokenizer it cannot read the tokens of."""
    llg = _llguidance()
    eos = list(tokenizer.eos_token_ids)
    try:
        if isinstance(tokenizer, ByteTokenizer):
            table = _ByteTable(max(vocab_size, ByteTokenizer.FIRST_EXTRA))
            lltok = llg.LLTokenizer(llg.TokenizerWrapper(table), eos_token=eos or None)
        elif isinstance(tokenizer, LibraryTokenizer):
            text = tokenizer.to_json()
            size = max(vocab_size, tokenizer.vocab_size)
            lltok = llg.LLTokenizer(text, n_vocab=size, eos_token=eos or None)
        else:
            raise ConfigError(f"structured outputs cannot read the tokens of {type(tokenizer)}")
    except (ValueError, RuntimeError) as e:  # what llguidance raises for a tokenizer
        raise ConfigError(f"structured outputs cannot read this tokenizer: {e}") from e
    return GrammarEngine(lltok, vocab_size or lltok.vocab_size, **kw)


def try_create_grammar_engine(tokenizer: BaseTokenizer, vocab_size: int) -> GrammarEngine | None:
    """`create_grammar_engine`, or None (the reason logged) where it cannot be made: a
    node serves the rest, and refuses guided requests saying so."""
    try:
        return create_grammar_engine(tokenizer, vocab_size)
    except ConfigError as e:
        log.warning("structured outputs are off: %s", e)
        return None


class _ByteTable:
    """`ByteTokenizer`'s ids as llguidance's `TokenizerWrapper` reads a tokenizer: each id's
    bytes (BOS and EOS special), and an encoder."""

    def __init__(self, vocab_size: int):
        b = ByteTokenizer
        extra = [bytes([32 + (t - b.FIRST_EXTRA) % 95]) for t in range(b.FIRST_EXTRA, vocab_size)]
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"] + extra
        self.bos_token_id, self.eos_token_id = b.BOS, b.EOS
        # NOTE: the extra ids repeat bytes that ids below 256 spell: as plain tokens they
        # would be a second spelling the mask leaves out (llguidance's token trie keeps
        # one id per byte string) and the matcher takes; as specials neither allows them
        self.special_token_ids = [b.BOS, b.EOS, *range(b.FIRST_EXTRA, vocab_size)]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

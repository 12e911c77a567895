"""A `tokenizers.Tokenizer` from a GGUF file's metadata, built as transformers builds it.

A GGUF file (llama.cpp's format) has no tokenizer.json: its vocabulary, merges, token types
and special token ids are metadata keys (`tokenizer.ggml.*`). `read_vocab` reads them with
`ggufread.GGUFFile` (memory-mapped, torch-free); `build_tokenizer` makes of them the tokenizer
that transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)` makes, so that a
prompt gets the same ids from either:

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE; the text is split by the regex that
  `tokenizer.ggml.pre` names (`PRE_TOKENIZER_SPLITS`).
- `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE over "▁"-spelled pieces with
  byte fallback; merges from the file or, as most such files have none, from the scores.

Control tokens (by `token_type`) and the named BOS/EOS/UNK/PAD tokens are special: matched
whole in text, skipped by `decode(..., skip_special_tokens=True)`; user-defined ones are
matched whole and kept. Any other tokenizer model, pre-tokenizer or architecture is refused
with a ConfigError naming it: a guess would tokenize unlike the model's training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mooncake.errors import ConfigError
from mooncake.model.ggufread import GGUFFile

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# llama.cpp's token types (gguf.TokenType), as `tokenizer.ggml.token_type` spells them
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# NOTE: transformers' regexes, equal to llama.cpp's for these names; None = GPT-2's own
# (byte-level's built-in split). SmolLM's vocabulary has no merge with a digit, so that
# llama.cpp's extra digit split makes no difference there.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` of a byte-level vocabulary -> the regex its text is split by
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt-2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}
TOKENIZER_MODELS = ("gpt2", "llama")
# transformers rebuilds these architectures' SentencePiece vocabularies in ways of their own
_UNSUPPORTED_SPM_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# special token role -> its id key, under `tokenizer.ggml.`
_SPECIAL_ID_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
    "eot": "eot_token_id",  # end of turn (e.g. Llama 3's <|eot_id|>)
    "eom": "eom_token_id",  # end of message (Llama 3.1's <|eom_id|> after a tool call)
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, as the file spells it."""

    path: Path
    architecture: str  # general.architecture, e.g. "llama"
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre, the pre-tokenizer's name; None if absent
    tokens: list[str]  # token id -> its text
    token_types: list[int]  # token id -> llama.cpp token type (all NORMAL if absent)
    scores: list[float]  # token id -> SentencePiece score; [] if absent
    merges: list[str]  # "left right" BPE merges, best first; [] if absent
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos"/"eos"/... -> token id
    add_bos: bool = False  # encode(..., add_special_tokens=True) starts with BOS
    add_eos: bool = False  # ... and ends with EOS
    chat_template: str | None = None  # tokenizer.chat_template

    def special_text(self, role: str) -> str:
        """The text of the special token `role` ("bos", "eos", ...); "" if the file has none."""
        token_id = self.special_ids.get(role)
        return "" if token_id is None else self.tokens[token_id]


def read_vocab(path: Path) -> GGUFVocab:
    """The tokenizer metadata of the GGUF file `path`; raises ConfigError if it cannot be
    read or lacks a vocabulary."""
    values = GGUFFile(path).metadata  # ConfigError for a file that is not GGUF
    tokens = values.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"model.path: {path} has no tokenizer.ggml.tokens (no vocabulary)")
    model = str(values.get("tokenizer.ggml.model", ""))
    special_ids = {}
    for role, key in _SPECIAL_ID_KEYS.items():
        token_id = values.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise ConfigError(
                f"model.path: {path}: tokenizer.ggml.{key} = {token_id} is outside the "
                f"vocabulary of {len(tokens)} tokens"
            )
        special_ids[role] = int(token_id)
    token_types = [int(t) for t in values.get("tokenizer.ggml.token_type", [])]
    scores = [float(s) for s in values.get("tokenizer.ggml.scores", [])]
    for key, found in (("token_type", token_types), ("scores", scores)):
        if found and len(found) != len(tokens):
            raise ConfigError(
                f"model.path: {path}: tokenizer.ggml.{key} has {len(found)} entries for "
                f"{len(tokens)} tokens"
            )
    pre = values.get("tokenizer.ggml.pre")
    template = values.get("tokenizer.chat_template")
    return GGUFVocab(
        path=path,
        architecture=str(values.get("general.architecture", "")),
        model=model,
        pre=None if pre is None else str(pre),
        tokens=[str(t) for t in tokens],
        token_types=token_types or [NORMAL] * len(tokens),
        scores=scores,
        merges=[str(m) for m in values.get("tokenizer.ggml.merges", [])],
        special_ids=special_ids,
        # NOTE: a SentencePiece file that does not say adds BOS (llama.cpp and transformers)
        add_bos=bool(values.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(values.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=None if template is None else str(template),
    )


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The `tokenizers.Tokenizer` the metadata describes (a new one each call); raises
    ConfigError for a tokenizer model, pre-tokenizer or architecture it cannot rebuild."""
    try:
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ConfigError("GGUF models need `pip install tokenizers`") from e
    if vocab.model == "gpt2":
        tok, is_spelled = _byte_level(vocab), _is_byte_spelled
    elif vocab.model == "llama":
        tok, is_spelled = _sentencepiece(vocab), _any_text
    else:
        raise ConfigError(
            f"model.path: {vocab.path} has tokenizer.ggml.model = {vocab.model!r}; "
            f"accepted: {', '.join(TOKENIZER_MODELS)}"
        )
    _add_special_tokens(tok, vocab, is_spelled)
    tok.post_processor = _bos_eos_template(vocab)
    return tok


def _byte_level(vocab: GGUFVocab) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if vocab.pre not in PRE_TOKENIZER_SPLITS:
        raise ConfigError(
            f"model.path: {vocab.path} has tokenizer.ggml.pre = {vocab.pre!r}, a pre-tokenizer "
            f"we cannot rebuild; accepted: {', '.join(PRE_TOKENIZER_SPLITS)}"
        )
    spelling = _byte_spelling()
    # NOTE: a token outside the byte alphabet (a file spelling one as plain text) is
    # respelled byte by byte, so that byte-level BPE can reach it
    token_to_id = {
        t if _is_byte_spelled(t) else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(vocab.tokens)
    }
    tok = Tokenizer(
        models.BPE(
            vocab=token_to_id,
            merges=_merges(vocab),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS[vocab.pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab: GGUFVocab) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if vocab.pre not in (None, "default"):
        raise ConfigError(
            f"model.path: {vocab.path} has tokenizer.ggml.pre = {vocab.pre!r} with a "
            "SentencePiece (llama) vocabulary; accepted: none or 'default'"
        )
    if vocab.architecture in _UNSUPPORTED_SPM_ARCHITECTURES:
        raise ConfigError(
            f"model.path: {vocab.path}: the {vocab.architecture} architecture's SentencePiece "
            "vocabulary is not supported; use the model's Hugging Face directory"
        )
    if vocab.merges:
        merges = _merges(vocab)
    elif vocab.scores:
        merges = _merges_from_scores(vocab.tokens, vocab.scores)
    else:
        raise ConfigError(
            f"model.path: {vocab.path} has a SentencePiece vocabulary with neither "
            "tokenizer.ggml.merges nor a tokenizer.ggml.scores entry per token"
        )
    token_to_id = {t: i for i, t in enumerate(vocab.tokens)}
    tok = Tokenizer(
        models.BPE(
            vocab=token_to_id, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None
        )
    )
    if vocab.architecture == "phi3":
        # Phi-3 spells the prefix space with a normalizer: a text starting with a space
        # keeps both, where Metaspace would fold them into one
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),  # the prefix space the pre-tokenizer added
        ]
    )
    return tok


def _merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    bad = next((m for m in vocab.merges if m.count(" ") != 1), None)
    if bad is not None:
        raise ConfigError(
            f"model.path: {vocab.path}: tokenizer.ggml.merges holds {bad!r}, not 'left right'"
        )
    return [(left, right) for left, right in (m.split(" ") for m in vocab.merges)]


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, ranked by the whole token's score, best first (transformers' order, ties
    broken by the lengths of the halves, then by their ids)."""
    token_to_id = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        halves = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in token_to_id and token[i:] in token_to_id
        ]
        halves.sort(key=lambda h: (token_to_id[h[0]], token_to_id[h[1]]))
        found += [(left, right, score) for left, right in halves]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(
    tok: Tokenizer, vocab: GGUFVocab, is_spelled: Callable[[str], bool]
) -> None:
    from tokenizers import AddedToken

    typed = list(zip(vocab.tokens, vocab.token_types, strict=True))
    # NOTE: a byte-level "control" token outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's, so it stays an ordinary token
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in typed
            if kind == CONTROL and is_spelled(t)
        ]
    )
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in typed
            if kind == USER_DEFINED and t in known
        ]
    )
    added = {str(t) for t in tok.get_added_tokens_decoder().values()}
    for role in ("bos", "eos", "unk", "pad"):
        text = vocab.special_text(role)
        if text and text not in added and text in known:
            tok.add_special_tokens([AddedToken(text, normalized=False, special=True)])
            added.add(text)


def _bos_eos_template(vocab: GGUFVocab) -> Any:
    from tokenizers import processors

    bos, eos = vocab.special_text("bos"), vocab.special_text("eos")
    add_bos, add_eos = vocab.add_bos and bool(bos), vocab.add_eos and bool(eos)
    first = [f"{bos}:0"] if add_bos else []
    last = [f"{eos}:0"] if add_eos else []
    single = [*first, "$A:0", *last]
    pair = [*single, *([f"{bos}:1"] if add_bos else []), "$B:1"]
    pair += [f"{eos}:1"] if add_eos else []
    special = [(bos, vocab.special_ids["bos"])] if add_bos else []
    special += [(eos, vocab.special_ids["eos"])] if add_eos else []
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=special
    )


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes spell themselves, the rest map to
    the characters from U+0100 up, so that every byte string is printable text."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


_BYTE_ALPHABET = frozenset(_byte_spelling().values())


def _is_byte_spelled(token: str) -> bool:
    return set(token) <= _BYTE_ALPHABET


def _any_text(token: str) -> bool:  # a SentencePiece vocabulary spells any text
    return True

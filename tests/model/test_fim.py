"""Fill-in-the-middle prompts: a vocabulary with a family's three FIM tokens gets the
prefix-suffix-middle prompt; one without them gets None (the API's 400)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.model.fim import fim_prompt_ids, fim_token_ids
from mooncake.model.tokenizer import create_tokenizer

tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")


def _hf_dir(tmp_path: Path, specials: list[str], bos: str | None = None) -> Path:
    words = ["def", "f", "(", ")", "return", "x"]
    vocab = {w: i for i, w in enumerate(["[UNK]", *specials, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    if bos is not None:
        bos_id = vocab[bos]
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": bos} if bos else {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


QWEN = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
STARCODER = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


@pytest.mark.parametrize(("specials", "ids"), [(QWEN, (2, 4, 3)), (STARCODER, (2, 4, 3))])
def test_a_coder_vocabulary_gets_the_prefix_suffix_middle_prompt(tmp_path, specials, ids):
    tok = create_tokenizer(str(_hf_dir(tmp_path, specials)))
    assert fim_token_ids(tok) == ids
    pre, suf, mid = ids
    prompt = fim_prompt_ids(tok, "def f ( x )", "return x")
    assert prompt == [
        pre,
        *tok.encode("def f ( x )", False),
        suf,
        *tok.encode("return x", False),
        mid,
    ]


def test_a_bos_the_tokenizer_adds_leads_the_prompt(tmp_path):
    tok = create_tokenizer(str(_hf_dir(tmp_path, ["<s>", *STARCODER], bos="<s>")))
    prompt = fim_prompt_ids(tok, "def", "x")
    assert prompt is not None and prompt[:2] == [1, tok.token_id("<fim_prefix>")]
    assert prompt.count(1) == 1


def test_a_vocabulary_without_all_three_tokens_cannot_fill_in_the_middle(tmp_path):
    tok = create_tokenizer(
        str(_hf_dir(tmp_path, ["<|endoftext|>", "<fim_prefix>", "<fim_suffix>"]))
    )
    assert fim_prompt_ids(tok, "a", "b") is None
    assert fim_prompt_ids(create_tokenizer("dummy:tiny"), "a", "b") is None

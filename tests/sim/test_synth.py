"""`sim/synth.py`: the traces it writes load, repeat byte for byte, and hold what was asked."""

import statistics

import pytest

from mooncake.errors import ConfigError
from mooncake.sim.synth import (
    LengthDist,
    SynthParams,
    parse_length,
    parse_mix,
    synthesize,
    write_trace,
)
from mooncake.sim.trace import TraceError, load_trace

BT = 512


def _full(rec):
    return rec.hash_ids[: rec.input_length // BT]


def test_same_parameters_same_bytes_and_the_file_loads(tmp_path):
    p = SynthParams(mix={"conversation": 1, "agent": 1, "docqa": 1}, sessions=60, seed=7)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(a, synthesize(p)[0])
    write_trace(b, synthesize(SynthParams(**{**_fields(p)}))[0])
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c.jsonl"
    write_trace(c, synthesize(SynthParams(**{**_fields(p), "seed": 8}))[0])
    assert c.read_bytes() != a.read_bytes()
    recs = load_trace(a)  # validates len(hash_ids) == ceil(input / 512), sorted times
    ids = [h for r in recs for h in r.hash_ids]
    first = list(dict.fromkeys(ids))
    assert first == list(range(len(first)))  # small ids, numbered by first appearance


def _fields(p):
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_a_conversation_turn_reuses_the_whole_earlier_prompt():
    p = SynthParams(sessions=1, turns=50, think_s=5, output_len=LengthDist(300), seed=3)
    recs, kinds = synthesize(p)
    assert kinds == {"conversation": 1} and len(recs) > 3
    for prev, cur in zip(recs, recs[1:], strict=False):
        assert cur.timestamp >= prev.timestamp
        # prompt = previous prompt + its output + a new message
        assert cur.input_length > prev.input_length + prev.output_length
        assert cur.hash_ids[: len(_full(prev))] == _full(prev)
        # the previous prompt's partial last block is not reused: it has grown
        if prev.input_length % BT:
            assert prev.hash_ids[-1] not in cur.hash_ids


def test_agent_sessions_share_their_prefix_and_nothing_else():
    p = SynthParams(
        mix={"agent": 1.0},
        sessions=40,
        turns=1,
        agent_prompts=1,
        system_len=LengthDist(1000, 0),
        tools_len=LengthDist(3000, 0),
        seed=1,
    )
    recs, _ = synthesize(p)
    shared = 4000 // BT
    assert all(r.hash_ids[:shared] == recs[0].hash_ids[:shared] for r in recs)
    assert len({r.hash_ids[shared] for r in recs}) == len(recs)  # the messages differ


def test_docqa_picks_popular_documents_more_often():
    p = SynthParams(mix={"docqa": 1.0}, sessions=2000, turns=1, docs=50, zipf=1.2, seed=2)
    recs, _ = synthesize(p)
    # requests on the same document share its blocks: the instruction + document prefix
    by_doc: dict[int, int] = {}
    for r in recs:
        by_doc[r.hash_ids[3]] = by_doc.get(r.hash_ids[3], 0) + 1
    counts = sorted(by_doc.values(), reverse=True)
    assert len(counts) <= 50 and counts[0] > 5 * counts[len(counts) // 2]


def test_burstiness_and_length_means():
    def start_cv(cv):
        recs, _ = synthesize(SynthParams(sessions=3000, turns=1, rate=2.0, cv=cv, seed=5))
        gaps = [b.timestamp - a.timestamp for a, b in zip(recs, recs[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps), recs

    cv1, recs = start_cv(1.0)
    assert 0.9 < cv1 < 1.1
    assert 2.5 < start_cv(3.0)[0] < 3.5
    assert start_cv(0.3)[0] < 0.4
    span = (recs[-1].timestamp - recs[0].timestamp) / 1000
    assert 2999 / span == pytest.approx(2.0, rel=0.1)
    mean_out = statistics.fmean(r.output_length for r in recs)
    assert mean_out == pytest.approx(300, rel=0.05)  # lognormal with the asked mean


def test_prompts_stop_at_max_input():
    p = SynthParams(sessions=20, turns=30, max_input=8192, seed=4)
    assert max(r.input_length for r in synthesize(p)[0]) <= 8192


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SynthParams(rate=0), "--rate"),
        (lambda: SynthParams(cv=-1), "--cv"),
        (lambda: SynthParams(turns=0.5), "--turns"),
        (lambda: SynthParams(mix={"chat": 1.0}), "--mix"),
        (lambda: SynthParams(mix={"agent": 0.0}), "--mix"),
        (lambda: SynthParams(user_len=LengthDist(0)), "--user-len"),
        (lambda: SynthParams(doc_len=LengthDist(100, 9)), "--doc-len"),
        (lambda: SynthParams(max_input=100), "--max-input"),
        (lambda: parse_length("--user-len", "abc"), "--user-len"),
        (lambda: parse_length("--user-len", "1:2:3"), "MEAN:SPREAD"),
        (lambda: parse_mix("agent:x"), "KIND[:WEIGHT]"),
        (lambda: synthesize(SynthParams(mix={"docqa": 1}, max_input=600)), "--max-input"),
    ],
)
def test_bad_values_name_the_flag(make, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        make()


def test_an_unwritable_path_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot write trace"):
        write_trace(tmp_path / "no" / "such" / "dir.jsonl", synthesize(SynthParams(sessions=2))[0])

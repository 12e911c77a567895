"""KV streamed layer by layer while the prefill computes: into a decode node's reserved
blocks (through a real Transfer Engine, shm and tcp), from one stage or from every stage of
a group, with several prompts in flight on one group."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from mooncake.errors import TransferError
from mooncake.kv.handoff import place_cache_in_segments
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.layerio import DramKVPool
from mooncake.kv.stream import KVDest, KVStreamer, StreamPlan, StreamWriter
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.params import SamplingParams
from mooncake.model.prefill import PrefillRunner, PrefillState
from mooncake.model.weights import create_model
from mooncake.roles.decode.role import missing_layers
from mooncake.roles.node.messages import DecodeSubmitMsg
from mooncake.roles.prefill.group.link import LocalStageLink, local_link_pair
from mooncake.roles.prefill.group.pipeline import Answers, send_prompt
from mooncake.roles.prefill.group.stage import StageServer
from mooncake.transfer import TransferEngine
from mooncake.transfer.types import EngineOptions
from tests.model.conftest import BLOCK, prompt

SECRET = b"kvstream-test-secret-0123456789"


@pytest.fixture(params=["shm", "tcp"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """A prefill-side and a decode-side engine; `tcp` forces the network path."""
    opts = EngineOptions(protocol=request.param)
    src = TransferEngine("pf", SECRET, opts)
    dst = TransferEngine("dc", SECRET, opts)
    try:
        yield src, dst
    finally:
        src.close()
        dst.close()


def _dest(dst: TransferEngine, cache: PagedKVCache, n: int) -> KVDest:
    blocks = cache.allocate(n)[::-1]  # NOTE: reversed: no accidental identity mapping
    ep = dst.endpoints[0]
    return KVDest(endpoint=f"{ep.host}:{ep.port}", prefix="dc.kv.", block_ids=blocks, num_tokens=n)


def _assert_same_kv(a: PagedKVCache, a_blocks, b: PagedKVCache, b_blocks, layers, n) -> None:
    for layer in layers:
        for x, y in zip(a.gather(layer, a_blocks, n), b.gather(layer, b_blocks, n), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def _two_stage_group(
    tiny_info, src: TransferEngine, writer: StreamWriter, num_blocks: int
) -> tuple[list[PrefillRunner], LocalStageLink, threading.Thread]:
    """Stage 0's and stage 1's runners (layers 0-1, 2-3; caches in `src`'s segments), the
    link to stage 1, and the thread serving stage 1, which streams its own layers."""
    runners: list[PrefillRunner] = []
    for i, layers in enumerate([(0, 2), (2, 4)]):
        model = create_model(tiny_info, "float32", "cpu", layers)
        cache = PagedKVCache.for_model(model, num_blocks, BLOCK)
        place_cache_in_segments(src, cache, f"s{i}.kv.")
        runners.append(PrefillRunner(model, cache, chunk_tokens=10))

    def streamer(st: PrefillState, plan: StreamPlan) -> KVStreamer:
        r = runners[1]
        return KVStreamer(src, r.cache, "s1.kv.", st.block_ids, plan, r.layout, writer, 10.0)

    up, down = local_link_pair()
    server = threading.Thread(target=StageServer(runners[1], down, streamer=streamer).serve)
    server.start()
    return runners, up, server


def test_one_stage_streams_every_layer_including_the_reused_prefix(tiny, fingerprint, engines):
    """A prompt whose first blocks come from the pool: the decode cache ends up with the KV
    of every token (the reused ones too), equal to the prefilling cache's, and the report
    says each layer got all tokens. Chunks off block boundaries, last block partial."""
    src, dst = engines
    hasher = PrefixHasher(BLOCK, SECRET, fingerprint)
    cache = PagedKVCache.for_model(tiny, 32, BLOCK)
    place_cache_in_segments(src, cache, "pf.kv.")
    decode = PagedKVCache.for_model(tiny, 32, BLOCK)
    place_cache_in_segments(dst, decode, "dc.kv.")
    pool = DramKVPool(PrefillRunner(tiny, cache).layout, fingerprint)
    runner = PrefillRunner(
        tiny, cache, chunk_tokens=12, hasher=hasher, source=pool, sink=pool, fingerprint=fingerprint
    )
    ids = prompt(61, seed=4)
    cache.free(runner.prefill(ids[:33]).block_ids)  # 4 blocks of it go to the pool
    writer = StreamWriter()
    try:
        st = runner.start(ids)
        assert st.compute_start == 32
        dest = _dest(dst, decode, len(ids))
        st.stream = KVStreamer(
            src, cache, "pf.kv.", st.block_ids, StreamPlan(decode=dest), runner.layout, writer, 10.0
        )
        for start in range(st.compute_start, len(ids), 12):
            runner.run_chunk(st, start, min(start + 12, len(ids)))
        runner.finish(st)
        report = st.stream.finish()
    finally:
        writer.close()
    assert report.layer_tokens == dict.fromkeys(range(tiny.spec.num_layers), 61)
    assert report.num_bytes > 0
    _assert_same_kv(cache, st.block_ids, decode, dest.block_ids, tiny.layer_ids, 61)


def test_a_stream_that_cannot_write_fails_at_finish_and_abort_waits(tiny, engines):
    """A plan naming a segment the decode side does not have: finish() raises, naming it."""
    src, dst = engines
    cache = PagedKVCache.for_model(tiny, 16, BLOCK)
    place_cache_in_segments(src, cache, "pf.kv.")
    ep = dst.endpoints[0]
    dest = KVDest(
        endpoint=f"{ep.host}:{ep.port}", prefix="nowhere.", block_ids=[0, 1, 2], num_tokens=20
    )
    runner = PrefillRunner(tiny, cache, chunk_tokens=8)
    writer = StreamWriter()
    try:
        st = runner.start(prompt(21, seed=1))
        st.stream = KVStreamer(
            src, cache, "pf.kv.", st.block_ids, StreamPlan(decode=dest), runner.layout, writer, 5.0
        )
        runner.run_chunk(st, 0, 8)
        with pytest.raises(TransferError, match="nowhere"):
            st.stream.finish()
        runner.abort(st)
    finally:
        writer.close()
    assert cache.allocator.num_free == 16


def test_a_two_stage_group_with_prompts_in_flight_streams_each_stage_s_own_layers(
    tiny_info, tiny, engines
):
    """Three prompts begun back to back on a 2-stage group (the first stage does not wait
    for answers): each stage writes its own layers into the decode blocks; every prompt's
    logits equal the one-process prefill's, and the reports cover every layer."""
    src, dst = engines
    decode = PagedKVCache.for_model(tiny, 64, BLOCK)
    place_cache_in_segments(dst, decode, "dc.kv.")
    writer = StreamWriter()
    runners, up, server = _two_stage_group(tiny_info, src, writer, 32)
    answers = Answers(up, 2, stage_timeout_s=10.0)
    prompts = [prompt(n, seed=n) for n in (37, 22, 45)]
    flights = []
    try:
        for req, ids in enumerate(prompts):
            st = runners[0].start(ids, req_id=req)
            plan = StreamPlan(decode=_dest(dst, decode, len(ids)))
            st.stream = KVStreamer(
                src, runners[0].cache, "s0.kv.", st.block_ids, plan, runners[0].layout, writer, 10.0
            )
            a = answers.expect(req, has_plan=True)
            answers.sent(a, send_prompt(runners[0], st, up, plan))
            flights.append((st, plan, a))
        for st, plan, a in flights:
            answers.wait(a)
            runners[0].finish(st)
            own = st.stream.finish()
            assert own.layer_tokens == dict.fromkeys((0, 1), len(st.token_ids))
            assert [r.layer_tokens for r in a.reports.values()] == [
                dict.fromkeys((2, 3), len(st.token_ids))
            ]
            assert a.hops == 1
            expected = PrefillRunner(
                tiny, PagedKVCache.for_model(tiny, 16, BLOCK), chunk_tokens=10
            ).prefill(st.token_ids)
            torch.testing.assert_close(a.logits, expected.logits, atol=1e-5, rtol=1e-5)
            assert plan.decode is not None
            full = PagedKVCache.for_model(tiny, 16, BLOCK)
            ref = PrefillRunner(tiny, full, chunk_tokens=10).prefill(st.token_ids)
            _assert_same_kv(
                full, ref.block_ids, decode, plan.decode.block_ids, range(4), len(st.token_ids)
            )
            runners[0].cache.free(st.block_ids)
    finally:
        up.close()
        server.join(timeout=30)
        writer.close()
    assert runners[1].cache.allocator.num_free == 32


def test_the_decode_node_refuses_kv_that_did_not_land_in_every_layer():
    """The submit's per-layer counts are checked: a missing or short layer is named."""

    def msg(layer_tokens: list[int], n: int = 40) -> DecodeSubmitMsg:
        return DecodeSubmitMsg(1, list(range(n + 1)), SamplingParams(), [0, 1, 2], n, layer_tokens)

    assert missing_layers(msg([40] * 4), 4) == ""
    assert "3 of 4 layers" in missing_layers(msg([40] * 3), 4)
    assert "layer 2: 32" in missing_layers(msg([40, 40, 32, 40]), 4)
    assert missing_layers(msg([], 0), 4) == ""  # a one-token prompt: nothing to land


def test_a_prompt_whose_stream_failed_at_its_end_is_served_again_under_its_id(tiny_info, engines):
    """A later stage whose KV stream of a prompt fails at the prompt's END answers ERROR
    and keeps nothing of it: the same request id sent again on the same link (the master
    placed the request on the group again) is answered, and the stage's blocks are free."""
    src, dst = engines
    writer = StreamWriter()
    runners, up, server = _two_stage_group(tiny_info, src, writer, 16)
    answers = Answers(up, 2, stage_timeout_s=5.0)
    ids = prompt(30, seed=9)
    ep = dst.endpoints[0]
    nowhere = KVDest(  # a segment the decode side does not have: the stream fails at END
        endpoint=f"{ep.host}:{ep.port}", prefix="nowhere.", block_ids=list(range(4)), num_tokens=30
    )
    try:
        st = runners[0].start(ids, req_id=5)
        a = answers.expect(5, has_plan=True)
        plan = StreamPlan(decode=nowhere)
        answers.sent(a, send_prompt(runners[0], st, up, plan))
        with pytest.raises(TransferError, match="nowhere"):
            answers.wait(a)
        runners[0].abort(st)
        st = runners[0].start(ids, req_id=5)
        again = answers.expect(5, has_plan=False)
        answers.sent(again, send_prompt(runners[0], st, up))
        answers.wait(again)  # NOTE: a stage that still dropped req 5's frames never answers
        runners[0].finish(st)
        runners[0].cache.free(st.block_ids)
    finally:
        up.close()
        server.join(timeout=30)
        writer.close()
    assert again.logits is not None and again.hops == 1
    assert runners[1].cache.allocator.num_free == 16
    runners[1].cache.allocator.check_integrity()

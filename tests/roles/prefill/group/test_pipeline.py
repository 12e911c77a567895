"""Chunked pipeline parallelism: stages in two processes, or threads, equal one process."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mooncake.errors import AuthError, TransferError
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.layerio import DramKVPool
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.weights import create_model
from mooncake.roles.prefill.group import auth as stageauth
from mooncake.roles.prefill.group.link import (
    FrameKind,
    StageFrame,
    StageTimeoutError,
    TcpStageLink,
    _encode,
    local_link_pair,
)
from mooncake.roles.prefill.group.listener import StageListener
from mooncake.roles.prefill.group.pipeline import prefill_pipelined
from mooncake.roles.prefill.group.stage import StageServer
from tests.model.conftest import BLOCK, prompt

pytestmark = pytest.mark.cluster

SECRET = b"pipeline-test-secret-0123456789"


@pytest.fixture
def stage_proc() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A real process serving layers 2-3 of dummy:tiny; yields it and its port once ready."""
    env = dict(os.environ, MOONCAKE_STAGE_SECRET=SECRET.decode())
    cmd = [
        sys.executable,
        "-m",
        "mooncake.roles.prefill.group.stageproc",
        "--layers",
        "2:4",
        "--block-tokens",
        str(BLOCK),
        "--num-blocks",
        "32",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # the ready handshake
        assert ready["ready"]
        yield proc, int(ready["port"])
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def stage_process(stage_proc: tuple[subprocess.Popen[str], int]) -> int:
    return stage_proc[1]


def test_two_stage_pipeline_in_two_processes_equals_one_process(tiny_info, tiny, stage_process):
    """Stage 0 here, stage 1 in another process: same first token, same logits, same KV
    of the second stage's layers as prefilling in one process (chunks off block size).
    A peer without the cluster secret is refused first, and the stage keeps serving."""
    ids = prompt(70, seed=11)
    full_cache = PagedKVCache.for_model(tiny, 16, BLOCK)
    expected = PrefillRunner(tiny, full_cache, chunk_tokens=12).prefill(ids)

    stage0 = create_model(tiny_info, "float32", "cpu", (0, 2))
    cache0 = PagedKVCache.for_model(stage0, 16, BLOCK)
    with pytest.raises(AuthError, match="does not know the cluster secret"):
        TcpStageLink.connect("127.0.0.1", stage_process, b"wrong-secret-wrong-secret")
    link = TcpStageLink.connect("127.0.0.1", stage_process, SECRET)  # the worker still serves
    try:
        runner0 = PrefillRunner(stage0, cache0, chunk_tokens=12)
        got = prefill_pipelined(runner0, ids, link, return_remote_kv=True)
        again = prefill_pipelined(runner0, ids[:20], link, req_id=1)
    finally:
        link.close()
    assert got.logits is not None and expected.logits is not None and again.logits is not None
    assert int(got.logits.argmax()) == int(expected.logits.argmax())
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert sorted(got.remote_kv) == [2, 3]
    for layer, (k, v) in got.remote_kv.items():
        ek, ev = full_cache.gather(layer, expected.block_ids, len(ids))
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ev, atol=1e-5, rtol=1e-5)
    for layer in (0, 1):  # and stage 0's own layers
        for a, b in zip(
            cache0.gather(layer, got.block_ids, 70),
            full_cache.gather(layer, expected.block_ids, 70),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_three_stage_chain_with_prefix_reuse_equals_one_process(tiny_info, tiny, fingerprint):
    """Stages as threads (layers 0, 1-2, 3) sharing one pool: a prompt whose prefix each
    stage loads from the pool yields the one-process logits; all stages store their layers."""
    hasher = PrefixHasher(BLOCK, SECRET, fingerprint)
    plain = PrefillRunner(tiny, PagedKVCache.for_model(tiny, 16, BLOCK), chunk_tokens=16)
    pool = DramKVPool(plain.layout, fingerprint)
    runners, threads = [], []
    links = [local_link_pair(), local_link_pair()]
    for i, layers in enumerate([(0, 1), (1, 3), (3, 4)]):
        model = create_model(tiny_info, "float32", "cpu", layers)
        cache = PagedKVCache.for_model(model, 16, BLOCK)
        runners.append(
            PrefillRunner(
                model,
                cache,
                chunk_tokens=16,
                hasher=hasher,
                source=pool,
                sink=pool,
                fingerprint=fingerprint,
            )
        )
        if i:
            down = links[i][0] if i < 2 else None
            server = StageServer(runners[i], links[i - 1][1], down)
            threads.append(threading.Thread(target=server.serve))
            threads[-1].start()
    ids = prompt(41, seed=2)
    expected = plain.prefill(ids)
    first = prefill_pipelined(runners[0], ids[:24], links[0][0])  # each stage stores its layers
    assert first.stats.num_stored_blocks == 3
    second = prefill_pipelined(runners[0], ids, links[0][0], req_id=1)
    links[0][0].close()
    for t in threads:
        t.join(timeout=30)
    assert second.stats.num_reused_tokens == 3 * BLOCK
    torch.testing.assert_close(second.logits, expected.logits, atol=1e-5, rtol=1e-5)


def test_a_stage_whose_leader_dies_mid_prompt_frees_its_blocks_and_serves_the_next(tiny_info, tiny):
    """The leader's connection is reset after a prompt's first chunk (it was SIGKILLed):
    the stage's serve returns without raising, the half-done request's KV blocks are free
    again, and the next leader's link is served (the one-process logits)."""
    ids = prompt(40, seed=3)
    expected = PrefillRunner(tiny, PagedKVCache.for_model(tiny, 16, BLOCK), chunk_tokens=12)
    stage0 = create_model(tiny_info, "float32", "cpu", (0, 2))
    stage1 = create_model(tiny_info, "float32", "cpu", (2, 4))
    runner0 = PrefillRunner(stage0, PagedKVCache.for_model(stage0, 16, BLOCK), chunk_tokens=12)
    cache1 = PagedKVCache.for_model(stage1, 16, BLOCK)
    runner1 = PrefillRunner(stage1, cache1, chunk_tokens=12)
    listener = StageListener(SECRET)
    try:
        # the dying leader: a bare authenticated socket, so that its close is a real one
        dying = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
        stageauth.client_handshake(dying, SECRET, time.monotonic() + 10)
        server = threading.Thread(target=StageServer(runner1, listener.accept(timeout=10)).serve)
        server.start()
        st = runner0.start(ids)
        tokens = torch.tensor(st.token_ids, dtype=torch.int64)
        begin = StageFrame(FrameKind.BEGIN, 7, start=st.compute_start, tensor=tokens)
        chunk = StageFrame(FrameKind.CHUNK, 7, 0, 0, 12, runner0.run_chunk(st, 0, 12))
        for frame in (begin, chunk):
            header, payload = _encode(frame)
            dying.sendall(header + bytes(payload or b""))
        for _ in range(1000):  # NOTE: poll until the stage holds the prompt's blocks
            if cache1.allocator.num_free < 16:
                break
            time.sleep(0.01)
        assert cache1.allocator.num_free < 16
        runner0.abort(st)
        # as the kernel does for a killed process with unread data: a reset, not a FIN
        dying.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        dying.close()
        server.join(timeout=30)
        assert not server.is_alive()
        assert cache1.allocator.num_free == 16
        cache1.allocator.check_integrity()
        link = TcpStageLink.connect("127.0.0.1", listener.port, SECRET)
        server = threading.Thread(target=StageServer(runner1, listener.accept(timeout=10)).serve)
        server.start()
        got = prefill_pipelined(runner0, ids, link)
        link.close()
        server.join(timeout=30)
    finally:
        listener.close()
    torch.testing.assert_close(got.logits, expected.prefill(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_stopped_stage_fails_the_prompt_at_its_deadline_and_frees_its_blocks(
    tiny_info, stage_proc
):
    """The next stage's process is SIGSTOPped (a hung node never closes its link): the
    driver raises StageTimeoutError at about `stage_timeout_s` per chunk sent, not
    later, and stage 0's KV blocks are free again."""
    proc, port = stage_proc
    stage0 = create_model(tiny_info, "float32", "cpu", (0, 2))
    cache0 = PagedKVCache.for_model(stage0, 16, BLOCK)
    runner0 = PrefillRunner(stage0, cache0, chunk_tokens=12)
    link = TcpStageLink.connect("127.0.0.1", port, SECRET)
    ids = prompt(30, seed=5)  # 3 chunks: a deadline of 3 x 0.5 s
    try:
        first = prefill_pipelined(runner0, ids, link, stage_timeout_s=0.5)
        assert first.logits is not None
        cache0.free(first.block_ids)  # the caller's (handed off in the role)
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(StageTimeoutError, match="did not answer within 1.5 s"):
            prefill_pipelined(runner0, ids, link, req_id=1, stage_timeout_s=0.5)
        took = time.monotonic() - start
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        link.abort()  # as the leader does with a link past its deadline
    assert 1.4 < took < 5.0, took
    assert cache0.allocator.num_free == 16
    cache0.allocator.check_integrity()


def test_a_slow_stage_with_a_backlog_of_chunks_meets_its_deadline(tiny_info, tiny, monkeypatch):
    """The deadline is per chunk: a later stage that takes 0.3 s a chunk (with a 0.5 s
    deadline) still answers a 4-chunk prompt, queued behind the leader, after ~1.2 s."""
    stage0 = create_model(tiny_info, "float32", "cpu", (0, 2))
    stage1 = create_model(tiny_info, "float32", "cpu", (2, 4))
    runner0 = PrefillRunner(stage0, PagedKVCache.for_model(stage0, 16, BLOCK), chunk_tokens=10)
    runner1 = PrefillRunner(stage1, PagedKVCache.for_model(stage1, 16, BLOCK), chunk_tokens=10)
    run_chunk = runner1.run_chunk

    def slow_chunk(*args: Any, **kw: Any) -> Any:
        time.sleep(0.3)
        return run_chunk(*args, **kw)

    monkeypatch.setattr(runner1, "run_chunk", slow_chunk)
    up, down = local_link_pair()
    server = threading.Thread(target=StageServer(runner1, down).serve)
    server.start()
    ids = prompt(40, seed=6)
    try:
        got = prefill_pipelined(runner0, ids, up, stage_timeout_s=0.5)
    finally:
        up.close()
        server.join(timeout=30)
    expected = PrefillRunner(tiny, PagedKVCache.for_model(tiny, 16, BLOCK), chunk_tokens=10)
    torch.testing.assert_close(got.logits, expected.prefill(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_prompt_is_registered_while_another_thread_reads_the_link_for_an_earlier_one():
    """The leader's worker registers its next prompt (`Answers.expect`) while the completer
    waits on the link for an earlier prompt's answer: registering must not wait for that
    answer, or the group runs one prompt at a time (stage 0 idle while stage 1 computes)."""
    from mooncake.roles.prefill.group.pipeline import Answers

    up, down = local_link_pair()
    answers = Answers(up, 2, stage_timeout_s=30.0)
    first = answers.expect(1, has_plan=False)
    answers.sent(first, 1)
    ended: list[BaseException] = []

    def read() -> None:
        try:
            answers.wait(first)
        except TransferError as e:  # the link closes at the end of the test
            ended.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.05)  # the reader is now blocked on the silent link
    registered = threading.Event()

    def register() -> None:
        answers.expect(2, has_plan=False)
        registered.set()

    threading.Thread(target=register, daemon=True).start()
    try:
        assert registered.wait(5.0), "expect() waited for the reader of an earlier prompt"
        assert reader.is_alive()  # its answer has not come: it still waits
    finally:
        up.close()
        down.close()
        reader.join(timeout=5.0)
    assert ended, "the reader ends when the link closes"

"""`mooncake bench engine --parts handoff,inflight`: the streamed hand-off and a group
with several prompts in flight, each against its baseline in the same run.

A decode node's KV cache is stood in for by a paged cache in this process's Transfer
Engine segments (the receiver); stage 0 runs here, stage 1 of a 2-stage group in a child
process (`stage_worker --stream`, its own torch thread, as a stage has its own device).

- handoff:  for a prompt on a 1-stage and a 2-stage group, the time from prefill start
            until the receiver holds every layer's KV (every stage's stream finished)
            against the same prefill with nothing streamed; `ready_s / prefill_s`
- inflight: a 2-stage group given N prompts at once (the first stage begins each as soon
            as it sent the previous one's last chunk) against the same group taking them
            one at a time; `throughput ratio = one-at-a-time s / at-once s`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mooncake.bench.engine import SECRET, Bench, Timing, interleave, random_prompt
from mooncake.kv.handoff import place_cache_in_segments
from mooncake.kv.stream import KVDest, KVStreamer, StreamPlan, StreamWriter, merge_reports
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner, PrefillState
from mooncake.model.weights import create_model
from mooncake.roles.prefill.group.link import TcpStageLink
from mooncake.roles.prefill.group.pipeline import Answer, Answers, prefill_pipelined, send_prompt
from mooncake.transfer import TransferEngine
from mooncake.transfer.types import EngineOptions


class HandoffBench:
    """Stage 0 (or the whole model) here, a receiver cache, and a child for stage 1."""

    def __init__(self, bench: Bench, max_tokens: int, protocol: str = "auto"):
        self.b = bench
        n = bench.info.spec.num_layers
        self.split = n // 2
        opts = EngineOptions(protocol=protocol)  # type: ignore[arg-type]
        self.src = TransferEngine("bench-prefill", SECRET, opts)
        self.dst = TransferEngine("bench-decode", SECRET, opts)
        blocks = 4 * -(-max_tokens // bench.bt) + 4
        self.receiver = PagedKVCache.for_model(bench.model, blocks, bench.bt)
        place_cache_in_segments(self.dst, self.receiver, "recv.kv.")
        place_cache_in_segments(self.src, bench.cache, "whole.kv.")
        stage0 = create_model(bench.info, bench.dtype, "cpu", (0, self.split))
        self.cache0 = PagedKVCache.for_model(stage0, bench.cache.num_blocks, bench.bt)
        place_cache_in_segments(self.src, self.cache0, "stage0.kv.")
        self.runner0 = PrefillRunner(stage0, self.cache0, chunk_tokens=bench.chunk)
        self.writer = StreamWriter()
        self._ids = iter(range(1 << 30))

    def close(self) -> None:
        self.writer.close()
        self.src.close()
        self.dst.close()

    def _plan(self, n: int) -> StreamPlan:
        ep = self.dst.endpoints[0]
        blocks = self.receiver.allocate(n)
        dest = KVDest(
            endpoint=f"{ep.host}:{ep.port}", prefix="recv.kv.", block_ids=blocks, num_tokens=n
        )
        return StreamPlan(decode=dest)

    def _stream(self, runner: PrefillRunner, st: PrefillState, prefix: str, n: int) -> None:
        st.stream = KVStreamer(
            self.src,
            runner.cache,
            prefix,
            st.block_ids,
            self._plan(n),
            runner.layout,
            self.writer,
            60.0,
        )

    def _release(self, plans: list[StreamPlan]) -> None:
        for p in plans:
            assert p.decode is not None
            self.receiver.free(p.decode.block_ids)

    # -- 1 stage ------------------------------------------------------------------------
    def one_stage(self, length: int, repeat: int) -> dict[str, Timing]:
        b = self.b
        ids = random_prompt(length, b.vocab, seed=5)

        def streamed() -> None:
            st = b.plain.start(ids)
            self._stream(b.plain, st, "whole.kv.", length)
            for start in range(0, length, b.chunk):
                b.plain.run_chunk(st, start, min(start + b.chunk, length))
            b.plain.finish(st)
            assert st.stream is not None
            report = st.stream.finish()
            assert set(report.layer_tokens.values()) == {length}
            b.cache.free(st.block_ids)
            self._release([st.stream.plan])

        return interleave(
            {"prefill alone": lambda: b.run(b.plain, ids), "until KV on decode": streamed},
            repeat,
        )

    # -- 2 stages -----------------------------------------------------------------------
    @contextmanager
    def _stage1(self) -> Iterator[TcpStageLink]:
        b = self.b
        env = dict(os.environ, MOONCAKE_STAGE_SECRET=SECRET.decode())
        cmd = [
            sys.executable,
            "-m",
            "mooncake.roles.prefill.group.stageproc",
            "--model",
            b.info.path,
            "--dtype",
            b.dtype,
            "--layers",
            f"{self.split}:{b.info.spec.num_layers}",
            "--block-tokens",
            str(b.bt),
            "--num-blocks",
            str(b.cache.num_blocks),
            "--stream",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
        try:
            assert proc.stdout is not None
            port = int(json.loads(proc.stdout.readline())["port"])
            link = TcpStageLink.connect("127.0.0.1", port, SECRET)
            yield link
            link.close()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def _begin(
        self, answers: Answers, ids: list[int], streamed: bool
    ) -> tuple[PrefillState, Answer]:
        st = self.runner0.start(ids, req_id=next(self._ids))
        plan = None
        if streamed:
            self._stream(self.runner0, st, "stage0.kv.", len(ids))
            assert st.stream is not None
            plan = st.stream.plan
        a = answers.expect(st.req_id, has_plan=streamed)
        answers.sent(a, send_prompt(self.runner0, st, answers.link, plan))
        return st, a

    def _end(self, answers: Answers, st: PrefillState, a: Answer) -> None:
        answers.wait(a)
        self.runner0.finish(st)
        if st.stream is not None:
            reports = [st.stream.finish(), *a.reports.values()]
            tokens, _, _ = merge_reports(reports, self.b.info.spec.num_layers)
            assert set(tokens) == {len(st.token_ids)}, tokens  # every layer landed
            self._release([st.stream.plan])
        self.cache0.free(st.block_ids)

    def two_stage(self, length: int, repeat: int) -> dict[str, Timing]:
        ids = random_prompt(length, self.b.vocab, seed=6)
        with self._stage1() as link:
            answers = Answers(link, self.b.info.spec.num_layers - self.split, 60.0)

            def alone() -> None:
                self.cache0.free(
                    prefill_pipelined(self.runner0, ids, link, req_id=next(self._ids)).block_ids
                )

            def streamed() -> None:
                self._end(answers, *self._begin(answers, ids, True))

            return interleave({"prefill alone": alone, "until KV on decode": streamed}, repeat)

    def inflight(self, length: int, count: int, repeat: int) -> dict[str, Timing]:
        prompts = [random_prompt(length, self.b.vocab, seed=10 + i) for i in range(count)]
        with self._stage1() as link:
            answers = Answers(link, self.b.info.spec.num_layers - self.split, 60.0)

            def one_at_a_time() -> None:
                for ids in prompts:
                    self._end(answers, *self._begin(answers, ids, True))

            def at_once() -> None:
                flights = [self._begin(answers, ids, True) for ids in prompts]
                for st, a in flights:
                    self._end(answers, st, a)

            return interleave({"one at a time": one_at_a_time, "all in flight": at_once}, repeat)

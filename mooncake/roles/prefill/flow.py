"""One prefill task on a group's leader, from its start to its KV on the decode node.

    begin    (worker thread) start the prefill (prefix reuse decided, cache blocks
             allocated); reserve the prompt's blocks on the decode node, waiting for
             room; start the pool puts of its new full blocks; compute this stage's
             layers chunk by chunk (through the group: `pipeline.send_prompt`), each
             finished layer's KV streaming out meanwhile (engine/kvstream.py)
    finish   (completer thread) wait for the later stages' reports; submit the request
             to the decode node with the tokens landed per layer; then seal the pool
             objects (off the path of the first token)

Between the two the worker begins the next task, so the group's stages work on several
requests at once. On any failure the decode reservation is released, the uncommitted
pool puts are revoked and the cache blocks freed, after every write still on the wire
ended: the decode node never decodes from partial KV.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mooncake.errors import MooncakeError
from mooncake.kv.pool import StoreKVPool
from mooncake.kv.stream import (
    KVDest,
    KVStreamer,
    PoolTarget,
    StreamPlan,
    StreamWriter,
    merge_reports,
)
from mooncake.model.prefill import PrefillRunner, PrefillState, PrefillStats
from mooncake.roles.node.messages import PrefillTaskMsg
from mooncake.roles.prefill.group.pipeline import Answer, Answers, send_prompt
from mooncake.roles.prefill.handoff import DecodeHandoff
from mooncake.transfer import TransferEngine

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A task between `begin` and `finish`."""

    task: PrefillTaskMsg
    st: PrefillState | None = None  # None: a one-token prompt (the decode node computes it)
    dest: KVDest | None = None
    targets: list[PoolTarget] = field(default_factory=list)
    answer: Answer | None = None  # the later stages' answer, for a piped prompt
    answers: Answers | None = None


class PrefillFlow:
    """Begins and finishes tasks on a leader's `runner` (see the module docstring)."""

    def __init__(
        self,
        runner: PrefillRunner,
        engine: TransferEngine,
        kv_prefix: str,
        pool: StoreKVPool | None,
        handoff: DecodeHandoff,
        timeout_s: float,
    ):
        self.runner, self.engine, self.kv_prefix = runner, engine, kv_prefix
        self.pool, self.handoff, self.timeout_s = pool, handoff, timeout_s
        self.writer = StreamWriter()

    def streamer(self, st: PrefillState, plan: StreamPlan) -> KVStreamer:
        """A stream of `st`'s layers on this node (a later stage builds its own this way)."""
        r = self.runner
        return KVStreamer(
            self.engine,
            r.cache,
            self.kv_prefix,
            st.block_ids,
            plan,
            r.layout,
            self.writer,
            self.timeout_s,
        )

    def begin(self, task: PrefillTaskMsg, answers: Answers | None, **start_kw: Any) -> Flight:
        """Everything up to this stage's last chunk; raises on failure (nothing held).
        `answers`: the link to the group's next stage (None: a group of one)."""
        prompt = task.prompt_ids[:-1]  # NOTE: the decode node computes the last token
        flight = Flight(task, answers=answers)
        if not prompt:
            return flight
        st = flight.st = self.runner.start(prompt, req_id=task.req_id, **start_kw)
        try:
            flight.dest = self.handoff.reserve(task, len(prompt))
            if self.pool is not None:
                bt = self.runner.cache.block_tokens
                first, full = st.first_store_block, len(prompt) // bt
                flight.targets = self.pool.start_objects(st.hashes[first:full], first)
            plan = StreamPlan(decode=flight.dest, pool=flight.targets)
            st.stream = self.streamer(st, plan)
            if answers is not None:
                flight.answer = answers.expect(task.req_id, has_plan=True)
                answers.sent(flight.answer, send_prompt(self.runner, st, answers.link, plan))
            else:
                n, chunk = len(prompt), self.runner.chunk_tokens
                for start in range(st.compute_start, n, chunk):
                    self.runner.run_chunk(st, start, min(start + chunk, n))
        except BaseException:
            self._undo(flight, finished=False)
            raise
        return flight

    def finish(self, flight: Flight) -> tuple[PrefillStats | None, int]:
        """The rest (module docstring); returns the prefill's stats and the KV bytes
        written to the decode node. Raises on failure (the flight's holdings released)."""
        st, task = flight.st, flight.task
        if st is None:
            self.handoff.submit(task, None, [])
            return None, 0
        assert st.stream is not None
        finished = False
        try:
            if flight.answer is not None and flight.answers is not None:
                flight.answers.wait(flight.answer)
            self.runner.finish(st)
            finished = True
            reports = [st.stream.finish()]
            if flight.answer is not None:
                reports += flight.answer.reports.values()
            layer_tokens, digests, num_bytes = merge_reports(reports, self.runner.layout.num_layers)
            self.handoff.submit(task, flight.dest, layer_tokens)
            flight.dest = None  # NOTE: the decode node owns the blocks now
        except BaseException:
            self._undo(flight, finished)
            raise
        self.runner.cache.free(st.block_ids)
        submitted = time.perf_counter()
        if self.pool is not None and flight.targets:  # NOTE: after the submit: not on TTFT's path
            try:
                st.stats.num_stored_blocks = self.pool.seal_objects(
                    flight.targets, st.hashes, st.token_ids, digests
                )
            except MooncakeError as e:  # the pool misses these blocks; the request is fine
                log.warning(
                    "req %d: %d KV blocks not stored: %s", task.req_id, len(flight.targets), e
                )
        st.stats.seal_s = time.perf_counter() - submitted
        return st.stats, num_bytes

    def _undo(self, flight: Flight, finished: bool) -> None:
        """Release what `flight` holds, once none of its writes is on the wire."""
        st = flight.st
        if st is not None:
            if finished:  # NOTE: the runner let go of its state; the blocks are still ours
                if st.stream is not None:
                    st.stream.abort()
                self.runner.cache.free(st.block_ids)
            else:
                self.runner.abort(st)
        if flight.answer is not None and flight.answers is not None:
            flight.answers.forget(flight.answer)
        if flight.targets and self.pool is not None and st is not None:
            self.pool.revoke_objects(flight.targets, st.hashes)
        if flight.dest is not None:
            self.handoff.release(flight.task)

    def close(self) -> None:
        self.writer.close()

"""One prefill task on a group's leader, from its start to its KV on the decode node.

    begin    (worker thread) start the prefill (prefix reuse decided, cache blocks
             allocated); reserve the prompt's blocks on the decode node, waiting for
             room; start the pool puts of its new full blocks; compute this stage's
             layers chunk by chunk (through the group: `pipeline.send_prompt`), each
             finished layer's KV streaming out meanwhile (kv/stream.py)
    finish   (completer thread) wait for the later stages' reports; submit the request
             to the decode node with the tokens landed per layer; then seal the pool
             objects (off the path of the first token)

Between the two the worker begins the next task, so the group's stages work on several
requests at once; a `TaskInFlight` holds what a task has begun, and `decode`, where its
KV goes. On any failure the decode reservation is released, the uncommitted pool puts
are revoked and the cache blocks freed, after every write still on the wire ended: the
decode node never decodes from partial KV.
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
from mooncake.roles.prefill.handoff import DecodeHandoff, DecodeTarget
from mooncake.transfer import TransferEngine

log = logging.getLogger(__name__)


@dataclass
class TaskInFlight:
    """A task between `begin` and `finish`."""

    task: PrefillTaskMsg
    # NOTE: where its KV goes, as its admission answered (roles/prefill/role.py `_admit`):
    # the one place the prefill side holds it; `task`'s decode_node/decode_address say
    # where it was placed (or, tried again, where its KV went) and are read only to admit it
    decode: DecodeTarget
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
            r.rank_caches,
            self.kv_prefix,
            st.block_ids,
            plan,
            r.layout,
            self.writer,
            self.timeout_s,
        )

    def begin(
        self,
        task: PrefillTaskMsg,
        decode: DecodeTarget,
        answers: Answers | None,
        **start_kw: Any,
    ) -> TaskInFlight:
        """Everything up to this stage's last chunk; raises on failure (nothing held).
        `decode`: where its KV goes; `answers`: the link to the group's next stage (None: a
        group of one)."""
        prompt = task.prompt_ids[:-1]  # NOTE: the decode node computes the last token
        begun = TaskInFlight(task, decode, answers=answers)
        if not prompt:
            return begun
        st = begun.st = self.runner.start(prompt, req_id=task.req_id, **start_kw)
        try:
            begun.dest = self.handoff.reserve(task.req_id, decode, len(prompt))
            if self.pool is not None:
                bt = self.runner.cache.block_tokens
                first, full = st.first_store_block, len(prompt) // bt
                begun.targets = self.pool.start_objects(st.hashes[first:full], first)
            plan = StreamPlan(decode=begun.dest, pool=begun.targets)
            st.stream = self.streamer(st, plan)
            if answers is not None:
                begun.answer = answers.expect(task.req_id, has_plan=True)
                answers.sent(begun.answer, send_prompt(self.runner, st, answers.link, plan))
            else:
                n, chunk = len(prompt), self.runner.chunk_tokens
                for start in range(st.compute_start, n, chunk):
                    self.runner.run_chunk(st, start, min(start + chunk, n))
        except BaseException:
            self._undo(begun, finished=False)
            raise
        return begun

    def finish(self, begun: TaskInFlight) -> tuple[PrefillStats | None, int]:
        """The rest (module docstring); returns the prefill's stats and the KV bytes
        written to the decode node. Raises on failure (the task's holdings released)."""
        st, task = begun.st, begun.task
        if st is None:
            self.handoff.submit(task, begun.decode, None, [])
            return None, 0
        assert st.stream is not None
        finished = False
        try:
            if begun.answer is not None and begun.answers is not None:
                begun.answers.wait(begun.answer)
            self.runner.finish(st)
            finished = True
            reports = [st.stream.finish()]
            if begun.answer is not None:
                reports += begun.answer.reports.values()
            layer_tokens, digests, num_bytes = merge_reports(reports, self.runner.layout.num_layers)
            self.handoff.submit(task, begun.decode, begun.dest, layer_tokens)
            begun.dest = None  # NOTE: the decode node owns the blocks now
        except BaseException:
            self._undo(begun, finished)
            raise
        self.runner.cache.free(st.block_ids)
        submitted = time.perf_counter()
        if self.pool is not None and begun.targets:  # NOTE: after the submit: not on TTFT's path
            try:
                st.stats.num_stored_blocks = self.pool.seal_objects(
                    begun.targets, st.hashes, st.token_ids, digests
                )
            except MooncakeError as e:  # the pool misses these blocks; the request is fine
                log.warning(
                    "req %d: %d KV blocks not stored: %s", task.req_id, len(begun.targets), e
                )
        st.stats.seal_s = time.perf_counter() - submitted
        return st.stats, num_bytes

    def _undo(self, begun: TaskInFlight, finished: bool) -> None:
        """Release what `begun` holds, once none of its writes is on the wire."""
        st = begun.st
        if st is not None:
            if finished:  # NOTE: the runner let go of its state; the blocks are still ours
                if st.stream is not None:
                    st.stream.abort()
                self.runner.cache.free(st.block_ids)
            else:
                self.runner.abort(st)
        if begun.answer is not None and begun.answers is not None:
            begun.answers.forget(begun.answer)
        if begun.targets and self.pool is not None and st is not None:
            self.pool.revoke_objects(begun.targets, st.hashes)
        if begun.dest is not None:
            self.handoff.release(begun.task.req_id, begun.decode)

    def close(self) -> None:
        self.writer.close()

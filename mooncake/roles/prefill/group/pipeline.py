"""Chunked pipeline parallelism: prompts prefilled by a group of stages, several in flight.

Each stage owns a contiguous layer range. The first stage embeds chunk k, runs its layers
and sends the activations down the link while it computes chunk k+1; the next stage does
the same with its layers, and so on, so several chunks are in flight on different stages.
Only activations cross stages, once per chunk per boundary. Every stage reuses its own
layers of the prefix from the pool, and writes its own layers' KV out as they finish
(`kvstream`: to the decode node's reserved blocks and into the pool objects' replicas),
so no KV crosses a stage boundary.

The first stage does not wait for a prompt's answer before it starts the next prompt:
stage k computes request i's chunks while stage k-1 computes request i+1's.

- `send_prompt` runs the first stage's part of one prompt: BEGIN (and DEST, the stream
  plan), each chunk computed and sent, END;
- `Answers` collects what the later stages send back per request (RESULT: the last
  stage's logits and how many stages follow the first; WROTE: one stage's stream report;
  ERROR; KV when asked, for checks), for any number of requests in flight;
- `prefill_pipelined` is the two together for one prompt at a time;
- `stageserver.StageServer` runs a later stage: frames in from upstream, activations on
  downstream, answers relayed back up.

A later stage that cannot validate the reused blocks the first stage chose answers ERROR
with how many were good; the prompt is prefilled again with that much reuse.

Deadline: a later stage answers a prompt only after its END, when it has run every chunk
queued on it, so a waiter allows `stage_timeout_s` per chunk still unanswered for the next
frame; past that it raises `StageTimeoutError` (a stopped or cut-off stage never closes
the link by itself).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import Tensor

from mooncake.errors import ProtocolError, TransferError
from mooncake.kv.stream import StreamPlan, StreamReport
from mooncake.model.prefill import PrefillResult, PrefillRunner, PrefillState, ReuseMismatchError
from mooncake.roles.prefill.group.link import (
    RETURN_KV,
    BaseStageLink,
    FrameKind,
    StageFrame,
    StageTimeoutError,
)

log = logging.getLogger(__name__)
ERROR_REUSE = 1  # ERROR frame index: a later stage could not load the reused blocks


def send_prompt(
    runner: PrefillRunner,
    st: PrefillState,
    link: BaseStageLink,
    plan: StreamPlan | None = None,
    return_kv: bool = False,
) -> int:
    """The first stage's part of a prompt: computes every chunk on this thread and sends
    it down; returns the number of chunks (the answer's deadline scales with it)."""
    n, chunk = len(st.token_ids), runner.chunk_tokens
    flags = RETURN_KV if return_kv else 0
    tokens = torch.tensor(st.token_ids, dtype=torch.int64)  # the prompt, for later stages
    begin = StageFrame(
        FrameKind.BEGIN, st.req_id, start=st.compute_start, count=flags, tensor=tokens
    )
    link.send(begin)
    if plan is not None:
        link.send(StageFrame.packed(FrameKind.DEST, st.req_id, msgspec.msgpack.encode(plan)))
    num_chunks = 0
    for i, start in enumerate(range(st.compute_start, n, chunk)):
        end = min(start + chunk, n)
        h = runner.run_chunk(st, start, end)
        link.send(StageFrame(FrameKind.CHUNK, st.req_id, i, start, end - start, h))
        num_chunks += 1
    link.send(StageFrame(FrameKind.END, st.req_id))
    return max(1, num_chunks)


@dataclass
class Answer:
    """What the later stages sent back for one prompt."""

    req_id: int
    num_chunks: int
    has_plan: bool
    want_kv: bool
    logits: Tensor | None = None
    hops: int = -1  # later stages (from RESULT); -1 until it came
    reports: dict[int, StreamReport] = field(default_factory=dict)  # first layer -> report
    kv: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (layer, 0 K / 1 V)
    error: BaseException | None = None
    later_layers: int = 0  # layers after the first stage's: KV frames expected when asked

    @property
    def is_done(self) -> bool:
        if self.error is not None:
            return True
        if self.logits is None or (self.has_plan and len(self.reports) < self.hops):
            return False
        return not self.want_kv or len(self.kv) == 2 * self.later_layers

    def remote_kv(self) -> dict[int, tuple[Tensor, Tensor]]:
        layers = sorted({layer for layer, _ in self.kv})
        return {layer: (self.kv[(layer, 0)], self.kv[(layer, 1)]) for layer in layers}


class Answers:
    """The answers of every prompt in flight on one link. Waiters read the link on their
    own thread (one at a time) and file each frame under its request."""

    def __init__(
        self, link: BaseStageLink, num_later_layers: int, stage_timeout_s: float | None = None
    ):
        self.link, self.num_later_layers, self.timeout_s = link, num_later_layers, stage_timeout_s
        self._open: dict[int, Answer] = {}
        self._lock = threading.Lock()  # guards `_open` and `_broken`; never held on the link
        # NOTE: one reader of the link at a time; the worker registers the next prompt
        # (`expect`) while the completer reads the link for an earlier one
        self._reading = threading.Lock()
        self._broken: BaseException | None = None

    def expect(self, req_id: int, *, has_plan: bool, want_kv: bool = False) -> Answer:
        """Register a prompt before its first frame is sent."""
        a = Answer(req_id, 1, has_plan, want_kv, later_layers=self.num_later_layers)
        with self._lock:
            if self._broken is not None:
                raise TransferError(f"req {req_id}: {self._broken}")
            self._open[req_id] = a
        return a

    def sent(self, a: Answer, num_chunks: int) -> None:
        a.num_chunks = num_chunks

    def forget(self, a: Answer) -> None:
        with self._lock:
            self._open.pop(a.req_id, None)

    def wait(self, a: Answer) -> Answer:
        """Read the link until `a` is complete; raises its error (ReuseMismatchError,
        TransferError, StageTimeoutError)."""
        with self._reading:
            try:
                while not a.is_done:
                    with self._lock:
                        broken = self._broken
                    if broken is not None:
                        raise TransferError(f"req {a.req_id}: {broken}")
                    frame = self._next_frame(a.req_id)
                    with self._lock:
                        self._file(frame)
            except TransferError as e:
                with self._lock:
                    self._break(e)
            finally:
                with self._lock:
                    self._open.pop(a.req_id, None)
        if a.error is not None:
            raise a.error
        return a

    def _next_frame(self, req_id: int) -> StageFrame:
        if self.timeout_s is None:
            frame = self.link.recv()
        else:
            with self._lock:
                wait_s = self.timeout_s * sum(x.num_chunks for x in self._open.values())
            try:
                frame = self.link.recv(timeout=wait_s)
            except StageTimeoutError as e:
                raise StageTimeoutError(
                    f"req {req_id}: the next pipeline stage did not answer within {wait_s:g} s "
                    "([prefill] stage_timeout_s per chunk): it is stopped, overloaded or cut off"
                ) from e
        if frame is None:
            raise TransferError("the next pipeline stage closed the link")
        return frame

    def _file(self, frame: StageFrame) -> None:
        a = self._open.get(frame.req_id)
        if a is None:
            log.warning("dropping a stage frame of req %d, which nobody waits for", frame.req_id)
        elif frame.kind == FrameKind.ERROR and frame.index == ERROR_REUSE:
            a.error = ReuseMismatchError(frame.message, frame.count)
        elif frame.kind == FrameKind.ERROR:
            a.error = TransferError(f"req {a.req_id}: a pipeline stage failed: {frame.message}")
        elif frame.kind == FrameKind.RESULT and frame.tensor is not None:
            a.logits, a.hops = frame.tensor, frame.index
        elif frame.kind == FrameKind.WROTE:
            try:
                a.reports[frame.index] = msgspec.msgpack.decode(frame.payload, type=StreamReport)
            except msgspec.DecodeError as e:
                raise ProtocolError(f"req {a.req_id}: a malformed stream report: {e}") from e
        elif frame.kind == FrameKind.KV and frame.tensor is not None:
            a.kv[(frame.index, frame.start)] = frame.tensor

    def _break(self, e: TransferError) -> None:
        """The link failed: every prompt in flight on it fails with `e`."""
        self._broken = e
        for x in self._open.values():
            x.error = x.error or e


def prefill_pipelined(
    runner: PrefillRunner,
    token_ids: Sequence[int],
    link: BaseStageLink,
    *,
    req_id: int = 0,
    return_remote_kv: bool = False,
    stage_timeout_s: float | None = None,
    **start_kw: Any,
) -> PrefillResult:
    """Prefill one prompt through the stages behind `link`; `runner` is the first stage.
    Returns the last token's logits, this stage's blocks and (if asked) later stages' KV.
    `stage_timeout_s`: the answer's deadline per chunk (module docstring), None = no
    deadline; raises StageTimeoutError past it (this stage's blocks are freed)."""
    later = runner.layout.num_layers - len(runner.model.layer_ids)
    answers = Answers(link, later, stage_timeout_s)
    try:
        return _prefill_once(runner, token_ids, answers, req_id, return_remote_kv, start_kw)
    except ReuseMismatchError as e:
        log.warning("req %d: %s; prefilling again with less reuse", req_id, e)
        start_kw["max_reuse_blocks"] = e.num_good_blocks
        return _prefill_once(runner, token_ids, answers, req_id, return_remote_kv, start_kw)


def _prefill_once(
    runner: PrefillRunner,
    token_ids: Sequence[int],
    answers: Answers,
    req_id: int,
    want_kv: bool,
    start_kw: dict[str, Any],
) -> PrefillResult:
    st = runner.start(token_ids, req_id=req_id, **start_kw)
    try:
        a = answers.expect(req_id, has_plan=False, want_kv=want_kv)
        answers.sent(a, send_prompt(runner, st, answers.link, return_kv=want_kv))
        answers.wait(a)
        st.logits = a.logits
        result = runner.finish(st)
    except BaseException:
        runner.abort(st)
        raise
    result.remote_kv = a.remote_kv()
    return result

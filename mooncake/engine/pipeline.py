"""Chunked pipeline parallelism: one long prompt prefilled by a group of stages.

Each stage owns a contiguous layer range. The first stage embeds chunk k, runs its layers
and sends the activations down the link while it computes chunk k+1; the next stage does
the same with its layers, and so on, so several chunks are in flight on different stages.
Only activations cross stages, once per chunk per boundary. Every stage reuses and stores
the KV of its own layers itself (`PrefillRunner`'s layer-wise load and store).

- `prefill_pipelined` drives a prompt from the first stage and collects the last stage's
  logits (and, for checks, the later stages' KV);
- `StageServer` runs a later stage: frames in from upstream, activations on downstream,
  answers (RESULT, KV, ERROR) relayed back up.

A later stage that cannot validate the reused blocks the first stage chose answers ERROR
with how many were good; the driver prefills once more with that much reuse.

Deadline: a later stage answers only after the prompt's END, when it has run every chunk
still queued on it, so the driver waits up to `stage_timeout_s` per chunk for the first
answer frame and `stage_timeout_s` for each one after; past that it raises
`StageTimeoutError` (a stopped or cut-off stage never closes the link by itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from mooncake.engine.prefill import PrefillResult, PrefillRunner, PrefillState, ReuseMismatchError
from mooncake.engine.stagelink import (
    RETURN_KV,
    BaseStageLink,
    FrameKind,
    StageFrame,
    StageTimeoutError,
)
from mooncake.errors import TransferError

log = logging.getLogger(__name__)
ERROR_REUSE = 1  # ERROR frame index: a later stage could not load the reused blocks


def prefill_pipelined(
    runner: PrefillRunner,
    token_ids: Sequence[int],
    link: BaseStageLink,
    *,
    req_id: int = 0,
    return_remote_kv: bool = False,
    store_remote_kv: bool = False,
    stage_timeout_s: float | None = None,
    **start_kw: Any,
) -> PrefillResult:
    """Prefill a prompt through the stages behind `link`; `runner` is the first stage.
    Returns the last token's logits, this stage's blocks and (if asked) later stages' KV.
    `store_remote_kv`: later stages have no sink of their own; their layers come back to
    this stage and go into this stage's sink with its own (whole-model objects).
    `stage_timeout_s`: the answer's deadline per chunk (module docstring), None = no
    deadline; raises StageTimeoutError past it (this stage's blocks are freed)."""
    want_kv = return_remote_kv or store_remote_kv
    args = (runner, token_ids, link, req_id, want_kv, store_remote_kv, stage_timeout_s)
    try:
        return _prefill_once(*args, start_kw)
    except ReuseMismatchError as e:
        log.warning("req %d: %s; prefilling again with less reuse", req_id, e)
        start_kw["max_reuse_blocks"] = e.num_good_blocks
        return _prefill_once(*args, start_kw)


def _prefill_once(
    runner: PrefillRunner,
    token_ids: Sequence[int],
    link: BaseStageLink,
    req_id: int,
    return_remote_kv: bool,
    store_remote_kv: bool,
    timeout_s: float | None,
    start_kw: dict[str, Any],
) -> PrefillResult:
    st = runner.start(token_ids, req_id=req_id, **start_kw)
    n, chunk = len(st.token_ids), runner.chunk_tokens
    try:
        flags = RETURN_KV if return_remote_kv else 0
        link.send(
            StageFrame(
                FrameKind.BEGIN, req_id, start=st.compute_start, count=flags, tensor=st.tokens
            )
        )
        num_chunks = 0
        for i, start in enumerate(range(st.compute_start, n, chunk)):
            end = min(start + chunk, n)
            h = runner.run_chunk(st, start, end)
            link.send(StageFrame(FrameKind.CHUNK, req_id, i, start, end - start, h))
            num_chunks += 1
        link.send(StageFrame(FrameKind.END, req_id))
        st.logits, remote = _collect(
            runner, link, req_id, return_remote_kv, timeout_s, max(1, num_chunks)
        )
        if store_remote_kv:
            runner.store_layers(st, remote)
        result = runner.finish(st)
    except BaseException:
        runner.abort(st)
        raise
    result.remote_kv = remote
    return result


def _collect(
    runner: PrefillRunner,
    link: BaseStageLink,
    req_id: int,
    want_kv: bool,
    timeout_s: float | None,
    num_chunks: int,
) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """Read the later stages' answer: RESULT logits (and KV frames when asked), the first
    frame within `timeout_s` per chunk sent, each later one within `timeout_s`."""
    later = [
        layer for layer in range(runner.layout.num_layers) if layer not in runner.model.layer_ids
    ]
    expected = {(layer, half) for layer in later for half in (0, 1)} if want_kv else set()
    parts: dict[tuple[int, int], Tensor] = {}
    logits: Tensor | None = None
    wait_s = None if timeout_s is None else timeout_s * num_chunks
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while logits is None or expected - parts.keys():
        frame = _recv_by(link, deadline, req_id, wait_s)
        if frame is not None and frame.req_id == req_id and timeout_s is not None:
            wait_s = timeout_s  # NOTE: only our own frames extend the deadline
            deadline = time.monotonic() + timeout_s
        if frame is None:
            raise TransferError(f"req {req_id}: the next pipeline stage closed the link")
        if frame.req_id != req_id:
            log.warning(
                "dropping a stage frame of req %d while waiting for %d", frame.req_id, req_id
            )
        elif frame.kind == FrameKind.ERROR and frame.index == ERROR_REUSE:
            raise ReuseMismatchError(frame.message, frame.count)
        elif frame.kind == FrameKind.ERROR:
            raise TransferError(f"req {req_id}: a pipeline stage failed: {frame.message}")
        elif frame.kind == FrameKind.RESULT and frame.tensor is not None:
            logits = frame.tensor
        elif frame.kind == FrameKind.KV and frame.tensor is not None:
            parts[(frame.index, frame.start)] = frame.tensor
    layers = sorted({layer for layer, _ in parts})
    return logits, {layer: (parts[(layer, 0)], parts[(layer, 1)]) for layer in layers}


def _recv_by(
    link: BaseStageLink, deadline: float | None, req_id: int, wait_s: float | None
) -> StageFrame | None:
    if deadline is None:
        return link.recv()
    try:
        return link.recv(timeout=max(0.0, deadline - time.monotonic()))
    except StageTimeoutError as e:
        raise StageTimeoutError(
            f"req {req_id}: the next pipeline stage did not answer within {wait_s:g} s "
            "([prefill] stage_timeout_s per chunk): it is stopped, overloaded or cut off"
        ) from e


class StageServer:
    """Runs the frames of one upstream link through `runner` until the link closes."""

    def __init__(
        self,
        runner: PrefillRunner,
        upstream: BaseStageLink,
        downstream: BaseStageLink | None = None,
    ):
        assert runner.model.is_last == (downstream is None), "only the last stage has no next"
        self.runner, self.upstream, self.downstream = runner, upstream, downstream
        self._states: dict[int, PrefillState] = {}
        self._flags: dict[int, int] = {}
        self._failed: set[int] = set()  # requests answered with ERROR; their frames are dropped

    def serve(self) -> None:
        """Handle frames until upstream closes or breaks; then drop the requests it left
        half done (their KV blocks go back to the cache), close downstream, wait for its
        last answers, and close upstream (so the previous stage's relay ends too)."""
        relay = None
        if self.downstream is not None:
            relay = threading.Thread(target=self._relay_up, name="stage-relay", daemon=True)
            relay.start()
        try:
            self._serve_frames()
        finally:
            for req in list(self._states):  # NOTE: cut off by the link: nobody finishes them
                self._drop(req)
            self._failed.clear()
            if self.downstream is not None:
                self.downstream.close()
            if relay is not None:
                relay.join()
            self.upstream.close()

    def _serve_frames(self) -> None:
        while True:
            try:
                frame = self.upstream.recv()
            except TransferError as e:  # the upstream stage died or sent garbage
                log.warning("upstream stage link failed: %s", e)
                return
            if frame is None:
                return
            try:
                self._handle(frame)
            except Exception as e:  # a bad request never kills the stage
                log.exception("req %d failed on this stage", frame.req_id)
                self._drop(frame.req_id)
                self._failed.add(frame.req_id)
                reuse = isinstance(e, ReuseMismatchError)
                good = e.num_good_blocks if isinstance(e, ReuseMismatchError) else 0
                try:
                    self.upstream.send(
                        StageFrame.error(frame.req_id, str(e), good, ERROR_REUSE if reuse else 0)
                    )
                except TransferError as send_error:  # upstream is gone: nobody to tell
                    log.warning("upstream stage link failed: %s", send_error)
                    return

    def _handle(self, frame: StageFrame) -> None:
        req, runner, down = frame.req_id, self.runner, self.downstream
        if req in self._failed:
            if frame.kind == FrameKind.END:
                self._failed.discard(req)
            return
        if frame.kind == FrameKind.BEGIN:
            assert frame.tensor is not None
            self._states[req] = runner.start(
                frame.tensor.tolist(), req_id=req, reuse_tokens=frame.start
            )
            self._flags[req] = frame.count
            if down is not None:
                down.send(frame)
        elif frame.kind == FrameKind.CHUNK:
            h = runner.run_chunk(
                self._states[req], frame.start, frame.start + frame.count, frame.tensor
            )
            if down is not None:
                down.send(
                    StageFrame(FrameKind.CHUNK, req, frame.index, frame.start, frame.count, h)
                )
        elif frame.kind == FrameKind.END:
            st, flags = self._states.pop(req), self._flags.pop(req)
            if down is not None:
                down.send(frame)
            try:
                result = runner.finish(st)
                if flags & RETURN_KV:
                    self._send_kv(req, st)
                if result.logits is not None:
                    self.upstream.send(StageFrame(FrameKind.RESULT, req, tensor=result.logits))
            finally:
                runner.cache.free(st.block_ids)
        else:
            raise ValueError(f"unexpected {frame.kind.name} frame from upstream")

    def _send_kv(self, req: int, st: PrefillState) -> None:
        for layer in self.runner.model.layer_ids:
            k, v = self.runner.cache.gather(layer, st.block_ids, len(st.token_ids))
            self.upstream.send(StageFrame(FrameKind.KV, req, index=layer, start=0, tensor=k))
            self.upstream.send(StageFrame(FrameKind.KV, req, index=layer, start=1, tensor=v))

    def _drop(self, req: int) -> None:
        st = self._states.pop(req, None)
        self._flags.pop(req, None)
        if st is not None:
            self.runner.abort(st)

    def _relay_up(self) -> None:
        assert self.downstream is not None
        try:
            while (frame := self.downstream.recv()) is not None:
                self.upstream.send(frame)
        except TransferError as e:  # either neighbour is gone; `serve` winds down
            log.warning("stage relay ended: %s", e)

"""A later stage of a pipeline group: frames in from upstream, activations on downstream,
answers relayed back up (the other side of `pipeline`).

Per prompt: BEGIN starts it (the stage's own prefix reuse, as the first stage decided),
DEST gives it a stream plan (this stage writes its layers' KV where the plan says:
kv/stream.py), CHUNKs run through this stage's layers, END finishes it: the stage
waits for its writes and answers WROTE (its stream report), the last stage also RESULT
(logits, and how many stages the prompt went through). A failure answers ERROR, and the
prompt's later frames are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec

from mooncake.errors import ProtocolError, TransferError
from mooncake.kv.stream import KVStreamer, StreamPlan
from mooncake.model.prefill import PrefillRunner, PrefillState, ReuseMismatchError
from mooncake.roles.prefill.group.link import RETURN_KV, BaseStageLink, FrameKind, StageFrame
from mooncake.roles.prefill.group.pipeline import ERROR_REUSE

log = logging.getLogger(__name__)
# a later stage's streamer for a prompt and its plan
StreamerFactory = Callable[[PrefillState, StreamPlan], KVStreamer]


class StageServer:
    """Runs the frames of one upstream link through `runner` until the link closes.
    `streamer`: builds this stage's KV stream for a prompt whose leader sent a plan."""

    def __init__(
        self,
        runner: PrefillRunner,
        upstream: BaseStageLink,
        downstream: BaseStageLink | None = None,
        streamer: StreamerFactory | None = None,
    ):
        assert runner.model.is_last == (downstream is None), "only the last stage has no next"
        self.runner, self.upstream, self.downstream = runner, upstream, downstream
        self.streamer = streamer
        self._states: dict[int, PrefillState] = {}
        self._flags: dict[int, int] = {}
        self._hops: dict[int, int] = {}  # req -> this stage's distance from the first
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
                if frame.kind != FrameKind.END:  # NOTE: no frame of it follows its END
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
            self._flags[req], self._hops[req] = frame.count, frame.index + 1
            if down is not None:  # NOTE: `index` counts the stages the prompt went through
                down.send(
                    StageFrame(
                        FrameKind.BEGIN,
                        req,
                        frame.index + 1,
                        frame.start,
                        frame.count,
                        frame.tensor,
                    )
                )
        elif frame.kind == FrameKind.DEST:
            self._stream(self._states[req], frame)
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
            self._end(req, frame)
        else:
            raise ValueError(f"unexpected {frame.kind.name} frame from upstream")

    def _stream(self, st: PrefillState, frame: StageFrame) -> None:
        try:
            plan = msgspec.msgpack.decode(frame.payload, type=StreamPlan)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"req {frame.req_id}: a malformed stream plan: {e}") from e
        if self.streamer is None:
            raise TransferError(f"req {frame.req_id}: this stage cannot stream KV (no engine)")
        st.stream = self.streamer(st, plan)

    def _end(self, req: int, frame: StageFrame) -> None:
        st, flags, hops = self._states.pop(req), self._flags.pop(req), self._hops.pop(req)
        if self.downstream is not None:
            self.downstream.send(frame)
        try:
            try:
                result = self.runner.finish(st)
                report = st.stream.finish() if st.stream is not None else None
            except BaseException:
                if st.stream is not None:
                    st.stream.abort()
                raise
            if flags & RETURN_KV:
                self._send_kv(req, st)
            if report is not None:
                first = self.runner.model.first_layer
                payload = msgspec.msgpack.encode(report)
                self.upstream.send(StageFrame.packed(FrameKind.WROTE, req, payload, index=first))
            if result.logits is not None:
                self.upstream.send(
                    StageFrame(FrameKind.RESULT, req, index=hops, tensor=result.logits)
                )
        finally:
            self.runner.cache.free(st.block_ids)

    def _send_kv(self, req: int, st: PrefillState) -> None:
        for layer in self.runner.model.layer_ids:
            k, v = self.runner.cache.gather(layer, st.block_ids, len(st.token_ids))
            self.upstream.send(StageFrame(FrameKind.KV, req, index=layer, start=0, tensor=k))
            self.upstream.send(StageFrame(FrameKind.KV, req, index=layer, start=1, tensor=v))

    def _drop(self, req: int) -> None:
        st = self._states.pop(req, None)
        self._flags.pop(req, None)
        self._hops.pop(req, None)
        if st is not None:
            self.runner.abort(st)

    def _relay_up(self) -> None:
        assert self.downstream is not None
        try:
            while (frame := self.downstream.recv()) is not None:
                self.upstream.send(frame)
        except TransferError as e:  # either neighbour is gone; `serve` winds down
            log.warning("stage relay ended: %s", e)

"""A request's token stream from its decode node to the master: delivered once each and in
order, or given up with a clear end, never silently lost.

    number    the decode node numbers each request's events 0, 1, 2... (`TokenMsg.seq`)
    send      `Outbox` sends them in batches, one `master.tokens` call per batch on a
              thread of its own (a decode step never waits for the master), and keeps
              each event until the master acknowledges it
    ack       the master answers, per request, the seq below which it holds every event
              (`TokenAck.next_seq`, cumulative), or that it no longer tracks the request
              (`is_known` False: the decode node stops it)
    re-send   an event not acknowledged `[decode] token_resend_s` after it was sent goes
              again, at most `[decode] token_max_resends` times; then the decode node gives
              its request up, and the master's deadline ends the HTTP request with an error
    reorder   the master's `Inbox` per request hands events on in seq order, each once: a
              duplicate (a re-sent event that had arrived after all) is dropped, an event
              ahead of a gap waits for the gap to be filled

A stream ends when its final event (`TokenMsg.ends_request`: the finish of its last choice,
or an abort) is acknowledged.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from mooncake.errors import MooncakeError
from mooncake.roles.node.messages import TokenAck, TokenMsg

log = logging.getLogger(__name__)
MAX_AHEAD = 4096  # events a master's Inbox holds ahead of a gap (more wait to be re-sent)


@dataclass
class _Pending:
    tok: TokenMsg
    sent_at: float = -math.inf  # monotonic seconds of its last send (never: due at once)
    num_sends: int = 0


@dataclass
class _Stream:
    next_seq: int = 0
    pending: dict[int, _Pending] = field(default_factory=dict)  # seq -> not acknowledged
    is_ended: bool = False  # its final event is queued


class Outbox:
    """The decode node's side (thread-safe): the step loop `put`s events, `run` sends them
    on a thread of its own. `send` makes one `master.tokens` call (raising MooncakeError
    when it is lost); `on_dropped(req_id, why)` is told when a request's stream is dropped
    (the master does not track it, or an event went unacknowledged too often), for the node
    to stop that request."""

    def __init__(
        self,
        send: Callable[[list[TokenMsg]], list[TokenAck]],
        resend_s: float,
        max_resends: int,
        on_dropped: Callable[[int, str], None],
    ):
        self.send, self.resend_s, self.max_resends = send, resend_s, max_resends
        self.on_dropped = on_dropped
        # NOTE: guards _streams; held for work linear in the events of one batch, never
        # across a send
        self._cond = threading.Condition()
        self._streams: dict[int, _Stream] = {}
        self._is_closed = False
        self._is_failing = False  # the last send was lost (logged once per streak)

    def put(self, tokens: list[TokenMsg]) -> None:
        """Number `tokens` (each request's in order) and send them soon."""
        with self._cond:
            for tok in tokens:
                s = self._streams.setdefault(tok.req_id, _Stream())
                if s.is_ended:
                    continue  # NOTE: nothing follows a request's final event
                s.pending[s.next_seq] = _Pending(msgspec.structs.replace(tok, seq=s.next_seq))
                s.next_seq += 1
                s.is_ended = tok.ends_request
            self._cond.notify_all()

    def forget(self, req_id: int) -> None:
        """Forget a request's stream (the master ended it: nothing of it is awaited)."""
        with self._cond:
            self._streams.pop(req_id, None)
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget every stream (the master no longer tracks any of them)."""
        with self._cond:
            self._streams.clear()
            self._cond.notify_all()

    @property
    def num_streams(self) -> int:
        with self._cond:
            return len(self._streams)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued event is acknowledged or given up (True), or
        `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._streams, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    def run(self) -> None:
        """Send what is due until closed (the sender thread's body)."""
        while True:
            with self._cond:
                while True:
                    if self._is_closed:
                        return
                    batch, given_up, wait_s = self._take_due(time.monotonic())
                    if batch or given_up:
                        break
                    self._cond.wait(wait_s)
            for req_id in given_up:
                why = f"no acknowledgement from the master after {self.max_resends + 1} sends"
                log.error("req %d: given up: %s", req_id, why)
                self.on_dropped(req_id, why)
            if batch:
                self._send(batch)

    def _take_due(self, now: float) -> tuple[list[TokenMsg], list[int], float | None]:
        """Events due (never sent, or unacknowledged for resend_s), the requests given up,
        and how long until the next event is due (None: nothing is pending)."""
        batch: list[TokenMsg] = []
        given_up: list[int] = []
        next_due = math.inf
        for req_id, s in list(self._streams.items()):
            for p in s.pending.values():
                due = p.sent_at + self.resend_s
                if due > now:
                    next_due = min(next_due, due)
                    continue
                if p.num_sends > self.max_resends:
                    given_up.append(req_id)
                    del self._streams[req_id]
                    break
                p.sent_at, p.num_sends = now, p.num_sends + 1
                batch.append(p.tok)
        if given_up:
            self._cond.notify_all()
        return batch, given_up, None if next_due == math.inf else next_due - now

    def _send(self, batch: list[TokenMsg]) -> None:
        try:
            acks = self.send(batch)
        except MooncakeError as e:  # NOTE: they are due again after resend_s
            if not self._is_failing:
                log.warning("%d token events not acknowledged (sent again): %s", len(batch), e)
            self._is_failing = True
            return
        self._is_failing = False
        unknown = []
        with self._cond:
            for a in acks:
                s = self._streams.get(a.req_id)
                if s is None:
                    continue
                if not a.is_known:
                    del self._streams[a.req_id]
                    unknown.append(a.req_id)
                    continue
                for seq in [q for q in s.pending if q < a.next_seq]:
                    del s.pending[seq]
                if s.is_ended and not s.pending:
                    del self._streams[a.req_id]
            self._cond.notify_all()
        for req_id in unknown:
            self.on_dropped(req_id, "the master no longer tracks it")


class Inbox:
    """The master's side of one request's stream: `accept` returns the events now due to
    the client, in seq order, each once. Not thread-safe: its owner guards it."""

    def __init__(self) -> None:
        self.next_seq = 0  # every event below it was handed on
        self._ahead: dict[int, TokenMsg] = {}

    def accept(self, tok: TokenMsg) -> list[TokenMsg]:
        if tok.seq < self.next_seq or tok.seq in self._ahead:
            return []  # a duplicate: a re-sent event that had arrived
        if len(self._ahead) >= MAX_AHEAD and tok.seq != self.next_seq:
            return []  # NOTE: not acknowledged, so it is sent again once the gap is filled
        self._ahead[tok.seq] = tok
        ready = []
        while (t := self._ahead.pop(self.next_seq, None)) is not None:
            ready.append(t)
            self.next_seq += 1
        return ready

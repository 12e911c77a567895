"""The token stream's delivery protocol (roles/node/delivery.py): a decode node's `Outbox` on
its sender thread against a master's `Inbox` per request, with events lost on the way.
The "master" here is the Inbox logic the real one runs (`Flights.receive`), called in
process; tests/roles/test_delivery_faults.py runs the same over real processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from mooncake.errors import RpcTimeout
from mooncake.roles.node.delivery import Inbox, Outbox
from mooncake.roles.node.messages import TokenAck, TokenMsg

pytestmark = pytest.mark.timeout(30)


def _tok(req_id: int, token_id: int, final: bool = False) -> TokenMsg:
    return TokenMsg(req_id, token_id, str(token_id), finish_reason="length" if final else None)


def test_the_inbox_hands_events_on_in_order_each_once() -> None:
    box = Inbox()
    ev = [TokenMsg(1, i, "", seq=i) for i in range(4)]
    assert box.accept(ev[1]) == [] and box.next_seq == 0  # ahead of a gap: it waits
    assert box.accept(ev[2]) == []
    assert box.accept(ev[0]) == ev[:3] and box.next_seq == 3
    assert box.accept(ev[1]) == []  # a duplicate (sent again): dropped
    assert box.accept(ev[3]) == [ev[3]] and box.next_seq == 4


class _Master:
    """The master's side: an Inbox per request; `drop(tok, num_sends)` says which
    arrivals are lost (`num_sends` counts this event's arrivals, 1 for the first)."""

    def __init__(self, drop: Callable[[TokenMsg, int], bool], known: set[int] | None = None):
        self.drop, self.known = drop, known
        self.inboxes: dict[int, Inbox] = {}
        self.delivered: list[TokenMsg] = []
        self.arrivals: dict[tuple[int, int], int] = {}
        self.lock = threading.Lock()

    def send(self, tokens: list[TokenMsg]) -> list[TokenAck]:
        acks = {}
        with self.lock:
            for t in tokens:
                n = self.arrivals[t.req_id, t.seq] = self.arrivals.get((t.req_id, t.seq), 0) + 1
                if self.known is not None and t.req_id not in self.known:
                    acks[t.req_id] = TokenAck(t.req_id, 0, is_known=False)
                    continue
                box = self.inboxes.setdefault(t.req_id, Inbox())
                if not self.drop(t, n):
                    self.delivered += box.accept(t)
                acks[t.req_id] = TokenAck(t.req_id, box.next_seq)
        return list(acks.values())


@contextmanager
def _outbox(
    master: _Master, dropped: list[tuple[int, str]], max_resends: int = 5
) -> Iterator[Outbox]:
    box = Outbox(master.send, 0.05, max_resends, lambda r, why: dropped.append((r, why)))
    sender = threading.Thread(target=box.run, daemon=True)
    sender.start()
    try:
        yield box
    finally:
        box.close()
        sender.join()


def test_a_lost_final_event_is_sent_again_and_delivered_once() -> None:
    """The master loses the first arrival of request 1's final event and of request 2's
    second one: both are sent again; each request's events reach it once, in order."""
    master = _Master(drop=lambda t, n: n == 1 and (t.req_id, t.seq) in ((1, 2), (2, 1)))
    dropped: list[tuple[int, str]] = []
    with _outbox(master, dropped) as box:
        box.put([_tok(1, 10), _tok(2, 20)])
        box.put([_tok(1, 11), _tok(2, 21)])
        box.put([_tok(1, 12, final=True), _tok(2, 22, final=True)])
        assert box.flush(10.0)
    for req_id in (1, 2):
        got = [(t.seq, t.token_id) for t in master.delivered if t.req_id == req_id]
        assert got == [(0, req_id * 10), (1, req_id * 10 + 1), (2, req_id * 10 + 2)]
    assert master.arrivals[1, 2] == 2 and master.arrivals[2, 1] >= 2  # sent again
    assert dropped == [] and box.num_streams == 0


def test_an_event_never_acknowledged_gives_its_request_up_after_the_bound() -> None:
    master = _Master(drop=lambda t, n: t.req_id == 5)  # request 5's events are all lost
    dropped: list[tuple[int, str]] = []
    with _outbox(master, dropped, max_resends=2) as box:
        box.put([_tok(5, 1), _tok(6, 1, final=True)])
        assert box.flush(10.0)
    assert master.arrivals[5, 0] == 3  # the first send and 2 more, then no more
    assert dropped == [(5, "no acknowledgement from the master after 3 sends")]
    assert [(t.req_id, t.token_id) for t in master.delivered] == [(6, 1)]


def test_a_request_the_master_does_not_track_is_dropped_at_once() -> None:
    master = _Master(drop=lambda t, n: False, known={8})
    dropped: list[tuple[int, str]] = []
    with _outbox(master, dropped) as box:
        box.put([_tok(7, 1), _tok(8, 1, final=True)])
        assert box.flush(10.0)
    assert dropped == [(7, "the master no longer tracks it")]
    assert master.arrivals[7, 0] == 1


def test_a_stream_the_master_ended_is_forgotten() -> None:
    """A request the master aborted (its client left) never sends its final event: its
    stream is forgotten, so the node does not wait for it when it drains or stops."""
    master = _Master(drop=lambda t, n: False)
    dropped: list[tuple[int, str]] = []
    with _outbox(master, dropped) as box:
        box.put([_tok(4, 1), _tok(5, 1, final=True)])
        assert not box.flush(0.5) and box.num_streams == 1  # request 4 has not ended
        box.forget(4)
        assert box.flush(10.0) and box.num_streams == 0


def test_events_wait_out_an_unreachable_master_and_nothing_follows_a_final_one() -> None:
    master = _Master(drop=lambda t, n: False)
    down = threading.Event()
    down.set()

    def send(tokens: list[TokenMsg]) -> list[TokenAck]:
        if down.is_set():
            down.clear()  # NOTE: the first call is lost, as a timeout says
            raise RpcTimeout("no reply from tcp://master to master.tokens within 5 s")
        return master.send(tokens)

    dropped: list[tuple[int, str]] = []
    box = Outbox(send, 0.05, 5, lambda r, why: dropped.append((r, why)))
    sender = threading.Thread(target=box.run, daemon=True)
    sender.start()
    box.put([_tok(3, 1), _tok(3, 2, final=True), _tok(3, 9)])  # 9 follows the end: ignored
    assert box.flush(10.0)
    box.close()
    sender.join()
    assert [t.token_id for t in master.delivered] == [1, 2] and dropped == []

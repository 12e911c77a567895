"""The master's miss attribution (roles/master/attribution.py) on a real prefix index fed by store
events: every request's blocks add up (cold + evicted + elsewhere + unverified + hit =
blocks requested), whatever the pool did between its placement, its start and its
report; the totals are the sum of the requests'; the ledger stays within its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.conductor.index import IndexUpdate, PrefixIndex
from mooncake.conductor.misses import CAUSES, ELSEWHERE_PARTS
from mooncake.conductor.types import Decision
from mooncake.roles.master.attribution import Attribution

BT = 4  # tokens per block
NODES = ("a", "b", "c")

_hashes = st.lists(st.integers(0, 11), min_size=1, max_size=6)
_op = st.one_of(
    st.tuples(st.just("added"), st.sampled_from(NODES), _hashes),
    st.tuples(st.just("evicted"), st.sampled_from(NODES), _hashes),
    st.tuples(st.just("node_gone"), st.sampled_from(NODES), st.just([])),
    # a request: its prompt (block hashes), its reuse (a share of what it could), is the
    # token check failed, and how many pool changes happen after placement / after start
    st.tuples(
        st.just("request"),
        st.lists(st.integers(0, 11), min_size=0, max_size=8),
        st.floats(0, 1),
        st.booleans(),
        st.integers(0, 2),
        st.integers(0, 2),
    ),
)


def _store(index: PrefixIndex, attr: Attribution, kind: str, node: str, hs: list, t: float):
    index.apply(IndexUpdate(kind=kind, node=node, block_hashes=tuple(hs)))  # type: ignore[arg-type]
    if kind == "node_gone":
        attr.event(kind, None, t)
    for h in hs:
        attr.event(kind, h, t)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40), memory=st.integers(0, 5))
def test_every_requests_blocks_add_up(ops: list, memory: int) -> None:
    index = PrefixIndex()
    attr = Attribution(index, BT)
    attr.configure(memory)
    pool_ops = [op for op in ops if op[0] != "request"]
    seen = dict.fromkeys((*CAUSES, *ELSEWHERE_PARTS), 0)
    t, rid = 0.0, 0
    for op in ops:
        t += 1.0
        if op[0] != "request":
            _store(index, attr, op[0], op[1], op[2], t)
        else:
            _, hashes, reuse, is_unverified, later, after_start = op
            rid += 1
            prompt_len = len(hashes) * BT + 2  # every block reusable, the last token not
            full = index.bit("a") | index.bit("b") | index.bit("c")
            best = index.pool_prefix_len(hashes, full)
            d = Decision(req_id=rid, is_accepted=True, best_blocks=best, reused_blocks=best // 2)
            attr.placed(rid, prompt_len, hashes, d)
            for k in range(later):  # the pool changes before the prefill starts
                if pool_ops:
                    kind, node, hs = pool_ops[(rid + k) % len(pool_ops)]
                    _store(index, attr, kind, node, hs, t)
            attr.started(rid)
            for k in range(after_start):
                if pool_ops:
                    kind, node, hs = pool_ops[(rid * 7 + k) % len(pool_ops)]
                    _store(index, attr, kind, node, hs, t)
            hit = int(reuse * len(hashes))
            c = attr.finished(rid, hit * BT, is_unverified, t)
            assert c is not None
            assert c.hit + c.cold + c.evicted + c.elsewhere + c.unverified == len(hashes), c
            assert c.hit == hit and min(c.cold, c.evicted, c.elsewhere, c.unverified) >= 0
            assert c.priced_out + c.plan_lost + c.after_placement == c.elsewhere, c
            assert min(c.priced_out, c.plan_lost, c.after_placement) >= 0, c
            assert len(c.evicted_age_s) <= c.evicted and all(a >= 0 for a in c.evicted_age_s)
            assert c.unverified == 0 or (is_unverified and hit < len(hashes))
            for name in seen:
                seen[name] += getattr(c, name)
        index.check_integrity()
        attr.ledger.check_integrity()
    assert attr.totals == seen and attr.num_requests == rid
    shares = attr.shares()
    assert shares.blocks == sum(seen[c] for c in CAUSES)
    assert not attr._pending  # every request reported


def test_a_request_not_seen_starting_is_not_counted() -> None:
    """A report for a request placed again (forgotten) or never started counts nothing."""
    index = PrefixIndex()
    attr = Attribution(index, BT)
    d = Decision(req_id=1, is_accepted=True)
    attr.placed(1, 10 * BT, list(range(10)), d)
    assert attr.finished(1, 0, False, 1.0) is None  # placed, never started
    attr.placed(2, 10 * BT, list(range(10)), d)
    attr.started(2)
    attr.forget(2)
    assert attr.finished(2, 0, False, 1.0) is None and attr.num_requests == 0

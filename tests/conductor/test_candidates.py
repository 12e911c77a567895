"""The bounded candidate set (Algorithm 1, decode placement, the pool's totals) decides as
the full scan does: the same instances, the same predicted times, every step of a run."""

import random

from mooncake.conductor import Conductor, ConductorParams, ScheduleRequest
from mooncake.conductor.candidates import MAX_EXPLICIT, LoadOrder, Prices, choose
from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.load import PrefillQueue
from mooncake.conductor.placement import place_decode
from tests.conductor.toy import toy_cost_file


def _fleet(seed: int, full_scan: bool) -> Conductor:
    """A random fleet: prefill instances with mixed link speeds, decode instances (also
    pool nodes) with mixed KV room; the same seed builds the same fleet."""
    rng = random.Random(seed)
    params = ConductorParams(
        ttft_slo_s=rng.choice((5.0, 1e9)),
        tbt_slo_s=1.0,
        balancing_threshold=rng.choice((1.0, 1.5, 3.0)),
        block_tokens=100,
        full_scan=full_scan,
        rejection=rng.choice(("none", "basic", "predictive")),
        stages=rng.choice((1, 1, 2, 4)),
        chunk_tokens=rng.choice((0, 150)),
        speed_ewma=rng.choice((0.0, 0.5)),
    )
    c = Conductor(params, CostModel(toy_cost_file(link_bytes_per_s=1000.0)))
    for i in range(rng.randint(1, 3 * MAX_EXPLICIT)):
        c.add_prefill_instance(f"p{i}", rng.choice((None, None, 500.0, 4000.0)))
    for i in range(rng.randint(1, 24)):
        c.add_decode_instance(f"d{i}", rng.choice((3_000, 10_000, 100_000)))
    return c


def _blocks(rng: random.Random, c: Conductor) -> list[list[int]]:
    """Index prefix chains behind one shared first block (a system prompt) held by many
    nodes, some on SSD; returns the chains."""
    nodes = [q.name for q in c.prefill] + [s.name for s in c.decode]
    shared = rng.sample(nodes, rng.randint(0, len(nodes)))
    for node in shared:
        c.index.add(node, [0])
    chains = []
    for k in range(rng.randint(1, 12)):
        chain = [0] + [1000 * (k + 1) + j for j in range(rng.randint(1, 12))]
        for node in rng.sample(nodes, rng.randint(0, 3)):
            cut = rng.randint(1, len(chain))
            c.index.add(node, chain[:cut], rng.choice(("dram", "dram", "ssd")))
        chains.append(chain)
    return chains


def _run(seed: int, full_scan: bool) -> list[tuple]:
    """Drive one fleet through random requests, progress reports, decode reports and
    transfers; returns every decision's fields."""
    c = _fleet(seed, full_scan)
    rng = random.Random(seed + 1)
    chains = _blocks(rng, c)
    # NOTE: a clock far from 0 (as the master's) makes drain times round coarsely
    out, live, now = [], [], rng.choice((0.0, 0.0, 3e4, 1.7e9))
    stage: dict[int, int] = {}  # request -> 0 scheduled, 1 prefilling, 2 decoding
    for rid in range(rng.randint(10, 80)):
        now += rng.choice((0.0, 0.0, 1e-3, 0.01, 0.3, 2.0))
        chain = rng.choice(chains)
        hashes = chain[: rng.randint(1, len(chain))] + [rid * 10**6 + j for j in range(3)]
        hashes = hashes if rng.random() < 0.9 else [rid * 10**6 + 7]
        d = c.schedule(ScheduleRequest(rid, len(hashes) * 100 - rng.randint(0, 99), hashes), now)
        out.append(tuple(getattr(d, f) for f in d.__struct_fields__))
        if d.is_accepted:
            live.append(rid)
            if d.fetch_from:
                c.network.reserve(d.fetch_from, d.prefill, d.fetch_blocks * 100, now)
        for r in list(live):  # each moves one step along its life, or is dropped
            x, step = rng.random(), stage.get(r, 0)
            if x < 0.03:
                c.on_request_dropped(r, now)
            elif x < 0.3 and step == 0:
                prefill_s = rng.choice((None, None, rng.uniform(0.0, 2.0)))
                if not c.admit_prefill(r, now, prefill_s).is_accepted:
                    live.remove(r)
                    continue
            elif x < 0.3 and step == 1:
                c.on_prefill_finished(r, now)
                c.on_decode_started(r, now)
            elif x < 0.3 and step == 2:
                c.on_decode_finished(r, now)
            else:
                continue
            stage[r] = step + 1
            if x < 0.03 or step == 2:
                live.remove(r)
        for s in rng.sample(c.decode, min(2, len(c.decode))):
            kv = s.active_tokens + rng.randint(0, 500)
            c.on_decode_report(s.name, kv, len(s.active), 0.05, now)
        c.check_integrity()
    return out


def test_bounded_decisions_equal_the_full_scan_on_random_fleets():
    """120 random fleets, each through a random run: every decision (prefill and decode
    instance, reuse, fetch source, predicted TTFT and TBT, loads, rejection) is the full
    scan's."""
    for seed in range(120):
        assert _run(seed, full_scan=False) == _run(seed, full_scan=True), seed


def test_bounded_decode_placement_equals_the_scan_with_idle_ties():
    """An idle fleet ties every decode instance: the bounded walk takes the first, as the
    scan does, and prefers an instance with room over a faster one without."""
    rng = random.Random(7)
    c = _fleet(3, full_scan=False)
    step = c.cost.step_fn
    for k in range(300):
        s = rng.choice(c.decode)
        if rng.random() < 0.5:
            s.reserve(("r", k), rng.randint(1, 4_000))
        elif s.reserved:
            s.release(next(iter(s.reserved)))
        input_len = rng.randint(1, 20_000)
        want, want_t, _ = place_decode(c.decode, step, input_len, 1.0)
        got, got_t = c._decode_order.place(c.decode, step, input_len, 1.0)
        assert (got.name, got_t) == (want.name, want_t), k


def test_each_queues_bound_is_below_its_queue_time_as_floats():
    """Whichever list a queue is in, its bound (the floor, or drain - now less the margin)
    is at most T_queue as `queue_time` computes it, on clocks near 0 and far from it, at
    times before, within and after the running request's first stage."""
    rng = random.Random(11)
    for _ in range(300):
        order = LoadOrder()
        queues = [PrefillQueue(f"p{i}", 1 << i, order=order) for i in range(8)]
        order.rebuild(queues)
        origin = rng.choice((0.0, 1.0, 3e4, 1.7e9, 2.5e12))
        now = origin
        for k in range(40):
            q = rng.choice(queues)
            x = rng.random()
            if x < 0.4:
                q.add(k, rng.choice((rng.uniform(0.0, 3.0), 1e-9, 0.1 + 0.2)))
            elif x < 0.7 and q.req_s:
                q.start(rng.choice(list(q.req_s)), now, rng.choice((None, rng.uniform(0, 2))))
            elif x < 0.85 and q.req_s:
                q.finish(rng.choice(list(q.req_s)), now)
            now += rng.choice((0.0, 1e-7, 1e-3, 0.1, 1.0))
            order.advance(now)
            order.check(queues)
            for key, i in order.floors:
                assert key <= queues[i].queue_time(now), (key, i, now)
            for key, i in order.drains:
                assert order.drain_bound(key, now) <= queues[i].queue_time(now), (key, i, now)


def test_a_busy_fleet_prices_the_queues_that_drain_first():
    """256 instances, each running a first stage that ends at a different time (every floor
    is 0): the walk goes by drain time and prices the two that drain first, not the
    fleet; the choice is the one with the least queue."""
    order = LoadOrder()
    queues = [PrefillQueue(f"p{i}", 1 << i, order=order) for i in range(256)]
    order.rebuild(queues)
    rng = random.Random(5)
    lengths = [1.0 + rng.random() for _ in queues]
    for i, q in enumerate(queues):
        q.add(("r", i), lengths[i])
        q.start(("r", i), 0.0)
    priced: list[int] = []
    now = 0.5

    def queue_s(i: int) -> float:
        priced.append(i)
        return queues[i].queue_time(now)

    prices = Prices(
        threshold=1.0,
        can_fetch=False,
        best_len=0,
        best_idx=-1,
        queue_s=queue_s,
        recompute_s=lambda blocks: 0.2,
        transfer_s=lambda src, dst, blocks: 0.0,
        transfer_floor_s=lambda blocks: 0.0,
    )
    plan = choose(prices, {}, [], [q.bit for q in queues], order, now)
    first = min(range(256), key=lengths.__getitem__)
    assert plan.idx == first
    assert plan.ttft_s == queues[first].queue_time(now) + 0.2
    assert len(priced) <= 2, priced

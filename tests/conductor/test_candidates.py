"""The bounded candidate set (Algorithm 1, decode placement, the pool's totals) decides as
the full scan does: the same instances, the same predicted times, every step of a run."""

import random

from mooncake.conductor import Conductor, ConductorParams, ScheduleRequest
from mooncake.conductor.candidates import MAX_EXPLICIT
from mooncake.conductor.costmodel import CostModel
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
    out, live, now = [], [], 0.0
    stage: dict[int, int] = {}  # request -> 0 scheduled, 1 prefilling, 2 decoding
    for rid in range(rng.randint(10, 80)):
        now += rng.choice((0.0, 0.0, 0.01, 0.3, 2.0))
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
                if not c.admit_prefill(r, now).is_accepted:
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

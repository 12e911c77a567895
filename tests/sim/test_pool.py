"""The simulated pool: exact LRU eviction order, demotion to SSD, and index events."""

import random
from collections import OrderedDict

from mooncake.conductor import PrefixIndex
from mooncake.sim.pool import NodePool, SimPool
from tests.store.helpers import make_service, put


def test_dram_evictions_demote_to_ssd_and_report_to_the_index():
    idx = PrefixIndex()
    pool = NodePool("n", dram_blocks=2, ssd_blocks=2, index=idx)
    pool.store([1, 2, 3], 0.0)  # 1 is demoted
    assert pool.ssd is not None
    assert list(pool.top.blocks) == [2, 3] and list(pool.ssd.blocks) == [1]
    assert idx.holders(1) == {"n": "ssd"} and idx.holders(3) == {"n": "dram"}
    pool.store([4, 5], 0.0)  # 2, 3 demoted; SSD overflows and drops 1
    assert list(pool.ssd.blocks) == [2, 3] and idx.holders(1) == {}
    assert pool.num_evicted == 1
    assert pool.prefix_len([4, 5]) == 2 and pool.prefix_len([1, 2]) == 0
    pool.store([2], 0.0)  # read back from SSD: promoted (leaving room there), 4 demoted
    assert list(pool.top.blocks) == [5, 2] and list(pool.ssd.blocks) == [3, 4]
    assert idx.holders(2) == {"n": "dram"} and idx.holders(4) == {"n": "ssd"}
    pool.check_integrity()
    idx.check_integrity()


def test_a_request_longer_than_the_tier_keeps_its_tail():
    idx = PrefixIndex()
    pool = NodePool("n", dram_blocks=2, index=idx)
    pool.store([1, 2, 3, 4], 0.0)
    assert list(pool.top.blocks) == [3, 4] and len(idx) == 2
    idx.check_integrity()


def _shared(nodes: int, dram: int, ssd: int = 0, budget: float = 0.5):
    idx = PrefixIndex()
    pool = SimPool(idx, replica_budget=budget)
    return idx, pool, [NodePool(f"n{i}", dram, ssd, pool=pool) for i in range(nodes)]


def test_one_pool_wide_order_evicts_the_oldest_block_and_the_writer_keeps_its_new_one():
    """A full writer does not drop its own recent blocks while another node holds older,
    nor send its new block there: its own oldest block moves where the pool's oldest was."""
    idx, pool, (a, b) = _shared(2, 2)
    b.store([1, 2], 0.0)  # oldest
    a.store([3, 4], 1.0)
    a.store([5], 2.0)  # pool full: 1 (on b) is the pool's least recently used
    assert idx.holders(1) == {} and idx.holders(5) == {"n0": "dram"}
    assert idx.holders(3) == {"n1": "dram"}  # a's oldest, relocated
    assert set(a.top.blocks) == {4, 5} and set(b.top.blocks) == {2, 3}
    b.touch([2], 3.0)  # 3 is the oldest now (it kept its place), on b
    b.store([6], 4.0)  # the pool's oldest is the writer's own: evicted as usual
    assert idx.holders(3) == {} and idx.holders(6) == {"n1": "dram"}
    assert pool.num_relocated == 1
    pool.check_integrity()
    idx.check_integrity()


def test_the_pool_holds_one_global_lru_and_each_writer_its_new_blocks():
    """Random writes (new blocks and blocks held anywhere) by random writers: the pool
    holds exactly what one global LRU of its capacity holds, and every block a write
    added is on its writer."""
    rng = random.Random(3)
    idx, pool, nodes = _shared(4, 5)
    lru: OrderedDict[int, None] = OrderedDict()
    next_block = 0
    for step in range(600):
        writer = rng.choice(nodes)
        held = list(lru)
        blocks = [rng.choice(held) for _ in range(rng.randrange(3))] if held else []
        new = list(range(next_block, next_block + rng.randrange(1, 5)))
        next_block += len(new)
        writer.store(blocks + new, float(step))
        for h in blocks + new:
            lru[h] = None
            lru.move_to_end(h)
            while len(lru) > 20:
                lru.popitem(last=False)
        assert set(pool.order.copies) == set(lru), step
        assert set(new) <= set(writer.top.blocks), step
        pool.check_integrity()
    assert pool.num_relocated > 100
    idx.check_integrity()


def test_a_block_is_written_once_and_duplicates_go_before_last_copies():
    idx, pool, (a, b, c) = _shared(3, 2)
    a.store([1, 2], 0.0)
    b.store([1, 2], 1.0)  # the pool holds them: refreshed, not copied ("exists")
    assert idx.holders(1) == {"n0": "dram"} and len(b.top) == 0
    assert b.replicate([1], 2.0) == 1  # a hot-spot replica: a duplicate of 1
    c.store([3, 4], 3.0)
    b.store([5], 4.0)  # the last free block
    b.store([6], 5.0)  # 2 is the oldest block, but b's copy of 1 is spare: it goes first
    assert idx.holders(1) == {"n0": "dram"} and idx.holders(2) == {"n0": "dram"}
    assert idx.holders(6) == {"n1": "dram"}
    c.store([7], 6.0)  # no duplicates left: the pool's oldest last copy, 2 (used at 1 s)
    assert idx.holders(2) == {} and idx.holders(7) == {"n2": "dram"}
    assert idx.holders(3) == {"n0": "dram"}  # c's oldest took 2's place
    pool.check_integrity()
    idx.check_integrity()


def test_replicas_stay_within_the_budget():
    idx, pool, (a, b) = _shared(2, 4, budget=0.25)  # 8 blocks of memory: 2 duplicates
    a.store([1, 2, 3], 0.0)
    assert b.replicate([1, 2, 3], 1.0) == 2
    assert set(b.top.blocks) == {1, 2} and pool.order.dup_units["dram"] == 2
    _, pool0, (c, d) = _shared(2, 4, budget=0.0)
    c.store([1], 0.0)
    assert d.replicate([1], 1.0) == 0
    pool.check_integrity()


def test_memory_victims_are_demoted_to_ssd_before_the_pool_drops_anything():
    idx, pool, (a, b) = _shared(2, 1, ssd=1)
    a.store([1], 0.0)
    b.store([2], 1.0)
    a.store([3], 2.0)  # 1 (pool's oldest) goes down to its node's SSD
    assert idx.holders(1) == {"n0": "ssd"} and pool.has_ssd
    a.store([4], 3.0)  # 2 goes down to b's SSD, 3 takes its place: nothing dropped yet
    assert idx.holders(2) == {"n1": "ssd"} and idx.holders(3) == {"n1": "dram"}
    assert len(pool.order.copies) == 4
    b.store([5], 4.0)  # memory victim 3 needs SSD room: the SSD's oldest (1) is dropped
    assert idx.holders(1) == {} and idx.holders(3) == {"n0": "ssd"}
    assert idx.holders(5) == {"n1": "dram"} and len(pool.order.copies) == 4
    pool.check_integrity()
    idx.check_integrity()


def test_the_simulated_pool_holds_what_the_store_would_hold():
    """The same writes and reads on the simulator's pool and on the Store's metadata (one
    block = one object, DRAM only) leave the same blocks on the same nodes: the simulator
    runs the Store's eviction order and placement."""
    rng = random.Random(7)
    idx = PrefixIndex()
    pool = SimPool(idx)
    nodes = [NodePool(f"n{i}", 4, pool=pool) for i in range(3)]
    svc = make_service({f"n{i}": {"dram": 4 * 64} for i in range(3)}, lease_ttl_s=0.001)
    next_block = 0
    for step in range(400):
        now = float(step)
        writer = rng.randrange(3)
        seen = [int(k) for k in svc.objects]
        blocks = [rng.choice(seen) for _ in range(rng.randrange(3))] if seen else []
        for _ in range(rng.randrange(1, 4)):
            blocks.append(next_block)
            next_block += 1
        if rng.random() < 0.3 and seen:  # a read of a block wherever it is (a fetch)
            h = rng.choice(seen)
            nodes[writer].touch([h], now)
            assert svc.get_replicas(str(h), now).status == "ok"
            continue
        nodes[writer].store(blocks, now)
        for h in blocks:
            if str(h) in svc.objects:
                assert svc.get_replicas(str(h), now).status == "ok"
            else:  # NOTE: after the reads' leases (the simulator has none)
                assert put(svc, str(h), 64, now=now + 0.5, writer=f"n{writer}") == "ok"
        for node in nodes:
            want = {str(h) for h in node.top.blocks}
            assert svc.space.segments[f"{node.node}-dram"].keys == want, (step, node.node)
    pool.check_integrity()
    idx.check_integrity()

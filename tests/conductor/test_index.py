"""The global prefix index follows store events exactly and answers prefix matches."""

from mooncake.conductor import IndexUpdate, PrefixIndex

BIG = (1 << 127) + 12345  # the real cluster's hashes are 128-bit ints


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    idx.apply(IndexUpdate(kind="added", node="a", block_hashes=(1, 2, 3, BIG), tier="dram"))
    idx.apply(IndexUpdate(kind="added", node="b", block_hashes=(1, 2), tier="vram"))
    idx.check_integrity()
    return idx


def test_added_blocks_are_matched_per_node():
    idx = _index()
    bits = [idx.bit("a"), idx.bit("b"), idx.bit("c")]
    assert idx.prefix_lens([1, 2, 3, BIG, 9], bits) == [4, 2, 0]
    assert idx.prefix_lens([2, 3], bits) == [2, 1, 0]  # a prefix must start at block 0
    assert idx.prefix_lens([], bits) == [0, 0, 0]
    assert idx.holders(1) == {"a": "dram", "b": "vram"}
    assert len(idx) == 4 and idx.node_blocks == {"a": 4, "b": 2, "c": 0}


def test_evicted_blocks_break_the_prefix_there():
    idx = _index()
    idx.apply(IndexUpdate(kind="evicted", node="a", block_hashes=(2, 77)))  # 77 unknown: ignored
    idx.check_integrity()
    assert idx.prefix_lens([1, 2, 3], [idx.bit("a"), idx.bit("b")]) == [1, 2]
    assert idx.holders(2) == {"b": "vram"}
    idx.evict("b", [2])
    assert 2 not in idx.holders(2) and len(idx) == 3
    idx.check_integrity()


def test_demoted_blocks_keep_matching_in_their_new_tier():
    idx = _index()
    idx.apply(IndexUpdate(kind="demoted", node="a", block_hashes=(3,), tier="ssd"))
    idx.check_integrity()
    assert idx.holders(3) == {"a": "ssd"}
    assert idx.prefix_lens([1, 2, 3], [idx.bit("a")]) == [3]
    idx.add("a", [3], "dram")  # read back: promoted
    assert idx.holders(3) == {"a": "dram"}
    assert idx.node_blocks["a"] == 4
    idx.check_integrity()


def test_node_gone_forgets_everything_it_held_and_frees_its_bit():
    idx = _index()
    bit_b = idx.bit("b")
    idx.apply(IndexUpdate(kind="node_gone", node="a"))
    idx.check_integrity()
    assert idx.holders(3) == {} and idx.holders(1) == {"b": "vram"}
    assert len(idx) == 2 and "a" not in idx.node_blocks
    assert idx.bit("new") not in (bit_b,)  # a fresh node may reuse a's bit, never b's
    assert idx.prefix_lens([1, 2], [idx.bit("new"), bit_b]) == [0, 2]
    idx.check_integrity()


def test_adding_twice_is_idempotent():
    idx = _index()
    idx.add("a", [1, 2])
    assert idx.node_blocks["a"] == 4
    idx.check_integrity()


def test_the_pool_prefix_may_be_split_across_nodes():
    idx = _index()
    idx.apply(IndexUpdate(kind="added", node="c", block_hashes=(7, 8), tier="dram"))
    full = idx.bit("a") | idx.bit("b") | idx.bit("c")
    assert idx.pool_prefix_len([1, 2, 3, BIG, 7, 8, 9], full) == 6
    assert idx.pool_prefix_len([1, 2, 3, BIG, 7], idx.bit("b") | idx.bit("c")) == 2
    assert idx.pool_prefix_len([9, 1], full) == 0
    assert idx.holders_mask(7) == idx.bit("c") and idx.holders_mask(99) == 0


def test_ssd_only_counts_count_blocks_no_node_holds_in_memory():
    """Running counts over the pool's prefix of the blocks held on SSD only (a block some
    node holds in memory is read from there); [] while nothing is on SSD."""
    idx = PrefixIndex()
    bits = idx.bit("a") | idx.bit("b")
    idx.add("a", [1, 2, 3, 4], "dram")
    assert idx.ssd_only_counts([1, 2, 3, 4], bits) == []
    idx.demote("a", [2, 3], "ssd")
    idx.add("b", [3], "dram")
    assert idx.ssd_only_counts([1, 2, 3, 4, 9, 1], bits) == [0, 0, 1, 1, 1]
    assert idx.ssd_only_counts([2], idx.bit("b")) == [0]  # not in the pool of b alone
    idx.check_integrity()

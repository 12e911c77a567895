"""PoolEvents: each pool change as vLLM events under the node's own rank (exact per node)."""

from __future__ import annotations

from mooncake.kv.keys import kv_key
from mooncake.kvevents.pool import PoolEvents
from mooncake.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from mooncake.store.metadata.objects import StoreEvent

H = 0x1234
HB = H.to_bytes(16, "big")


def _ev(kind: str, node: str, tier: str = "", key: str = kv_key(H)) -> StoreEvent:
    return StoreEvent(kind=kind, key=key, node_id=node, tier=tier)  # type: ignore[arg-type]


def _stored(medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=[HB],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_each_node_is_a_rank_and_each_change_names_its_medium() -> None:
    pool = PoolEvents(16, clock=lambda: 5.0)
    batches = pool.translate([_ev("added", "a", "dram"), _ev("added", "b", "vram")])
    assert [(b.data_parallel_rank, b.ts, b.events) for b in batches] == [
        (0, 5.0, [_stored("CPU")]),
        (1, 5.0, [_stored("GPU")]),
    ]
    (demoted,) = pool.translate([_ev("demoted", "a", "ssd")])
    assert demoted.events == [BlockRemoved(block_hashes=[HB], medium="CPU"), _stored("STORAGE")]
    (evicted,) = pool.translate([_ev("evicted", "a", "ssd"), _ev("evicted", "a", "ssd")])
    assert evicted.events == [BlockRemoved(block_hashes=[HB], medium="STORAGE")]  # once
    (gone,) = pool.translate([_ev("node_gone", "b", key=""), _ev("lost", "b", "vram")])
    assert gone.data_parallel_rank == 1 and gone.events == [AllBlocksCleared()]
    assert pool.translate([_ev("added", "a", "dram", key="not-a-block")]) == []
    assert pool.ranks == {"a": 0, "b": 1}

"""BlockMap: a vLLM instance's events, keyed by vLLM's hashes, index its cache under our
chained hashes of the same tokens, so a request's prefix matches what it holds."""

from __future__ import annotations

from mooncake.conductor.index import PrefixIndex
from mooncake.kv.hashing import PrefixHasher
from mooncake.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from mooncake.router.blockmap import BlockMap

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks


def _stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], **kw: object
) -> BlockStored:
    fields: dict = dict(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    fields.update(kw)
    return BlockStored(**fields)


def _setup() -> tuple[PrefixIndex, PrefixHasher, BlockMap, list[int]]:
    index, hasher = PrefixIndex(), PrefixHasher(BS, b"secret", b"f" * 16)
    return index, hasher, BlockMap("vllm-0", index, hasher), hasher.hash_blocks(TOKENS)


def _held(index: PrefixIndex, hashes: list[int]) -> int:
    return index.prefix_lens(hashes, [index.bit("vllm-0")])[0]


def test_blocks_stored_in_two_events_chain_through_the_parents_vllm_hash() -> None:
    index, _, blocks, ours = _setup()
    blocks.apply(KVEventBatch(ts=0, events=[_stored([b"a", b"b"], None, TOKENS[:8])]))
    blocks.apply(KVEventBatch(ts=0, events=[_stored([b"c"], b"b", TOKENS[8:12])]))
    assert _held(index, ours) == 3 and len(blocks) == 3
    assert index.holders(ours[2]) == {"vllm-0": "vram"}
    blocks.apply(KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[b"b"], medium="GPU")]))
    assert _held(index, ours) == 1  # the chain breaks at the removed block
    index.check_integrity()
    blocks.apply(KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert _held(index, ours) == 0 and len(blocks) == 0
    index.check_integrity()


def test_blocks_it_cannot_name_are_skipped_not_misindexed() -> None:
    """An unknown parent (a missed event), another block size, or extra keys (a salt:
    another prefix than the tokens say) are counted, not indexed."""
    index, _, blocks, ours = _setup()
    events = [
        _stored([b"x"], b"never-seen", TOKENS[4:8]),
        _stored([b"y"], None, TOKENS[:8], block_size=8),
        _stored([b"z"], None, TOKENS[:4], extra_keys=[("salt",)]),
    ]
    blocks.apply(KVEventBatch(ts=0, events=events))  # type: ignore[arg-type]
    assert blocks.num_skipped == 3 and len(index) == 0
    assert _held(index, ours) == 0

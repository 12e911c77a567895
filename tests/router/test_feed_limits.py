"""A backend's KV event feed refuses a frame larger than `router.max_batch_bytes` by its
announced length (the connection is dropped before it is buffered; ZeroMQ reconnects), and
goes on applying the batches that follow."""

from __future__ import annotations

import threading
import time

import zmq

from mooncake.conductor.index import PrefixIndex
from mooncake.config.router import VllmBackend
from mooncake.kv.hashing import PrefixHasher
from mooncake.kvevents.wire import BlockStored, KVEventBatch, encode_batch, seq_bytes
from mooncake.router.blockmap import BlockMap
from mooncake.router.feed import BackendFeed

BS = 4
LIMIT = 65536


def _batch(first_token: int, num_blocks: int) -> bytes:
    tokens = list(range(first_token, first_token + num_blocks * BS))
    hashes = [(first_token + i).to_bytes(8, "big") for i in range(num_blocks)]
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return encode_batch(KVEventBatch(ts=time.time(), events=[stored]))


def _held(index: PrefixIndex, hasher: PrefixHasher, first_token: int, num_blocks: int) -> int:
    hashes = hasher.hash_blocks(list(range(first_token, first_token + num_blocks * BS)))
    return index.prefix_lens(hashes, [index.bit("vllm-0")])[0]


def test_an_oversized_batch_is_dropped_and_the_feed_goes_on() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index, hasher = PrefixIndex(), PrefixHasher(BS, b"secret", b"f" * 16)
    blocks = BlockMap("vllm-0", index, hasher)
    backend = VllmBackend(url="http://127.0.0.1:1", events=f"tcp://127.0.0.1:{port}", replay="")
    feed = BackendFeed(
        backend,
        "",
        blocks,
        threading.Lock(),
        resync_s=0.2,
        replay_timeout_s=0.5,
        max_batch_bytes=LIMIT,
    )
    feed.start()
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"", seq_bytes(seq), payload])
        seq += 1

    def until_applied(first_token: int) -> None:
        deadline = time.monotonic() + 10
        while _held(index, hasher, first_token, 1) == 0:
            assert time.monotonic() < deadline, f"batch at {first_token} never applied"
            send(_batch(first_token, 1))  # NOTE: a PUB drops what a joining SUB misses
            time.sleep(0.05)

    try:
        until_applied(1_000)
        big = _batch(50_000, 8_000)  # 32,000 token ids
        assert len(big) > LIMIT
        send(big)
        until_applied(2_000)  # after the drop, ZeroMQ reconnects and the feed goes on
        assert _held(index, hasher, 50_000, 8_000) == 0
    finally:
        feed.stop()
        pub.close(linger=0)

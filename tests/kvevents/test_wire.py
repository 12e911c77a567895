"""Our KV event batches are vLLM's: the same bytes as vLLM's own classes encode (when the
vLLM venv exists), plain msgpack decoding reads them, and both of vLLM's event encodings
(maps with a `type` key, positional arrays) are read back."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from mooncake.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireError,
    decode_batch,
    encode_batch,
)

VLLM_PYTHON = Path(os.environ.get("MOONCAKE_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
H1, H2 = bytes(range(16)), bytes(range(16, 32))


def _batch() -> KVEventBatch:
    stored = BlockStored(
        block_hashes=[H1, H2],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    removed = BlockRemoved(block_hashes=[H1, 7], medium="STORAGE")
    return KVEventBatch(ts=12.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=2)


def test_plain_msgpack_reads_a_batch_as_vllm_0_32_lays_it_out() -> None:
    raw = msgspec.msgpack.decode(encode_batch(_batch()))
    assert raw[0] == 12.5 and raw[2] == 2
    stored, removed, cleared = raw[1]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [H1, H2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert removed == {"type": "BlockRemoved", "block_hashes": [H1, 7], "medium": "STORAGE"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(_batch())) == _batch()


def test_positional_events_of_older_vllms_are_read() -> None:
    """vLLM 0.8-0.10 encoded each event as an array, its tag first."""
    old = msgspec.msgpack.encode(
        [
            3.0,
            [
                ["BlockStored", [5], 4, [1, 2], 2, None, "GPU"],
                ["BlockRemoved", [5], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(old)
    assert batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 4
    assert stored.token_ids == [1, 2] and stored.block_size == 2 and stored.medium == "GPU"
    assert removed == BlockRemoved(block_hashes=[5], medium="GPU")
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize(
    "payload",
    [
        b"\x01",
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
        msgspec.msgpack.encode([1.0, [3]]),
    ],
)
def test_a_payload_that_is_not_a_batch_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError, match="not a vLLM KVEventBatch"):
        decode_batch(payload)


_VLLM_SCRIPT = """
import json, sys, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
h1, h2 = bytes(range(16)), bytes(range(16, 32))
stored = BlockStored(block_hashes=[h1, h2], parent_block_hash=None, token_ids=list(range(8)),
                     block_size=4, lora_id=None, medium="CPU", lora_name=None)
batch = KVEventBatch(ts=12.5, events=[stored, BlockRemoved(block_hashes=[h1, 7], medium="STORAGE"),
                     AllBlocksCleared()], data_parallel_rank=2)
theirs = msgspec.msgpack.Encoder().encode(batch)
ours = bytes.fromhex(sys.stdin.read())
back = msgspec.msgpack.Decoder(KVEventBatch).decode(ours)
print(json.dumps({"bytes": theirs.hex(), "decoded_equal": back == batch}))
"""


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON}")
def test_our_bytes_are_vllms_bytes_and_vllm_decodes_them() -> None:
    ours = encode_batch(_batch())
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", _VLLM_SCRIPT],
        input=ours.hex(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert bytes.fromhex(answer["bytes"]) == ours
    assert answer["decoded_equal"] is True

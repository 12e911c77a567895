"""KV objects: the layout round-trips and every kind of bad object is refused by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mooncake.errors import StoreError
from mooncake.kv.hashing import model_fingerprint
from mooncake.kv.object import (
    HEADER,
    KVLayout,
    KVObjectBuilder,
    KVObjectError,
    decode_kv_object,
    encode_kv_object,
    layer_digest,
    object_head,
)

LAYOUT = KVLayout(num_layers=3, block_tokens=4, num_kv_heads=2, head_dim=2, dtype="float32")
FP = model_fingerprint("m", 3, 2, 2, "float32")
TOKENS = [5, 6, 7, 8]
HASH = 0x1234_5678_9ABC_DEF0_1122_3344_5566_7788


def _layers() -> list[tuple[bytes, bytes]]:
    n = LAYOUT.half_bytes // 4
    return [
        (np.full(n, layer, np.float32).tobytes(), np.full(n, -layer, np.float32).tobytes())
        for layer in range(LAYOUT.num_layers)
    ]


def test_layout_is_header_tokens_then_aligned_layer_contiguous_k_and_v():
    obj = encode_kv_object(LAYOUT, FP, HASH, TOKENS, _layers())
    assert LAYOUT.payload_offset == 128 and LAYOUT.payload_offset >= HEADER.size + 16
    assert len(obj) == 128 + 3 * 2 * 4 * 2 * 2 * 4
    view = decode_kv_object(obj, LAYOUT, FP, block_hash=HASH, token_ids=TOKENS)
    assert view.token_ids.tolist() == TOKENS
    for layer, (k, v) in enumerate(_layers()):
        assert bytes(view.data[LAYOUT.k_offset(layer) : LAYOUT.v_offset(layer)]) == k
        assert bytes(view.data[LAYOUT.v_offset(layer) : LAYOUT.k_offset(layer + 1)]) == v


@pytest.mark.parametrize(
    ("mutate", "kwargs", "message"),
    [
        (lambda b: b[:10], {}, "shorter than a KV object header"),
        (lambda b: b"XXXX" + b[4:], {}, "not a version-2 KV object"),
        (lambda b: b[:-1], {}, "bytes, header says"),
        (
            lambda b: b,
            {"fingerprint": model_fingerprint("other", 3, 2, 2, "float32")},
            "another model",
        ),
        (lambda b: b, {"block_hash": HASH + 1}, "holds block"),
        (
            lambda b: b,
            {"token_ids": [5, 6, 9, 8]},
            "token ids differ from the prompt's at offset 2",
        ),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), {}, "layer 2 does not match its digest"),
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], {}, "checksum mismatch"),
        (lambda b: b, {"layout": KVLayout(3, 4, 2, 2, "bfloat16")}, "header shapes"),
    ],
)
def test_bad_objects_raise_a_store_error_that_names_the_problem(mutate, kwargs, message):
    data = bytes(mutate(bytes(encode_kv_object(LAYOUT, FP, HASH, TOKENS, _layers()))))
    args = {"layout": LAYOUT, "fingerprint": FP, **kwargs}
    with pytest.raises(KVObjectError, match=message) as info:
        decode_kv_object(data, args.pop("layout"), args.pop("fingerprint"), **args)
    assert isinstance(info.value, StoreError)


def test_committing_before_every_layer_is_written_is_refused():
    builder = KVObjectBuilder(LAYOUT, FP, HASH, TOKENS)
    k, v = _layers()[0]
    builder.set_layer(0, k, v)
    with pytest.raises(KVObjectError, match=r"without layers \[1, 2\]"):
        builder.commit()


@pytest.mark.cluster
def test_store_and_master_side_modules_import_without_torch():
    """The Store validates objects and the master tokenizes without torch installed."""
    code = (
        "import sys, mooncake.kv.object, mooncake.model.info, "
        "mooncake.model.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_object_written_layer_by_layer_in_place_and_sealed_by_its_head_decodes():
    """Several writers: each layer lands in place with its digest reported; the head comes last."""
    layers = _layers()
    obj = bytearray(LAYOUT.object_bytes)
    digests = []
    for layer, (k, v) in enumerate(layers):
        obj[LAYOUT.k_offset(layer) : LAYOUT.v_offset(layer)] = k
        obj[LAYOUT.v_offset(layer) : LAYOUT.k_offset(layer + 1)] = v
        digests.append(layer_digest(k, v))
    head = object_head(LAYOUT, FP, HASH, TOKENS, digests)
    obj[: len(head)] = head
    assert obj == encode_kv_object(LAYOUT, FP, HASH, TOKENS, layers)
    decode_kv_object(obj, LAYOUT, FP, block_hash=HASH, token_ids=TOKENS)
    obj[LAYOUT.k_offset(1)] ^= 1  # a layer a writer did not finish: caught by its digest
    with pytest.raises(KVObjectError, match="layer 1 does not match its digest"):
        decode_kv_object(obj, LAYOUT, FP, block_hash=HASH, token_ids=TOKENS)

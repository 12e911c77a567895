"""Prefix hashing: chaining, keying, stability across processes, trace token synthesis."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mooncake.kv.hashing import (
    PrefixHasher,
    block_key,
    model_fingerprint,
    trace_block_tokens,
    trace_prompt_tokens,
)

FP = model_fingerprint("llama3-8b", 32, 8, 128, "bfloat16")
SECRET = b"cluster-secret-for-tests"


def make_hasher(block_tokens=4, secret=SECRET, fp=FP, salt=b""):
    return PrefixHasher(block_tokens, secret, fp, salt)


def test_block_i_covers_every_block_before_it():
    h = make_hasher()
    tokens = list(range(100, 112))  # 3 blocks of 4
    full = h.hash_blocks(tokens)
    assert len(full) == 3
    # Same block content after a different prefix gets a different hash.
    other = h.hash_blocks([7, 7, 7, 7] + tokens[4:8])
    assert other[1] != full[1]
    # A prefix of the tokens gives a prefix of the hashes.
    assert h.hash_blocks(tokens[:8]) == full[:2]


def test_partial_trailing_block_has_no_hash():
    h = make_hasher()
    assert len(h.hash_blocks(list(range(11)))) == 2
    assert h.hash_blocks([1, 2, 3]) == []


def test_extending_from_parent_equals_hashing_everything():
    h = make_hasher()
    tokens = np.arange(40, dtype=np.int64)
    first = h.hash_blocks(tokens[:16])
    rest = h.hash_blocks(tokens[16:], parent=first[-1])
    assert first + rest == h.hash_blocks(tokens)


def test_input_types_give_identical_hashes():
    h = make_hasher()
    base = [5, 900, 3, 70000, 1, 2, 3, 4]
    expected = h.hash_blocks(base)
    for variant in (
        tuple(base),
        np.array(base, np.int32),
        np.array(base, np.int64),
        np.array(base, np.uint32),
    ):
        assert h.hash_blocks(variant) == expected


@pytest.mark.parametrize(
    "bad",
    [[-1, 0, 0, 0], [2**32, 0, 0, 0], np.zeros((2, 4), np.int64), np.array([0.5, 1.0, 2.0, 3.0])],
)
def test_invalid_token_ids_are_rejected(bad):
    with pytest.raises(ValueError):
        make_hasher().hash_blocks(bad)


def test_secret_model_and_salt_each_separate_the_namespaces():
    tokens = list(range(8))
    reference = make_hasher().hash_blocks(tokens)
    variants = [
        make_hasher(secret=b"another-secret-entirely"),
        make_hasher(fp=model_fingerprint("llama3-8b", 32, 8, 128, "float16")),
        make_hasher(fp=model_fingerprint("llama3-70b", 80, 8, 128, "bfloat16")),
        make_hasher(salt=b"tenant-a"),
    ]
    seen = {tuple(reference)}
    for v in variants:
        hashes = tuple(v.hash_blocks(tokens))
        assert not set(hashes) & set(reference)
        seen.add(hashes)
    assert len(seen) == 1 + len(variants)


def test_golden_value_pins_the_scheme():
    """A change of the byte layout renames every block in every pool: it must be deliberate
    (bump SCHEME_VERSION and this value together)."""
    h = PrefixHasher(4, b"golden-secret", model_fingerprint("m", 2, 1, 8, "float32"))
    assert block_key(h.hash_blocks([1, 2, 3, 4])[0]) == GOLDEN_FIRST_BLOCK


GOLDEN_FIRST_BLOCK = "db12cd26cf7076bbdb24ebccf5f9774a"


@pytest.mark.cluster
def test_hashes_identical_across_processes_with_different_hash_seeds():
    code = (
        "from mooncake.kv.hashing import PrefixHasher, model_fingerprint, block_key\n"
        "h = PrefixHasher(16, 'cross-process-secret', model_fingerprint('x', 4, 2, 64, 'bf16'),"
        " salt='tenant')\n"
        "print(','.join(block_key(b) for b in h.hash_blocks(list(range(64)))))\n"
        "print(hash('not stable'))\n"
    )
    outputs = []
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        outputs.append(out)
    assert outputs[0][1] != outputs[1][1], "the two processes must really differ in hash()"
    assert outputs[0][0] == outputs[1][0]
    assert len(outputs[0][0].split(",")) == 4


def test_trace_blocks_are_deterministic_and_in_range():
    a = trace_block_tokens(17, 512, vocab_size=1000, first_token=3)
    assert a.dtype == np.uint32 and a.shape == (512,)
    assert a.min() >= 3 and a.max() < 1000
    assert np.array_equal(a, trace_block_tokens(17, 512, vocab_size=1000, first_token=3))
    assert not np.array_equal(a, trace_block_tokens(18, 512, vocab_size=1000, first_token=3))
    assert not np.array_equal(a, trace_block_tokens(17, 512, 1000, 3, seed=1))
    # Tokens within a block look random, not a ramp.
    assert len(np.unique(a)) > 300
    assert trace_block_tokens(0, 8, 50_000).tolist() == GOLDEN_TRACE_BLOCK


GOLDEN_TRACE_BLOCK = [7535, 22465, 48110, 39053, 3978, 8618, 10592, 24487]


def test_trace_requests_sharing_hash_ids_share_prefixes_and_hashes():
    a = trace_prompt_tokens([0, 1, 2], 1200, 512, 32000)
    b = trace_prompt_tokens([0, 1, 9, 10], 1600, 512, 32000)
    assert a.shape == (1200,) and b.shape == (1600,)
    assert np.array_equal(a[:1024], b[:1024])
    assert not np.array_equal(a[1024:1200], b[1024:1200])
    h = PrefixHasher(512, SECRET, FP)
    ha, hb = h.hash_blocks(a), h.hash_blocks(b)
    assert ha[:2] == hb[:2] and len(ha) == 2 and len(hb) == 3


def test_trace_input_len_must_fit_the_blocks():
    with pytest.raises(ValueError, match="does not fit"):
        trace_prompt_tokens([0, 1], 1025, 512, 32000)
    with pytest.raises(ValueError, match="does not fit"):
        trace_prompt_tokens([0, 1], 512, 512, 32000)

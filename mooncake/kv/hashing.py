"""Prefix block hashes: the names under which reusable KV lives in the pool.

A prompt is cut into blocks of `block_tokens` tokens. Block i's hash covers block i and,
through its parent, every block before it:

    root   = xxh3_128(b"mooncake-root\\0" + fingerprint + len(salt) + salt, seed)
    h[0]   = xxh3_128(root.to_bytes(16) + tokens[0:B].astype("<u4").tobytes(), seed)
    h[i]   = xxh3_128(h[i-1].to_bytes(16) + tokens[i*B:(i+1)*B] as little-endian u32, seed)

- `seed` (64 bits) is derived from the cluster secret, so a party without the secret
  cannot predict block names (or probe the pool for whether a prompt was seen).
- `fingerprint` names the model (name, layers, KV heads, head dim, dtype): two models never
  share a block even for the same tokens.
- `salt` is an optional per-tenant value: tenants with different salts never share blocks.
- Only full blocks are hashed; a trailing partial block has no name (its KV is not reusable
  by a different request until the block is full).

Every input is bytes with a fixed layout, so hashes are identical in every process, across
restarts and machines (never Python's `hash()`). NOTE: changing anything above changes
every block name in every pool; bump `SCHEME_VERSION` when doing so.

The second half of the module maps a Mooncake trace's `hash_ids` to deterministic synthetic
token blocks, so that two trace requests sharing hash ids share real token prefixes.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

SCHEME_VERSION = 1
HASH_BYTES = 16  # 128-bit block hashes

_xxh3_128 = xxhash.xxh3_128_intdigest


def model_fingerprint(
    name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str
) -> bytes:
    """A 16-byte digest naming a model's KV layout; part of every block hash."""
    text = f"v{SCHEME_VERSION}|{name}|{num_layers}|{num_kv_heads}|{head_dim}|{dtype}"
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"mooncake-model").digest()


def seed_from_secret(secret: bytes | str) -> int:
    """The 64-bit xxh3 seed derived from the cluster secret (stable across machines)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    digest = hashlib.blake2b(raw, digest_size=8, person=b"mooncake-prefix").digest()
    return int.from_bytes(digest, "little")


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array (the hashed byte layout)."""
    if isinstance(token_ids, list | tuple):
        # array.array converts a list ~4x faster than numpy and range-checks each item.
        try:
            packed = array.array("I", token_ids)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from e
        assert packed.itemsize == 4, packed.itemsize
        return np.frombuffer(packed, dtype=np.uint32).astype("<u4", copy=False)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


class PrefixHasher:
    """Computes chained block hashes for one (cluster secret, model, tenant) triple.

    Stateless after construction: safe to share between threads.
    """

    def __init__(
        self,
        block_tokens: int,
        secret: bytes | str,
        fingerprint: bytes,
        salt: bytes | str = b"",
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        salt_bytes = salt.encode() if isinstance(salt, str) else salt
        self.block_tokens = block_tokens
        self.seed = seed_from_secret(secret)
        self.root = _xxh3_128(
            b"mooncake-root\0" + fingerprint + len(salt_bytes).to_bytes(4, "little") + salt_bytes,
            self.seed,
        )

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_tokens

    def hash_blocks(
        self, token_ids: Sequence[int] | np.ndarray, parent: int | None = None
    ) -> list[int]:
        """Hashes of every full block of `token_ids`, chained from `parent` (or the root).

        Pass the last hash of a previous call as `parent` to extend a sequence (e.g. with
        decoded tokens) without rehashing its prefix. Returns 128-bit ints.
        """
        tokens = as_token_array(token_ids)
        block_bytes = self.block_tokens * 4
        num_blocks = tokens.size // self.block_tokens
        data = memoryview(tokens.data).cast("B")[: num_blocks * block_bytes]
        h = self.root if parent is None else parent
        seed = self.seed
        hashes = []
        for start in range(0, num_blocks * block_bytes, block_bytes):
            h = _xxh3_128(h.to_bytes(16, "little") + data[start : start + block_bytes], seed)
            hashes.append(h)
        return hashes


def block_key(block_hash: int) -> str:
    """The pool object key of a block: 32 lower-case hex digits."""
    return f"{block_hash:032x}"


# --- synthetic tokens for Mooncake traces -------------------------------------------------
# The public traces carry `hash_ids` (one per 512-token block, prefix-chained and remapped
# to small ints) but no text. Block `hash_id` becomes `block_tokens` token ids drawn from a
# counter-based generator (splitmix64 of (seed, hash_id, position)): deterministic, the
# same on every machine, vectorised, with no state shared between blocks.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # x: (n,) uint64; wrapping arithmetic is the point, so silence numpy's overflow notes.
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def trace_block_tokens(
    hash_id: int, block_tokens: int, vocab_size: int, first_token: int = 0, seed: int = 0
) -> np.ndarray:
    """The synthetic token block of one trace hash id: (block_tokens,) uint32 in
    [first_token, vocab_size)."""
    if not 0 <= first_token < vocab_size:
        raise ValueError(f"need 0 <= first_token < vocab_size, got {first_token}, {vocab_size}")
    with np.errstate(over="ignore"):
        base = np.uint64(hash_id & 0xFFFFFFFFFFFF) << np.uint64(16)
        key = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _MIX2 + base
        counters = key + np.arange(block_tokens, dtype=np.uint64)
    span = np.uint64(vocab_size - first_token)
    return (_splitmix64(counters) % span + np.uint64(first_token)).astype(np.uint32)


def trace_prompt_tokens(
    hash_ids: Sequence[int],
    input_len: int,
    block_tokens: int,
    vocab_size: int,
    first_token: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """The synthetic prompt of a trace request: its hash ids' blocks, cut to `input_len`.

    Two requests that share their first k hash ids share their first k*block_tokens tokens.
    """
    if not (len(hash_ids) - 1) * block_tokens < input_len <= len(hash_ids) * block_tokens:
        raise ValueError(
            f"input_len {input_len} does not fit {len(hash_ids)} blocks of {block_tokens} tokens"
        )
    blocks = [trace_block_tokens(h, block_tokens, vocab_size, first_token, seed) for h in hash_ids]
    return np.concatenate(blocks)[:input_len]

"""Pool keys of KV blocks (torch-free: the master, the KV event feed and the Store use it).

One pool object per block, under `kv_key(block_hash)`; the hash already covers the model
fingerprint, the cluster seed and the tenant salt, so keys never collide across models.
"""

from __future__ import annotations

KEY_PREFIX = "kv/"


def kv_key(block_hash: int) -> str:
    return f"{KEY_PREFIX}{block_hash:032x}"


def parse_kv_key(key: str) -> int | None:
    """The block hash a pool key names, or None for a key that is not a KV block."""
    if not key.startswith(KEY_PREFIX) or len(key) != len(KEY_PREFIX) + 32:
        return None
    try:
        return int(key[len(KEY_PREFIX) :], 16)
    except ValueError:
        return None

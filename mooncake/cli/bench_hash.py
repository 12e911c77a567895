"""`mooncake bench hash`: prefix-hash throughput against vLLM's default scheme."""

from __future__ import annotations

import time
from collections.abc import Callable

import typer

from mooncake.cli.app import bench_app


def _best_rate(fn: Callable[[], object], num_tokens: int, repeat: int) -> float:
    """Tokens per second of the fastest of `repeat` runs (the least disturbed one)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return num_tokens / best


@bench_app.command("hash")
def bench_hash(
    block_tokens: int = typer.Option(512, help="Tokens per block."),
    num_tokens: int = typer.Option(
        2_097_152, help="Tokens hashed per run (a whole number of blocks)."
    ),
    repeat: int = typer.Option(5, min=1, help="Runs per scheme; the fastest is reported."),
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of a table."
    ),
) -> None:
    """Tokens/s of mooncake's chained xxh3-128 block hashes, on one core, with vLLM's
    default scheme (sha256 over a serialized (parent hash, token tuple)) as the baseline."""
    import hashlib

    import msgspec
    import numpy as np

    from mooncake.cli.output import console, print_json
    from mooncake.kv.hashing import PrefixHasher, model_fingerprint

    num_blocks = max(1, num_tokens // block_tokens)
    num_tokens = num_blocks * block_tokens
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_256, num_tokens, dtype=np.int64)  # a llama3-sized vocabulary
    token_list = tokens.tolist()
    hasher = PrefixHasher(
        block_tokens, b"bench-secret-0123456789", model_fingerprint("bench", 80, 8, 128, "bf16")
    )

    def vllm_sha256() -> None:
        # NOTE: vLLM hashes (parent_hash, tuple(token_ids), extra_keys) serialized; its
        # `sha256_cbor` option uses CBOR, the older default pickle. We serialize with
        # msgpack, which is at least as fast as either, so the baseline is not handicapped.
        parent: bytes | None = None
        encode = msgspec.msgpack.encode
        for start in range(0, num_tokens, block_tokens):
            parent = hashlib.sha256(
                encode((parent, tuple(token_list[start : start + block_tokens]), None))
            ).digest()

    rows = [
        (
            "mooncake xxh3-128, numpy int64 tokens",
            _best_rate(lambda: hasher.hash_blocks(tokens), num_tokens, repeat),
        ),
        (
            "mooncake xxh3-128, python list tokens",
            _best_rate(lambda: hasher.hash_blocks(token_list), num_tokens, repeat),
        ),
        ("baseline: vLLM-style sha256(serialized)", _best_rate(vllm_sha256, num_tokens, repeat)),
    ]
    baseline = rows[-1][1]
    if json_out:
        print_json(
            {
                "block_tokens": block_tokens,
                "num_tokens": num_tokens,
                "tokens_per_s": rows[0][1],
                "list_tokens_per_s": rows[1][1],
                "baseline_tokens_per_s": baseline,
                "speedup": rows[0][1] / baseline,
            }
        )
        return
    from rich.table import Table

    table = Table(
        title=f"prefix hashing, {block_tokens}-token blocks, {num_tokens:,} tokens, one core"
    )
    table.add_column("scheme")
    table.add_column("M tokens/s", justify="right")
    table.add_column("vs baseline", justify="right")
    for name, rate in rows:
        table.add_row(name, f"{rate / 1e6:,.1f}", f"{rate / baseline:.1f}x")
    console.print(table)

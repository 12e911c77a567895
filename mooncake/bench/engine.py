"""Measurements behind `mooncake bench engine`: each returns plain rows, the CLI renders.

Every comparison runs its variants interleaved (a, b, a, b, ...) in one process, so a
noisy neighbour slows both alike; each reports the best and the median of its repeats.

- throughput: prefill tokens/s per prompt length; decode tokens/s per batch size (context
  KV left as zeros: the cost of a step does not depend on the values)
- stream:     prefill alone / with layer-wise store into a DRAM pool / with the store run
              after the prefill (serialized), the paper's Figure 7 analog
- reuse:      full prefill / the same prompt with a fraction of it reused from the pool;
              the CLI sets the time cut beside its FLOP bound (`ModelSpec.prefill_flops`):
              use `dummy:small`, as on `dummy:tiny` attention caps the cut near 32%
- pipeline:   one process / a 2-stage pipeline with stage 1 in a second process over TCP
- gemm:       prefill and decode steps with oneDNN-packed linears / with F.linear (MKL)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.layerio import DramKVPool
from mooncake.model.decode import DecodeRunner
from mooncake.model.info import ModelInfo, kv_fingerprint
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.prefill import PrefillResult, PrefillRunner
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.weights import create_model
from mooncake.roles.prefill.group.link import TcpStageLink
from mooncake.roles.prefill.group.pipeline import prefill_pipelined

SECRET = os.urandom(24).hex().encode()


@dataclass
class Timing:
    """Seconds of repeated runs of one variant: wall clock, and CPU time of this process
    (all its threads), which a busy neighbour on a shared machine disturbs much less."""

    name: str
    runs: list[float]
    cpu_runs: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def cpu_best(self) -> float:
        return min(self.cpu_runs) if self.cpu_runs else float("nan")


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def interleave(variants: dict[str, Callable[[], object]], repeat: int) -> dict[str, Timing]:
    """Run each variant `repeat` times, round-robin, timing each call."""
    out = {name: Timing(name, []) for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out[name].runs.append(time.perf_counter() - t0)
            out[name].cpu_runs.append(time.process_time() - c0)
    return out


class Bench:
    """One model, one KV cache and one DRAM pool, shared by the measurements."""

    def __init__(
        self,
        info: ModelInfo,
        dtype: str,
        block_tokens: int,
        chunk_tokens: int,
        num_blocks: int,
        cpu_gemm: str = "onednn",
    ):
        self.info, self.dtype, self.bt, self.chunk = info, dtype, block_tokens, chunk_tokens
        self.model: Model = create_model(info, dtype, "cpu", cpu_gemm=cpu_gemm)
        self.cache = PagedKVCache.for_model(self.model, num_blocks, block_tokens)
        self.fingerprint = kv_fingerprint(info, dtype)
        self.hasher = PrefixHasher(block_tokens, SECRET, self.fingerprint)
        self.plain = PrefillRunner(self.model, self.cache, chunk_tokens=chunk_tokens)
        self.vocab = info.spec.vocab_size
        warm = min(2 * chunk_tokens, num_blocks * block_tokens // 2)  # lazy inits, untimed
        if warm > 1:
            self.run(self.plain, random_prompt(warm, self.vocab))

    def pool(self, link_bytes_per_s: float = 0.0) -> DramKVPool:
        return DramKVPool(self.plain.layout, self.fingerprint, link_bytes_per_s=link_bytes_per_s)

    def runner(self, pool: DramKVPool | None, store: bool = False) -> PrefillRunner:
        return PrefillRunner(
            self.model,
            self.cache,
            chunk_tokens=self.chunk,
            hasher=self.hasher,
            source=pool,
            sink=pool if store else None,
            fingerprint=self.fingerprint,
        )

    def run(self, runner: PrefillRunner, ids: list[int]) -> PrefillResult:
        """Prefill `ids` and free its blocks."""
        result = runner.prefill(ids)
        self.cache.free(result.block_ids)
        return result

    # -- throughput ---------------------------------------------------------------------
    def prefill_rate(self, length: int, repeat: int) -> Timing:
        ids = random_prompt(length, self.vocab)
        return interleave({f"prefill {length}": lambda: self.run(self.plain, ids)}, repeat)[
            f"prefill {length}"
        ]

    def decode_rate(self, batch: int, context: int, steps: int, repeat: int) -> Timing:
        """Seconds per decode step of `batch` requests holding `context` tokens each."""
        runs = []
        for r in range(repeat):
            runner = DecodeRunner(self.model, self.cache, max_batch=batch)
            params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
            for i in range(batch):
                blocks = self.cache.allocate(context + steps)
                ids = random_prompt(context, self.vocab, seed=r * batch + i)
                runner.add(
                    Sequence(i, ids, params, block_ids=blocks, num_cached_tokens=context - 1)
                )
            runner.step()  # admission and the first step are not timed
            t0 = time.perf_counter()
            while runner.has_work:
                runner.step()
            runs.append((time.perf_counter() - t0) / (steps - 1))
        return Timing(f"decode batch {batch}", runs)

    def gemm(
        self, length: int, batches: list[int], context: int, steps: int, repeat: int
    ) -> dict[str, dict[str, Timing]]:
        """Prefill of `length` tokens and a decode step per batch size, with this model's
        linears ("onednn": packed, unless oneDNN could not run them here) and with the same
        weights on F.linear ("torch"), interleaved."""
        blocks = self.cache.allocator.num_blocks
        plain = Bench(self.info, self.dtype, self.bt, self.chunk, blocks, cpu_gemm="torch")
        ids = random_prompt(length, self.vocab)
        prefill: dict[str, Callable[[], object]] = {
            "onednn": lambda: self.run(self.plain, ids),
            "torch": lambda: plain.run(plain.plain, ids),
        }
        out = {f"prefill {length}": interleave(prefill, repeat)}
        for b in batches:
            runs: dict[str, Timing] = {k: Timing(k, []) for k in prefill}
            for _ in range(repeat):
                for name, bench in (("onednn", self), ("torch", plain)):
                    runs[name].runs += bench.decode_rate(b, context, steps, 1).runs
            out[f"decode step, batch {b}"] = runs
        return out

    # -- Figure 7 analog ----------------------------------------------------------------
    def stream(self, length: int, repeat: int, link_bytes_per_s: float = 0.0) -> dict[str, Timing]:
        ids = random_prompt(length, self.vocab, seed=1)
        tails: dict[str, list[float]] = {"layer-wise": [], "serialized": []}

        def layerwise() -> None:
            pool = self.pool(link_bytes_per_s)
            tails["layer-wise"].append(
                self.run(self.runner(pool, store=True), ids).stats.store_tail_s
            )
            pool.close()

        def serialized() -> None:
            pool = self.pool(link_bytes_per_s)
            result = self.plain.prefill(ids)
            t0 = time.perf_counter()
            num_full = length // self.bt
            put = pool.begin(
                self.hasher.hash_blocks(ids),
                [ids[b * self.bt : (b + 1) * self.bt] for b in range(num_full)],
            )
            blocks = result.block_ids[:num_full]
            for layer in self.model.layer_ids:
                k, v = self.cache.layer(layer)
                put.write_layer(
                    layer, range(num_full), [k[b] for b in blocks], [v[b] for b in blocks]
                )
            put.commit()
            put.wait()
            tails["serialized"].append(time.perf_counter() - t0)
            self.cache.free(result.block_ids)
            pool.close()

        timings = interleave(
            {
                "prefill alone": lambda: self.run(self.plain, ids),
                "layer-wise store": layerwise,
                "serialized store": serialized,
            },
            repeat,
        )
        timings["store tail, layer-wise"] = Timing("store tail, layer-wise", tails["layer-wise"])
        timings["store after prefill, serialized"] = Timing(
            "store after prefill, serialized", tails["serialized"]
        )
        return timings

    # -- prefix reuse -------------------------------------------------------------------
    def reused_tokens(self, length: int, fraction: float) -> int:
        """Tokens `reuse` takes from the pool: whole blocks, and never the last token."""
        return min(int(length * fraction), length - 1) // self.bt * self.bt

    def reuse(self, length: int, fraction: float, repeat: int) -> dict[str, Timing]:
        ids = random_prompt(length, self.vocab, seed=2)
        cached = self.reused_tokens(length, fraction)
        pool = self.pool()
        self.run(self.runner(pool, store=True), ids[:cached])
        reuser = self.runner(pool)

        def reused() -> None:
            assert self.run(reuser, ids).stats.num_reused_tokens == cached

        timings = interleave(
            {"full prefill": lambda: self.run(self.plain, ids), f"{cached} tokens reused": reused},
            repeat,
        )
        pool.close()
        return timings

    # -- chunked pipeline parallelism ---------------------------------------------------
    def pipeline(self, length: int, repeat: int) -> dict[str, Timing]:
        """One process vs stage 0 here + stage 1 (the upper half of the layers) in a child."""
        n = self.info.spec.num_layers
        split = n // 2
        stage0 = create_model(self.info, self.dtype, "cpu", (0, split))
        cache0 = PagedKVCache.for_model(stage0, self.cache.num_blocks, self.bt)
        runner0 = PrefillRunner(stage0, cache0, chunk_tokens=self.chunk)
        env = dict(os.environ, MOONCAKE_STAGE_SECRET=SECRET.decode())
        cmd = [
            sys.executable,
            "-m",
            "mooncake.roles.prefill.group.stageproc",
            "--model",
            self.info.path,
            "--dtype",
            self.dtype,
            "--layers",
            f"{split}:{n}",
            "--block-tokens",
            str(self.bt),
            "--num-blocks",
            str(self.cache.num_blocks),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
        try:
            assert proc.stdout is not None
            port = int(json.loads(proc.stdout.readline())["port"])
            link = TcpStageLink.connect("127.0.0.1", port, SECRET)
            ids = random_prompt(length, self.vocab, seed=3)
            req = iter(range(1 << 30))

            def two_stage() -> None:
                result = prefill_pipelined(runner0, ids, link, req_id=next(req))
                cache0.free(result.block_ids)

            timings = interleave(
                {
                    "one process": lambda: self.run(self.plain, ids),
                    "2-stage pipeline, 2 processes": two_stage,
                },
                repeat,
            )
            link.close()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        return timings

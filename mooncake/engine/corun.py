"""How much slower a node computes while the other nodes of its host compute too.

Nodes on one host (`mooncake up --local`, or several nodes per machine) share more than
cores: memory bandwidth and the last-level cache. On a 2-core VM a pipeline stage beside
the other stage and a decode loop runs 1.2-1.4x slower than the same stage profiled alone,
and a cost model profiled alone prices every request that much too fast, so the Conductor
admits more than the host can serve within the SLO.

`measure_corun` measures it on this host: a prefill of `tokens` tokens and a decode step,
each alone and then while `workers - 1` other threads (each with its own copy of the
weights, as other processes have) run prefills back to back. torch releases the GIL inside
its kernels, so the threads compute at once, as processes would. `scale_cost_model`
multiplies a profile's prefill and decode polynomials by the factors measured.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import msgspec

from mooncake.conductor.costmodel import CorunFactors, CostModel, Poly2, Term
from mooncake.engine.benchmarks import Bench, random_prompt
from mooncake.engine.modelinfo import ModelInfo


def measure_corun(
    info: ModelInfo,
    dtype: str,
    block_tokens: int,
    chunk_tokens: int,
    workers: int,
    tokens: int = 1024,
    repeat: int = 3,
    progress: Callable[[str], None] = lambda _: None,
) -> CorunFactors:
    """The slowdown of a prefill and of a decode step with `workers` computing at once
    (1.0 each when `workers` <= 1). Medians of `repeat` timed runs, each side."""
    if workers <= 1:
        return CorunFactors(busy=1, prefill=1.0, decode=1.0)
    batch, context, steps = 4, 256, 4  # the decode step timed: 4 requests of 256 tokens
    blocks = max(-(-tokens // block_tokens), batch * -(-(context + steps) // block_tokens)) + 8
    progress(f"co-run: {workers} prefills at once, {tokens} tokens each")
    benches = [Bench(info, dtype, block_tokens, chunk_tokens, blocks) for _ in range(workers)]
    ids = random_prompt(tokens, benches[0].vocab, seed=11)
    main = benches[0]

    def prefill() -> float:
        t0 = time.perf_counter()
        main.run(main.plain, ids)
        return time.perf_counter() - t0

    def step() -> float:
        return main.decode_rate(batch, context, steps, 1).best

    alone_p = statistics.median(prefill() for _ in range(repeat))
    alone_d = statistics.median(step() for _ in range(repeat))
    stop = threading.Event()

    def loop(b: Bench) -> None:
        while not stop.is_set():
            b.run(b.plain, ids)

    others = [threading.Thread(target=loop, args=(b,), daemon=True) for b in benches[1:]]
    for t in others:
        t.start()
    try:
        busy_p = statistics.median(prefill() for _ in range(repeat))
        busy_d = statistics.median(step() for _ in range(repeat))
    finally:
        stop.set()
        for t in others:
            t.join()
    return CorunFactors(
        busy=workers,
        prefill=max(1.0, busy_p / alone_p),
        decode=max(1.0, busy_d / alone_d),
    )


def _scaled(poly: Poly2, factor: float) -> Poly2:
    terms = tuple(Term(powers=t.powers, coef=t.coef * factor) for t in poly.terms)
    return msgspec.structs.replace(poly, terms=terms)


def scale_cost_model(model: CostModel, corun: CorunFactors) -> CostModel:
    """`model` with its prefill and decode times multiplied by `corun`'s factors (recorded
    in the file's `corun`; the device line says so)."""
    spec = model.spec
    device = (
        f"{spec.device}, {corun.busy} nodes computing at once "
        f"(prefill x{corun.prefill:.2f}, decode x{corun.decode:.2f})"
    )
    return CostModel(
        msgspec.structs.replace(
            spec,
            device=device,
            prefill=_scaled(spec.prefill, corun.prefill),
            decode=_scaled(spec.decode, corun.decode),
            corun=corun,
        )
    )

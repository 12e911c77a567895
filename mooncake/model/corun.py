"""How much slower a node computes while the other nodes of its host compute too.

Nodes on one host (`mooncake up --local`, or several nodes per machine) share more than
cores: memory bandwidth and the last-level cache. On a 2-core VM a pipeline stage beside
the other stage and a decode loop runs 1.2-1.4x slower than the same stage profiled alone,
and a cost model profiled alone prices every request that much too fast, so the Conductor
admits more than the host can serve within the SLO.

`measure_corun` measures it on this host: a prefill of `tokens` tokens and a decode step,
each alone and then while `workers - 1` other processes (each with its own copy of the
weights, one thread each, as nodes run) run prefills back to back. Processes, not threads:
a small model's step is mostly Python, and threads would measure the GIL instead of the
host. `scale_cost_model` multiplies a profile's prefill and decode polynomials by the
factors measured.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier as BarrierT
from multiprocessing.synchronize import Event as EventT

import msgspec

from mooncake.bench.engine import Bench, random_prompt
from mooncake.conductor.costmodel import CorunFactors, CostModel, Poly2, Term
from mooncake.errors import MooncakeError
from mooncake.model.info import ModelInfo

READY_TIMEOUT_S = 120.0  # a co-running process loads its model (a checkpoint: from disk)
PAUSE_S = 0.05  # seconds: a co-runner polls for resume; a pause waits its run out


def measure_corun(
    info: ModelInfo,
    dtype: str,
    block_tokens: int,
    chunk_tokens: int,
    workers: int,
    tokens: int = 1024,
    repeat: int = 5,
    progress: Callable[[str], None] = lambda _: None,
    cpu_gemm: str = "onednn",
) -> CorunFactors:
    """The slowdown of a prefill and of a decode step with `workers` computing at once
    (1.0 each when `workers` <= 1). The co-runners are paused and resumed between timed
    runs, so runs alone and beside them alternate `repeat` times (a VM's speed drifts over
    seconds); each factor is the ratio of the two sides' medians, at least 1."""
    if workers <= 1:
        return CorunFactors(busy=1, prefill=1.0, decode=1.0)
    batch, context, steps = 4, 256, 4  # the decode step timed: 4 requests of 256 tokens
    blocks = max(-(-tokens // block_tokens), batch * -(-(context + steps) // block_tokens)) + 8
    progress(f"co-run: {workers} prefills at once, {tokens} tokens each")
    main = Bench(info, dtype, block_tokens, chunk_tokens, blocks, cpu_gemm)
    ids = random_prompt(tokens, main.vocab, seed=11)

    def prefill() -> float:
        t0 = time.perf_counter()
        main.run(main.plain, ids)
        return time.perf_counter() - t0

    def step() -> float:
        return main.decode_rate(batch, context, steps, 1).best

    ctx = multiprocessing.get_context("spawn")  # NOTE: no fork of a process running torch
    stop, run, ready = ctx.Event(), ctx.Event(), ctx.Barrier(workers)
    idle = [ctx.Event() for _ in range(workers - 1)]
    args = (info.path, dtype, block_tokens, chunk_tokens, blocks, cpu_gemm, ids, ready, run, stop)
    others = [ctx.Process(target=_prefill_loop, args=(*args, i), daemon=True) for i in idle]
    for p in others:
        p.start()
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        try:
            ready.wait(timeout=READY_TIMEOUT_S)  # every other process has its model
        except threading.BrokenBarrierError as e:
            codes = [p.exitcode for p in others]
            raise MooncakeError(
                f"co-run profile: {workers - 1} model processes did not start within "
                f"{READY_TIMEOUT_S:g} s (exit codes {codes}); see the log above"
            ) from e
        for _ in range(repeat):
            for busy in (False, True):
                if busy:
                    run.set()
                    time.sleep(PAUSE_S)  # NOTE: the co-runners are computing again
                for name, fn in (("prefill", prefill), ("decode", step)):
                    times.setdefault((name, busy), []).append(fn())
                run.clear()
                for done in idle:  # NOTE: their runs in progress end first
                    done.wait(READY_TIMEOUT_S)
    finally:
        stop.set()
        run.set()
        for p in others:
            p.join(timeout=READY_TIMEOUT_S)
            if p.is_alive():
                p.kill()

    def factor(name: str) -> float:
        ratio = statistics.median(times[name, True]) / statistics.median(times[name, False])
        return max(1.0, ratio)

    return CorunFactors(busy=workers, prefill=factor("prefill"), decode=factor("decode"))


def _prefill_loop(
    model: str,
    dtype: str,
    block_tokens: int,
    chunk_tokens: int,
    blocks: int,
    cpu_gemm: str,
    ids: list[int],
    ready: BarrierT,
    run: EventT,
    stop: EventT,
    idle: EventT,
) -> None:
    """A co-running node: its own weights, one thread, prefills while `run` is set (and
    says it is `idle` when not), until `stop`."""
    import torch

    from mooncake.model.info import load_model_info

    torch.set_num_threads(1)
    bench = Bench(load_model_info(model), dtype, block_tokens, chunk_tokens, blocks, cpu_gemm)
    bench.run(bench.plain, ids)
    ready.wait(timeout=READY_TIMEOUT_S)
    while not stop.is_set():
        if run.is_set():
            idle.clear()
            bench.run(bench.plain, ids)
        else:
            idle.set()
            run.wait(PAUSE_S)


def _scaled(poly: Poly2, factor: float) -> Poly2:
    terms = tuple(Term(powers=t.powers, coef=t.coef * factor) for t in poly.terms)
    return msgspec.structs.replace(poly, terms=terms)


def scale_cost_model(model: CostModel, corun: CorunFactors) -> CostModel:
    """`model` with its prefill and decode times multiplied by `corun`'s factors (recorded
    in the file's `corun`; the device line says so)."""
    spec = model.spec
    return CostModel(
        msgspec.structs.replace(
            spec,
            device=f"{spec.device}, {corun.busy} nodes computing at once "
            f"(prefill x{corun.prefill:.2f}, decode x{corun.decode:.2f})",
            prefill=_scaled(spec.prefill, corun.prefill),
            decode=_scaled(spec.decode, corun.decode),
            corun=corun,
        )
    )

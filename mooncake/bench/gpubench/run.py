"""`scripts/gpubench` (`python -m mooncake.bench.gpubench`): the engine on one GPU.

    scripts/gpubench [--sections a,b] [--quick] [--cpu-smoke] [--out FILE] [--json]

Prints one JSON document on stdout (progress on stderr): the limits, a verdict against
issue 33's targets (and issue 34's Mixtral figures, which have none), then each section's
figures beside their limits and its seconds; a section that raises is recorded as
{"error": ...} and the others still run. Exit 1 when a correctness check, a section or a
target failed; without a CUDA GPU it prints {"gpu": null, "reason": ...} and exits 0.
`--cpu-smoke` runs every section at tiny shapes in float32 on the CPU, Triton under its
interpreter (the test suite does, in seconds).

Imports only torch, triton and the engine's model/ modules, so it starts in seconds.
About 5 minutes and under 100 GB on an H200 (the 8B weights, 16 GB, and at most 69 GB of
KV for the decode at B = 128 with 4k context; the 90% cache after that one is freed); the
families section adds six small models one at a time (at most 12 GB, 4 of Mixtral's
layers), expected to take well under a minute (it has not run on a GPU yet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from mooncake.model.llama import Model

from .bed import load_model, progress, release_memory
from .config import CPU_SMOKE, GPU, BenchConfig, quick
from .correctness import run_correctness
from .decode import run_decode
from .families import run_families
from .kvsize import run_kvsize
from .launches import run_launches
from .limits import Limits, measure_limits
from .prefill import run_prefill
from .sampling import run_sampling

# NOTE: nothing imported here imports triton, so --cpu-smoke can still set TRITON_INTERPRET
SECTIONS = (
    "correctness",
    "decode",
    "launches",
    "sampling",
    "prefill",
    "families",
    "kvsize",
    "attention",
)
NEEDS_MODEL = {"decode", "launches", "prefill", "kvsize"}  # the 8B model, loaded once


def run_section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one section into report["sections"]; a failure is recorded and the run goes on
    (a report with the error beats no report on a leased GPU)."""
    progress(f"{name} ...")
    start = time.perf_counter()
    try:
        body = report["sections"][name] = fn()
        rows = body.get("rows") if isinstance(body, dict) else None
        if isinstance(rows, list) and any("error" in r for r in rows):  # some cases failed
            report["failed"].append(name)
    except Exception as e:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        report["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": tail}
        report["failed"].append(name)
        release_memory("cuda" if torch.cuda.is_available() else "cpu")
    report["seconds"][name] = round(time.perf_counter() - start, 2)
    status = "failed" if name in report["failed"] else "done"
    progress(f"{name} {status} in {report['seconds'][name]:.1f} s")


def _rows(report: dict[str, Any], section: str) -> list[dict[str, Any]]:
    """The rows of a section that were measured (not skipped, no error)."""
    body = report["sections"].get(section)
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
        return []
    return [r for r in body["rows"] if "skipped" not in r and "error" not in r]


def _target(target: str, value: float | None, passed: bool | None) -> dict[str, Any]:
    return {"target": target, "value": value, "pass": passed}


def verdict(report: dict[str, Any], is_gpu: bool) -> dict[str, Any]:
    """Issue 33's targets, each {target, value, pass}; pass is null without a figure
    (its section failed or was not run), in --cpu-smoke (figures of no meaning) and for
    the informational figures (issue 34's Mixtral decode step against its roofline)."""
    decode = [r for r in _rows(report, "decode") if r["cuda_graphs"] == is_gpu]
    wide = [r["share_of_hbm"] for r in decode if r["batch"] >= 32]
    single = [r["roofline_ratio"] for r in decode if r["batch"] == 1]
    prefill = report["sections"].get("prefill")
    default_chunk = prefill.get("default_chunk_tokens") if isinstance(prefill, dict) else None
    mfu = [
        r["mfu"]
        for r in _rows(report, "prefill")
        if r["tokens"] == 8192 and not r["reused"] and r["chunk_tokens"] == default_chunk
    ]
    syncs = [r["host_syncs"] for r in _rows(report, "launches") if r["cuda_graphs"] == is_gpu]
    mixtral = {
        r["batch"]: r["roofline_ratio"]
        for r in _rows(report, "families")
        if r["family"] == "mixtral-8x7b" and r["case"] == "decode" and r["cuda_graphs"] == is_gpu
    }
    figures = {
        "decode_graphs_hbm_share_b32_up": (">= 0.70 at every B >= 32", min(wide, default=None)),
        "decode_graphs_b1_roofline_ratio": ("<= 2.0", max(single, default=None)),
        "prefill_mfu_8k": (">= 0.40 (default chunk, no reuse)", mfu[0] if mfu else None),
        "host_syncs_per_decode_step": ("== 1 (CUDA graphs)", syncs[0] if syncs else None),
        # issue 34 names no target for these: figures only, never a pass or a fail
        "mixtral_decode_b1_roofline_ratio": ("none (informational)", mixtral.get(1)),
        "mixtral_decode_wide_roofline_ratio": (
            "none (informational): the widest batch run, B = 32 on a GPU",
            mixtral[max(mixtral)] if mixtral else None,
        ),
    }
    checks = {
        "decode_graphs_hbm_share_b32_up": lambda v: v >= 0.70,
        "decode_graphs_b1_roofline_ratio": lambda v: v <= 2.0,
        "prefill_mfu_8k": lambda v: v >= 0.40,
        "host_syncs_per_decode_step": lambda v: v == 1,
    }
    out = {}
    for name, (target, value) in figures.items():
        check = checks.get(name)
        passed = None if value is None or not is_gpu or check is None else bool(check(value))
        out[name] = _target(target, value, passed)
    return out


def run(
    cfg: BenchConfig,
    sections: tuple[str, ...],
    save: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """Every asked section in SECTIONS' order; the report (see the module docstring),
    handed to `save` after each section too, so a run cut short leaves what it measured."""
    import triton

    start = time.perf_counter()
    report: dict[str, Any] = {"gpu": None, "mode": "gpu" if cfg.is_gpu else "cpu-smoke"}
    if cfg.is_gpu:
        report["gpu"] = torch.cuda.get_device_name()
    report["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    report["config"] = {k: v for k, v in asdict(cfg).items() if k != "attention"}
    report.update(verdict=None, failed=[], limits=None, seconds={}, sections={})
    limits = measure_limits(cfg.device, cfg.copy_bytes)
    report["limits"] = asdict(limits)
    model: Model | None = None
    if NEEDS_MODEL & set(sections):
        t0 = time.perf_counter()
        try:
            model = load_model(cfg)
        except Exception as e:  # the sections that need it say so below
            report["model_error"] = f"{type(e).__name__}: {e}"
        report["seconds"]["model_load"] = round(time.perf_counter() - t0, 2)
        status = "failed to load" if model is None else "loaded"
        progress(f"{cfg.model_path} {status} in {report['seconds']['model_load']:.1f} s")
    for name in SECTIONS:
        if name not in sections:
            continue
        if name in NEEDS_MODEL and model is None:
            report["sections"][name] = {"error": f"no model: {report['model_error']}"}
            report["failed"].append(name)
            continue
        run_section(report, name, _section_fn(name, cfg, model, limits))
        save(report)
    report["verdict"] = verdict(report, cfg.is_gpu)
    correctness = report["sections"].get("correctness")
    if isinstance(correctness, dict) and correctness.get("ok") is False:
        report["failed"].append("correctness checks")
    report["failed"] += [n for n, v in report["verdict"].items() if v["pass"] is False]
    report["seconds"]["total"] = round(time.perf_counter() - start, 2)
    save(report)
    return report


def _section_fn(
    name: str, cfg: BenchConfig, model: Model | None, limits: Limits
) -> Callable[[], Any]:
    """The call that runs section `name`."""
    if name == "correctness":
        return lambda: run_correctness(cfg)
    if name == "sampling":
        return lambda: run_sampling(cfg, limits)
    if name == "attention":
        return lambda: attention_kernels(cfg, limits)
    if name == "families":
        return lambda: run_families(cfg, limits)
    assert model is not None, name
    if name == "decode":
        return lambda: run_decode(cfg, model, limits)
    if name == "launches":
        return lambda: run_launches(cfg, model)
    if name == "prefill":
        return lambda: run_prefill(cfg, model, limits)
    assert name == "kvsize", name
    return lambda: run_kvsize(cfg, model)


def attention_kernels(cfg: BenchConfig, limits: Limits) -> dict[str, Any]:
    """The attention kernels alone (gpucheck's timings), beside the whole step's: one
    layer's decode attention and the 2k chunk after an 8k prefix. Their share_of_hbm is
    against gpucheck's H200 figure; share_of_copy against this device's copy."""
    from mooncake.model.attention import gpucheck

    return {
        "decode": gpucheck.decode_speed(cfg.attention, limits.copy_GBps),
        "prefill": gpucheck.prefill_speed(cfg.attention),
    }


def parse_sections(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; sections: {', '.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/gpubench", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--sections",
        type=parse_sections,
        default=SECTIONS,
        help=f"comma-separated subset of: {','.join(SECTIONS)} (default: all, in that order)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats: noisier, faster")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="every section at tiny shapes in float32 on the CPU, Triton interpreted",
    )
    parser.add_argument("--json", action="store_true", help="one compact JSON line")
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="also write the report to FILE, after every section (a run killed at a time "
        "limit leaves the sections it finished)",
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton's kernels are defined
        torch.set_num_threads(1)
        cfg = CPU_SMOKE
    elif not torch.cuda.is_available():
        reason = f"torch {torch.__version__} sees no CUDA GPU; --cpu-smoke runs on the CPU"
        print("gpubench: " + reason, file=sys.stderr)
        print(json.dumps({"gpu": None, "reason": reason}))
        return 0
    else:
        cfg = GPU
    if args.quick:
        cfg = quick(cfg)
    indent = None if args.json else 1

    def save(report: dict[str, Any]) -> None:
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(report, f, indent=indent)
            os.replace(args.out + ".tmp", args.out)  # NOTE: never a half-written file

    report = run(cfg, args.sections, save)
    print(json.dumps(report, indent=indent))
    return 1 if report["failed"] else 0

"""scripts/gpubench: every section runs at tiny shapes on the CPU (`--cpu-smoke`, Triton
interpreted) into one JSON document; the verdict judges the issue's targets from the
figures; without a GPU the bench says so and exits 0."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the engine bench needs torch")
import torch  # noqa: E402

if not torch.cuda.is_available():  # NOTE: before triton's import, which reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the engine bench needs triton (pip install triton)")

from mooncake.bench.gpubench import run  # noqa: E402
from mooncake.bench.gpubench.config import CPU_SMOKE  # noqa: E402

cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the kernels here are compiled, not interpreted"
)


@cpu_only
def test_cpu_smoke_runs_every_section_into_one_json_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every section, no error, correctness ok, each figure beside its limit; verdict
    values but no pass/fail on the CPU."""
    assert run.main(["--cpu-smoke", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] == [], report["failed"]
    assert report["mode"] == "cpu-smoke" and report["gpu"] is None
    sections = report["sections"]
    assert list(sections) == list(run.SECTIONS)
    assert all("error" not in body for body in sections.values()), sections
    assert set(report["seconds"]) >= {*run.SECTIONS, "total", "model_load"}

    correctness = sections["correctness"]
    assert correctness["ok"] and correctness["greedy"]["cases"][0]["first_mismatch"] == [
        None
    ] * len(CPU_SMOKE.check_prompt_lens)
    assert all(len(t) == CPU_SMOKE.check_tokens for t in correctness["greedy"]["reference_tokens"])

    decode = sections["decode"]["rows"]
    cases = {(r["batch"], r["context"]) for r in decode}
    assert cases == {(b, c) for b in CPU_SMOKE.decode_batches for c in CPU_SMOKE.decode_contexts}
    for r in decode:
        assert r["ms_per_step"] > 0 and r["weight_bytes"] > 0 and r["kv_bytes"] > 0
        assert r["roofline_ratio"] == pytest.approx(r["ms_per_step"] / r["roofline_ms"])
        assert r["share_of_hbm"] == pytest.approx(r["GBps"] / report["limits"]["hbm_GBps"])

    (launch,) = sections["launches"]["rows"]
    assert launch["ops"] > 0 and launch["op_syncs"] >= 1 and launch["kernels"] is None

    assert {r["case"] for r in sections["sampling"]["rows"]} == {"greedy", "temperature_top_p"}
    prefill = sections["prefill"]["rows"]
    assert len(prefill) == 2 * len(CPU_SMOKE.prefill_lens) * len(CPU_SMOKE.prefill_chunks)
    for r in prefill:
        assert r["TFLOPs"] > 0 and r["mfu"] is None  # no bf16 peak for a CPU
    whole, half = prefill[-2], prefill[-1]
    assert half["reused"] == whole["tokens"] // 2 and half["flops"] < whole["flops"]

    kv = sections["kvsize"]
    assert kv["ran"] and kv["kv_bytes"] <= CPU_SMOKE.kv_fraction * CPU_SMOKE.cpu_free_bytes
    assert kv["num_tokens"] == kv["num_blocks"] * kv["block_tokens"]

    assert all(v["pass"] is None for v in report["verdict"].values())
    assert report["verdict"]["decode_graphs_b1_roofline_ratio"]["value"] > 0


@cpu_only
def test_sections_pick_a_subset_and_a_failing_one_is_recorded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--sections runs only those named, in the bench's order; a section that raises is
    {"error": ...} in the report, the next still runs, and the exit status is 1; --out
    holds the same report."""

    def broken(*args: Any) -> None:
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr("mooncake.bench.gpubench.run.run_sampling", broken)
    out = tmp_path / "report.json"
    args = ["--cpu-smoke", "--quick", "--json", "--sections", "sampling,launches"]
    assert run.main([*args, "--out", str(out)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    assert list(report["sections"]) == ["launches", "sampling"]
    assert report["sections"]["sampling"]["error"] == "RuntimeError: out of memory, say"
    assert report["failed"] == ["sampling"] and report["sections"]["launches"]["rows"]


def test_without_a_gpu_it_says_so_and_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu"] is None and "no CUDA GPU" in report["reason"]


def _report(**sections: Any) -> dict[str, Any]:
    return {"sections": sections}


def test_the_verdict_judges_each_target_from_the_graph_figures() -> None:
    """Each target passes or fails by its figure on a GPU; a missing figure is null."""
    decode = {
        "rows": [
            {"batch": 1, "cuda_graphs": True, "share_of_hbm": 0.3, "roofline_ratio": 1.8},
            {"batch": 32, "cuda_graphs": True, "share_of_hbm": 0.75, "roofline_ratio": 1.3},
            {"batch": 128, "cuda_graphs": True, "share_of_hbm": 0.65, "roofline_ratio": 1.5},
            {"batch": 128, "cuda_graphs": False, "share_of_hbm": 0.9, "roofline_ratio": 1.1},
            {"batch": 1, "cuda_graphs": True, "skipped": "too big"},
            {"batch": 128, "cuda_graphs": True, "error": "OutOfMemoryError: CUDA out of memory"},
        ]
    }
    prefill = {
        "default_chunk_tokens": 1024,
        "rows": [
            {"tokens": 8192, "reused": 0, "chunk_tokens": 1024, "mfu": 0.45},
            {"tokens": 8192, "reused": 4096, "chunk_tokens": 1024, "mfu": 0.2},
            {"tokens": 8192, "reused": 0, "chunk_tokens": 8192, "mfu": 0.1},
        ],
    }
    launches = {
        "rows": [{"cuda_graphs": False, "host_syncs": 1}, {"cuda_graphs": True, "host_syncs": 2}]
    }
    v = run.verdict(_report(decode=decode, prefill=prefill, launches=launches), is_gpu=True)
    assert v["decode_graphs_hbm_share_b32_up"] == {
        "target": ">= 0.70 at every B >= 32",
        "value": 0.65,
        "pass": False,
    }
    assert v["decode_graphs_b1_roofline_ratio"]["pass"] is True
    assert v["prefill_mfu_8k"]["value"] == 0.45 and v["prefill_mfu_8k"]["pass"] is True
    assert v["host_syncs_per_decode_step"]["value"] == 2
    assert v["host_syncs_per_decode_step"]["pass"] is False
    failed = {"error": "CUDA out of memory"}
    v = run.verdict(_report(decode=failed), is_gpu=True)
    assert all(t["value"] is None and t["pass"] is None for t in v.values())


def test_a_trace_is_tallied_into_kernels_launches_and_syncs_of_the_step() -> None:
    """Kernels of the GPU (not the step's GPU-side annotation, not memcpy), and the host's
    launching and waiting calls inside the step's range only (the profiler's own sync
    after the step is not the step's)."""
    from types import SimpleNamespace

    from mooncake.bench.gpubench.launches import STEP_LABEL, tally_trace

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name: str, device: Any, start: float, annotation: bool = False) -> Any:
        span = SimpleNamespace(start=start, end=start + 1)
        return SimpleNamespace(
            name=name, device_type=device, time_range=span, is_user_annotation=annotation
        )

    step = event(STEP_LABEL, cpu, 10)
    step.time_range.end = 50
    trace = [
        event(STEP_LABEL, cuda, 12, annotation=True),
        step,
        event("cudaGraphLaunch", cpu, 20),
        event("cuLaunchKernelEx", cpu, 21),
        event("cudaMemcpyAsync", cpu, 22),
        event("cudaEventSynchronize", cpu, 45),
        event("cudaDeviceSynchronize", cpu, 60),  # after the step
        event("triton_paged_attention", cuda, 30),
        event("ampere_bf16_gemm", cuda, 31),
        event("Memcpy HtoD (Pinned -> Device)", cuda, 25),
        event("aten::mm", cpu, 30),
    ]
    assert tally_trace(trace) == {
        "kernels": 2,
        "memcpy_memset": 1,
        "host_launches": 2,
        "host_syncs": 1,
        "host_calls": {"cudaGraphLaunch": 1, "cuLaunchKernelEx": 1, "cudaEventSynchronize": 1},
    }


def test_a_section_with_one_failed_case_keeps_the_others_and_fails() -> None:
    report: dict[str, Any] = {"sections": {}, "failed": [], "seconds": {}}
    rows = [{"batch": 1, "error": "OutOfMemoryError"}, {"batch": 2, "ms_per_step": 1.0}]
    run.run_section(report, "decode", lambda: {"rows": rows})
    assert report["failed"] == ["decode"] and report["sections"]["decode"]["rows"] == rows

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

from mooncake.bench.gpubench import families, run  # noqa: E402
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

    assert {r["case"] for r in sections["sampling"]["rows"]} == {
        "greedy",
        "temperature_top_p",
        "temperature_top_p_bias_min_tokens",
    }
    prefill = sections["prefill"]["rows"]
    assert len(prefill) == 2 * len(CPU_SMOKE.prefill_lens) * len(CPU_SMOKE.prefill_chunks)
    for r in prefill:
        assert r["TFLOPs"] > 0 and r["mfu"] is None  # no bf16 peak for a CPU
    whole, half = prefill[-2], prefill[-1]
    assert half["reused"] == whole["tokens"] // 2 and half["flops"] < whole["flops"]

    kv = sections["kvsize"]
    assert kv["ran"] and kv["kv_bytes"] <= CPU_SMOKE.kv_fraction * CPU_SMOKE.cpu_free_bytes
    assert kv["num_tokens"] == kv["num_blocks"] * kv["block_tokens"]

    _check_families(sections["families"])

    assert all(v["pass"] is None for v in report["verdict"].values())
    assert report["verdict"]["decode_graphs_b1_roofline_ratio"]["value"] > 0
    assert report["verdict"]["mixtral_decode_b1_roofline_ratio"]["value"] > 0
    wide = report["verdict"]["mixtral_decode_wide_roofline_ratio"]["value"]
    assert wide == next(
        r["roofline_ratio"]
        for r in sections["families"]["rows"]
        if r["family"] == "mixtral-8x7b" and r.get("batch") == max(CPU_SMOKE.family_batches)
    )


def _check_families(body: dict[str, Any]) -> None:
    """Every family has a decode row per batch and a prefill row; an MoE family's decode
    rows read fewer expert bytes than the all-experts bound at B = 1, and as many experts
    are routed to as uniform routing expects at B = 1 (each token's k distinct ones)."""
    assert list(body["families"]) == list(families.TINY)
    for name, info in families.TINY.items():
        rows = [r for r in body["rows"] if r["family"] == name]
        decode = [r for r in rows if r["case"] == "decode"]
        assert [r["batch"] for r in decode] == list(CPU_SMOKE.family_batches), name
        (prefill,) = [r for r in rows if r["case"] == "prefill"]
        assert prefill["tokens"] == CPU_SMOKE.family_prefill_tokens and prefill["TFLOPs"] > 0
        spec = info.spec
        assert body["families"][name]["spec"]["num_layers"] == CPU_SMOKE.family_layers
        for r in decode:
            assert r["ms_per_step"] > 0 and r["roofline_ratio"] > 0, (name, r)
            assert ("experts_touched" in r) == (spec.num_experts > 0), (name, r)
        if spec.sliding_window is not None:  # the window, not the context, is read
            (one,) = [r for r in decode if r["batch"] == 1]
            per_token = spec.kv_bytes_per_token(4) // spec.num_layers * CPU_SMOKE.family_layers
            assert one["kv_bytes"] == spec.sliding_window * per_token
        if not spec.num_experts:
            continue
        k = spec.num_experts_per_tok
        for r in decode:
            assert r["weight_bytes"] <= r["weight_bytes_all_experts"]
            assert r["roofline_ratio_all_experts"] <= r["roofline_ratio"]
            assert k <= r["experts_routed"] <= min(spec.num_experts, k * r["batch"])
        (one,) = [r for r in decode if r["batch"] == 1]
        assert one["experts_touched"] == k == one["experts_routed"]
        assert one["weight_bytes"] < one["weight_bytes_all_experts"]


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


def test_expected_experts_touched_is_k_for_one_token_and_nears_all_for_many() -> None:
    """E * (1 - (1 - k/E)^B): one token touches its k experts; k = E touches all; B tokens
    touch what an exact count over every routing of 2 tokens says."""
    from itertools import combinations, product

    from mooncake.bench.gpubench.bed import experts_touched

    assert experts_touched(8, 2, 1) == pytest.approx(2)
    assert experts_touched(8, 8, 5) == pytest.approx(8)
    assert experts_touched(8, 2, 32) == pytest.approx(8 * (1 - 0.75**32))
    choices = list(combinations(range(6), 2))  # each token: 2 distinct of 6, uniformly
    mean = sum(len({*a, *b}) for a, b in product(choices, choices)) / len(choices) ** 2
    assert experts_touched(6, 2, 2) == pytest.approx(mean)


def test_an_moe_step_reads_the_experts_its_batch_routes_to() -> None:
    """At B = 1 a Mixtral step reads the weights one token multiplies (2 experts of 8 in
    each layer), its embedding row and the LM head; the bound reads all 8."""
    from mooncake.bench.gpubench.bed import weight_bytes_per_step
    from mooncake.model.info import load_model_info
    from mooncake.model.weights import create_model

    model = create_model(load_model_info("dummy:mixtral-8x7b"), "bfloat16", "meta")
    spec = model.spec
    one_token = spec.num_matmul_params + spec.vocab_size * spec.hidden_size + 2 * spec.hidden_size
    assert weight_bytes_per_step(model, 1) == 2 * one_token
    every = weight_bytes_per_step(model, 1, all_experts=True)
    assert every == 2 * (spec.num_params - (spec.vocab_size - 1) * spec.hidden_size)


def test_family_shapes_give_the_published_parameter_counts() -> None:
    """The bench's real shapes against each model card's parameter count (total, and
    activated per token for MoE), and each tiny family carries its real one's features."""
    published = {  # billions: (total, activated)
        "llama3-8b": (8.03, 8.03),
        "qwen2.5-7b": (7.61, 7.61),
        "qwen3-8b": (8.19, 8.19),
        "mistral-7b": (7.24, 7.24),
        "mixtral-8x7b": (46.7, 12.9),
        "qwen3-30b-a3b": (30.5, 3.3),
    }
    assert list(families.REAL) == list(published) == list(families.TINY)
    for name, (total, active) in published.items():
        real, tiny = families.REAL[name], families.TINY[name]
        s = real.spec
        activated = s.num_matmul_params + 2 * s.vocab_size * s.hidden_size + s.hidden_size
        assert s.num_params / 1e9 == pytest.approx(total, rel=0.01), name
        assert activated / 1e9 == pytest.approx(active, rel=0.03), name

        def features(info: Any) -> tuple[Any, ...]:
            t = info.spec
            window = t.sliding_window is not None
            return (info.qkv_bias, t.qk_norm, window, t.num_experts > 0, t.norm_topk_prob)

        assert features(tiny) == features(real), name
        if tiny.spec.sliding_window is not None:
            assert tiny.spec.sliding_window < CPU_SMOKE.family_context
    cut = families.with_layers(families.REAL["qwen3-30b-a3b"], 4)
    assert cut.spec.num_layers == 4 and cut.spec.num_moe_layers == 4


def test_the_mixtral_figures_are_in_the_verdict_without_a_pass_or_fail() -> None:
    """Issue 34 names no target: the values are there on a GPU, pass stays null."""
    rows = [
        {
            "family": "mixtral-8x7b",
            "case": "decode",
            "batch": b,
            "cuda_graphs": g,
            "roofline_ratio": r,
        }
        for b, g, r in [(1, True, 1.5), (32, True, 3.0), (32, False, 9.0)]
    ]
    rows.append({"family": "mixtral-8x7b", "case": "prefill", "tokens": 2048})
    v = run.verdict(_report(families={"rows": rows}), is_gpu=True)
    assert v["mixtral_decode_b1_roofline_ratio"] == {
        "target": "none (informational)",
        "value": 1.5,
        "pass": None,
    }
    assert v["mixtral_decode_wide_roofline_ratio"]["value"] == 3.0
    assert v["mixtral_decode_wide_roofline_ratio"]["pass"] is None


@cpu_only
def test_a_family_that_fails_to_load_is_a_row_and_the_next_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import replace

    from mooncake.bench.gpubench.limits import measure_limits

    real_load = families.load_model

    def load(cfg: Any, info: Any) -> Any:
        if info.spec.qk_norm:
            raise RuntimeError("CUDA out of memory, say")
        return real_load(cfg, info)

    monkeypatch.setattr(families, "load_model", load)
    two = {name: families.TINY[name] for name in ("qwen3-8b", "llama3-8b")}
    monkeypatch.setattr(families, "TINY", two)
    cfg = replace(CPU_SMOKE, family_batches=(1,), family_prefill_tokens=0, timed_steps=1)
    body = families.run_families(cfg, measure_limits("cpu", 1 << 20))
    failed, *rows = body["rows"]
    assert failed == {
        "family": "qwen3-8b",
        "case": "load",
        "error": "RuntimeError: CUDA out of memory, say",
    }
    assert list(body["families"]) == ["llama3-8b"]
    assert [(r["family"], r["case"], r["batch"]) for r in rows] == [("llama3-8b", "decode", 1)]

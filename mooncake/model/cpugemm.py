"""CPU matmuls through oneDNN with weights packed once at load (`model.cpu_gemm`).

`torch.nn.functional.linear` on a CPU tensor calls MKL's sgemm with the plain row-major
weight; oneDNN (shipped inside torch) can instead reorder each weight once into the blocked
layout its kernels read best and keep it. vLLM's CPU backend does the same
(`dispatch_cpu_unquantized_gemm`: `create_onednn_mm(weight.t(), 32)`). On an AMD EPYC
(Zen 4) core, one layer of `dummy:small` (2048 hidden, 7168 MLP):

    rows   MKL      oneDNN packed
    1024   1.29 s   1.04 s     prefill chunk: 1.24x
    4      29 ms    10 ms      decode batch: 2.9x
    1      11 ms    13 ms      (padded to 4 rows: 10 ms)

Decode steps are memory-bound, and MKL's small-row kernels reach half the bandwidth of
oneDNN's. A batch of fewer than `MIN_ROWS` rows is padded to `MIN_ROWS`: the blocked kernels
stream the weight the same for 1 row or 4, and the 4-row kernel streams it faster.

`pack_linears` swaps every `nn.Linear` of a model for a `PackedLinear` after its weights
are loaded, once it has checked on a small input that oneDNN gives F.linear's result; if
oneDNN is missing (a torch built without it, another architecture), cannot handle the
dtype, or disagrees, the model keeps its `nn.Linear`s and the reason is logged. GPU models
are never packed: cuBLAS already owns their layout.

Each row count is a new product shape, and oneDNN (its primitive cache) and ideep (torch's
wrapper, its LRU cache) each keep one entry per shape, 1,024 by default: ~400 KiB of
malloc'd memory per shape for `dummy:tiny`, more for larger weights. Decode's row counts
are few (batch sizes, padded), but a prefill chunk's are any of 1..`chunk_tokens`, so a
prefill node's caches fill for its first thousand-odd shapes: +230 MiB of private memory
over a 600 s soak, and evictions past the bound fragment the heap further.
`limit_shape_caches` bounds both before their first use; a prefill node keeps
`PREFILL_SHAPE_ENTRIES` (a chunk's layers share its few shapes, so only a chunk's first
layer builds them: ~0.4 ms each, against a chunk's milliseconds to seconds).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

MIN_ROWS = 4  # fewer rows are padded up to this many (see the table above)
PACK_BATCH_HINT = 32  # the row count oneDNN picks its weight layout for, as vLLM's
CPU_GEMMS = ("onednn", "torch")
PREFILL_SHAPE_ENTRIES = 64  # cached product shapes on a prefill node (see above)
SHAPE_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN, ideep


def limit_shape_caches(entries: int) -> dict[str, str]:
    """Bound oneDNN's and ideep's per-shape caches to `entries` each in this process, unless
    the environment already sets them; returns the values in force. Both read their bound
    once, at their first use: call this before the model loads."""
    assert entries >= 1, entries  # NOTE: ideep fails on a capacity of 0
    return {name: os.environ.setdefault(name, str(entries)) for name in SHAPE_CACHE_VARS}


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W in oneDNN's packed layout (no `weight` parameter left)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    @property
    def weight(self) -> Tensor:
        """The plain (out, in) weight, unpacked into a new tensor (for inspection)."""
        return self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows < MIN_ROWS:
            x2 = torch.cat((x2, x2.new_zeros(MIN_ROWS - rows, self.in_features)))
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y[:rows].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def _why_not(linear: nn.Linear) -> str | None:
    """None when oneDNN computes this layer's product correctly here; else the reason."""
    weight = linear.weight
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type}"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bf16 instructions for oneDNN"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN linear does not take {weight.dtype}"
    try:
        packed = PackedLinear(linear)
        probe = torch.randn(MIN_ROWS + 3, linear.in_features).to(weight.dtype)
        with torch.no_grad():  # a padded batch and a full one
            pairs = [(packed(x).float(), linear(x).float()) for x in (probe[:2], probe)]
    except RuntimeError as e:
        return f"oneDNN failed: {e}"
    tol = 1e-3 if weight.dtype == torch.float32 else 3e-2
    for a, b in pairs:
        if not torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max().clamp(min=1.0))):
            return "oneDNN's result differs from F.linear's"
    return None


def pack_linears(model: nn.Module, cpu_gemm: str = "onednn") -> int:
    """Swap `model`'s `nn.Linear`s for `PackedLinear`s (cpu_gemm "onednn"); returns how
    many were swapped. "torch" keeps F.linear (MKL on x86)."""
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm {cpu_gemm!r}: allowed are {', '.join(CPU_GEMMS)}")
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    if cpu_gemm == "torch" or not linears:
        return 0
    if (reason := _why_not(linears[0][1])) is not None:
        log.info("CPU matmuls stay on torch's F.linear: %s", reason)
        return 0
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear))
    return len(linears)

"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `num_experts_per_tok` (k)
of `num_experts` (E) SwiGLU experts for each token, and the token's output is the sum of
their outputs weighted by the router's probabilities.

Routing is transformers' (`MixtralTopKRouter`, `Qwen3MoeTopKRouter`): softmax over the
router logits in float32, top-k, then (Mixtral always, Qwen3-MoE when `norm_topk_prob`)
the k probabilities rescaled to sum to 1.

The experts run grouped, never in a Python loop over experts. Their weights are stacked as
transformers 5 stores them, `gate_up_proj` (E, 2I, H) (gate rows first) and `down_proj`
(E, H, I); the T * k (token, expert) pairs are sorted by expert, so each expert's pairs
form one contiguous run, and one grouped GEMM per projection (`F.grouped_mm`, the runs
delimited by `offsets`) multiplies every run by its expert's weights, reading only the
experts some token chose. The run ends come from `searchsorted` on the device, so a step
dispatches the same ops for 4 experts or 128 and never waits for the host (tests count
both with `mooncake.bench.stepops`).

| tensor          | shape    | what                                                   |
|-----------------|----------|--------------------------------------------------------|
| `expert_ids`    | (T, k)   | the router's choices, token-major                      |
| `order`         | (P,)     | pair indices (P = T * k) sorted by expert, stable      |
| `offsets`       | (E,)     | int32, end of expert e's run in the sorted pairs       |
| `x_sorted`      | (P, H)   | the token of each sorted pair                          |
| `y`             | (P, H)   | each sorted pair's expert output, unsorted back to (T, k, H) |

`checkpoint_sources` finds the experts in either layout a checkpoint may hold: stacked as
above, or one tensor per expert (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`,
Qwen3-MoE's `mlp.experts.{e}.gate_proj/up_proj/down_proj`).

Under tensor parallelism (`parallel`, `shardplan`) every rank holds every expert at 1/n of
its width (its gate and up rows, its down columns, as a dense MLP is split), the router
whole; each rank routes alike and sums its partial outputs, all-reduced after the layer.

NOTE: on a GPU, `F.grouped_mm` has its fast kernels for bfloat16 on SM >= 80 (H100, H200);
a Triton grouped GEMM for the other cases, and experts placed on different ranks (expert
parallelism), are not done yet. Tensor-parallel MoE has run over gloo on CPUs only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mooncake.errors import ConfigError
from mooncake.model.spec import ModelSpec


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights, run grouped over (token, expert) pairs."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        if not hasattr(F, "grouped_mm"):
            raise ConfigError(
                f"mixture-of-experts models need torch.nn.functional.grouped_mm, which torch "
                f"{torch.__version__} lacks; install a newer torch"
            )
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """(T, H): each token's experts' outputs summed with `weights`.

        x: (T, H); expert_ids: (T, k) int64; weights: (T, k) float32."""
        t, k = expert_ids.shape
        pairs = expert_ids.flatten()  # (P,) pair p = token p // k, its (p % k)-th choice
        sorted_ids, order = pairs.sort(stable=True)
        all_ids = torch.arange(self.down_proj.shape[0], device=x.device)
        offsets = torch.searchsorted(sorted_ids, all_ids, right=True).to(torch.int32)
        x_sorted = x.index_select(0, order // k)  # (P, H)
        gate, up = F.grouped_mm(x_sorted, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(
            2, dim=-1
        )  # (P, I) each
        y_sorted = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(t, k, -1)
        # NOTE: a sum over k in float32 rather than atomic adds: the same bits in any order
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: router (`gate`) and `experts`, named as transformers 5."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's expert ids (T, k) int64 and their weights (T, k) float32."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return expert_ids, weights

    def forward(self, x: Tensor) -> Tensor:
        # x: (T, H) -> (T, H)
        expert_ids, weights = self.route(x)
        return self.experts(x, expert_ids, weights)


# local expert parameter -> the per-expert tensors older checkpoints hold instead (Mixtral's
# w1/w3/w2, Qwen3-MoE's gate/up/down), concatenated per expert along dim 0, then stacked
_EXPERT_PARTS = {
    "mlp.experts.gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
    "mlp.experts.down_proj": (("w2",), ("down_proj",)),
}
_BLOCKS = ("mlp.", "block_sparse_moe.")  # transformers 5 / Mixtral's original name


def is_moe_param(suffix: str) -> bool:
    """Whether a decoder layer's parameter `suffix` ("mlp.gate.weight") is a SparseMoE's."""
    return suffix == "mlp.gate.weight" or suffix in _EXPERT_PARTS


def checkpoint_sources(
    has: Callable[[str], bool], prefix: str, suffix: str, num_experts: int
) -> tuple[list[list[str]], bool]:
    """Where a SparseMoE parameter `suffix` of the layer whose checkpoint names start with
    `prefix` ("model.layers.3.") is, in either layout: ([[name]], False) for one tensor
    holding it all (the router; stacked experts `mlp.experts.gate_up_proj` (E, 2I, H),
    transformers 5), or (a list of names per expert, True) for one tensor per expert
    (`block_sparse_moe.experts.{e}.w1.weight`, `mlp.experts.{e}.gate_proj.weight`, ...):
    expert e's slab is its names' tensors concatenated along dim 0, and the parameter
    their stack. A name the checkpoint lacks is the stacked one (the reader names it)."""
    if suffix == "mlp.gate.weight":
        names = [f"{prefix}{block}gate.weight" for block in _BLOCKS]
        return [[next((n for n in names if has(n)), names[0])]], False
    if has(prefix + suffix):
        return [[prefix + suffix]], False
    for block in _BLOCKS:
        for parts in _EXPERT_PARTS[suffix]:
            if has(f"{prefix}{block}experts.0.{parts[0]}.weight"):
                groups = [
                    [f"{prefix}{block}experts.{e}.{p}.weight" for p in parts]
                    for e in range(num_experts)
                ]
                return groups, True
    return [[prefix + suffix]], False

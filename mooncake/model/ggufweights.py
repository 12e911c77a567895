"""GGUF weights into our model: each tensor dequantized (`dequant`) straight from the
memory map into its parameter, one tensor at a time, only for the layers a stage owns.

llama.cpp's names map onto ours as `ggufinfo.LAYER_SOURCES` says (q/k/v and gate/up fused
along dim 0, as for safetensors). For `llama` GGUFs, llama.cpp's converter reordered the
rows of each q and k head from HF's rotate-half layout to its interleaved RoPE pairs:

    gguf row (head, i, j)  <-  HF row (head, j, i),  i < head_dim / 2, j in {0, 1}

so we undo that (as transformers' GGUF loader does) while copying into the fused weight.
`qwen2` GGUFs keep HF's layout. Tied embeddings: the LM head is token_embd.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from mooncake.errors import ConfigError
from mooncake.model.dequant import dequantize
from mooncake.model.ggufinfo import ARCHITECTURES, LAYER_SOURCES
from mooncake.model.ggufread import GGUFFile
from mooncake.model.info import ModelInfo
from mooncake.model.llama import Model

log = logging.getLogger(__name__)
_GLOBAL_SOURCES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@torch.no_grad()
def load_gguf(model: Model, info: ModelInfo) -> None:
    """Fill `model`'s parameters (already materialized) from `info.gguf_file`."""
    g = GGUFFile(info.gguf_file)
    spec = info.spec
    permute = ARCHITECTURES[str(g.field("general.architecture"))]
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}
    scratch = torch.empty(0)  # float32, reused across tensors

    def put(param: Tensor, gguf_name: str) -> None:
        """Copy one tensor into `param` (a whole parameter or rows of a fused one)."""
        nonlocal scratch
        t = g.tensors.get(gguf_name)
        if t is None:
            raise ConfigError(f"model.path: {g.path.name} lacks tensor {gguf_name!r}")
        if t.shape != tuple(param.shape):
            raise ConfigError(
                f"model.path: {g.path.name}: {gguf_name} has shape {t.shape}, its metadata "
                f"implies {tuple(param.shape)}"
            )
        raw = torch.from_numpy(g.raw(t))
        kind = gguf_name.split(".")[-2]
        n_heads = heads.get(kind, 0) if permute else 0
        if param.dtype == torch.float32 and param.is_contiguous() and not n_heads:
            dequantize(raw, t.type_name, t.shape, out=param)  # no temporary
            return
        if scratch.numel() < param.numel():
            scratch = torch.empty(param.numel())
        value = dequantize(raw, t.type_name, t.shape, out=scratch[: param.numel()])
        if n_heads:  # (heads, head_dim / 2, 2, ...) -> (heads, 2, head_dim / 2, ...)
            rest = value.shape[1:]
            value = value.view(n_heads, -1, 2, *rest).transpose(1, 2)
            param = param.view(n_heads, 2, -1, *rest)
        param.copy_(value)

    for local, param in model.named_parameters():
        if not local.startswith("layers."):
            tied = local == "lm_head.weight" and spec.tie_word_embeddings
            put(param, "token_embd.weight" if tied else _GLOBAL_SOURCES[local])
            continue
        _, idx, suffix = local.split(".", 2)
        prefix = f"blk.{int(idx) + model.first_layer}."
        sources = [prefix + name for name in LAYER_SOURCES[suffix]]
        if len(sources) == 1:
            put(param, sources[0])
            continue
        rows = 0  # fused: each source fills the next rows
        for name in sources:
            n = g.tensors[name].shape[0] if name in g.tensors else 0
            put(param[rows : rows + n], name)
            rows += n
        if rows != param.shape[0]:
            raise ConfigError(
                f"model.path: {g.path.name}: {', '.join(sources)} have {rows} rows in all, "
                f"its metadata implies {param.shape[0]}"
            )
    log.info("loaded %s layers %d-%d", info.gguf_file, model.first_layer, model.end_layer - 1)

"""Model shapes: the numbers every part of mooncake derives sizes and costs from.

A `ModelSpec` is the architecture of a LLaMA-family decoder (no weights): the engine
builds its model from it, the Store sizes KV objects from `kv_bytes_per_token`, and the
Conductor's roofline cost model (`mooncake.conductor.roofline`) takes FLOPs and bytes from
it. Named specs:

| name                 | layers | hidden | heads/kv | head_dim | ffn      | vocab  |
|----------------------|-------:|-------:|---------:|---------:|---------:|-------:|
| `dummy:tiny`         | 4      | 256    | 4/2      | 64       | 768      | 512    |
| `dummy:small`        | 2      | 2048   | 16/4     | 128      | 7168     | 512    |
| `dummy:mixtral-tiny` | 2      | 64     | 4/2      | 16       | 4x 128   | 512    |
| `llama2-70b`         | 80     | 8192   | 64/8     | 128      | 28672    | 32000  |
| `llama3-8b`          | 32     | 4096   | 32/8     | 128      | 14336    | 128256 |
| `llama3-70b`         | 80     | 8192   | 64/8     | 128      | 28672    | 128256 |
| `mixtral-8x7b`       | 32     | 4096   | 32/8     | 128      | 8x 14336 | 32000  |

Sources: the `config.json` of meta-llama/Llama-2-70b-hf, Meta-Llama-3-8B, Meta-Llama-3-70B
and mistralai/Mixtral-8x7B-v0.1 on Hugging Face (46.7B weights, 12.9B per token).
`llama3.1-8b` / `llama3.1-70b` are the llama3 shapes with llama3 RoPE scaling and 128k
positions. `dummy:tiny` is ours: it runs on 2 CPU
cores, and its vocabulary leaves room for a byte-level tokenizer (256 bytes + specials).
`dummy:small` is ours too: LLaMA 3's proportions (head_dim 128, GQA 4:1, SwiGLU width 3.5x
hidden) in two layers, so an 8k prefill on one CPU core takes ~25 s in float32. At 8k
tokens its attention/dense FLOP ratio is 0.31 (llama3-8b: 0.15, dummy:tiny: 2.7; the ratio
scales as tokens / hidden), which bounds the prefill-time cut of reusing half of an 8k
prompt at 44% (llama3-8b 47%, llama2-70b 48%, dummy:tiny 32%), see `prefill_flops`.

`dummy:<name>` is accepted for every real spec (the paper's "dummy LLaMA2-70B": the real
shape with random weights). The returned spec keeps the `dummy:` name, because the name
enters the block-hash fingerprint and random weights must never share KV with real ones.

Mixture-of-experts models (`num_experts` > 0; `mooncake.model.moe`) replace the SwiGLU MLP
of their sparse layers by `num_experts` SwiGLU experts of width `moe_intermediate_size`, of
which each token runs `num_experts_per_tok` (ffn "8x 14336": 8 experts, 2 per token for
Mixtral). Their weight counts (`num_params`, `weight_bytes`: what memory holds and a large
decode batch reads) hold every expert; their FLOPs (`num_matmul_params`,
`flops_per_token`, `prefill_flops`) only the experts a token runs. `dummy:mixtral-tiny` is
ours: Mixtral's layout small enough for tests.

`ModelInfo` is a spec plus what the shape does not say (the weights' dtype, biases, special
tokens, the files); `mooncake.model.info` makes one of what `model.path` names.
"""

from __future__ import annotations

import msgspec

from mooncake.errors import ConfigError


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """RoPE frequency scaling, HF `rope_scaling` / `rope_parameters` by rope_type: "linear"
    (every frequency / factor), "llama3" (LLaMA 3.1: long wavelengths / factor, a smooth
    band between) or "yarn" (YaRN: a ramp between interpolated and original frequencies
    over dimensions [beta_fast, beta_slow] rotations, cos/sin times attention_factor)."""

    rope_type: str = "llama3"
    factor: float = 8.0  # long-wavelength frequencies are divided by this
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # tokens, the pre-scaling context
    beta_fast: float = 32.0  # yarn: rotations below which dimensions are interpolated
    beta_slow: float = 1.0  # yarn: rotations above which dimensions are kept
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by this


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Architecture of a LLaMA-family decoder-only transformer (shapes only, no weights)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    intermediate_size: int  # SwiGLU MLP width
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096  # tokens
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None  # tokens a query attends to, itself included; None: all
    qk_norm: bool = False  # Qwen3(-MoE): RMSNorm over head_dim on each q and k head before RoPE
    # NOTE: mixture of experts; the defaults (0: a dense model) leave dense specs as they were
    num_experts: int = 0  # routed experts of each sparse layer; 0 = no MoE layer
    num_experts_per_tok: int = 0  # experts each token runs (top-k)
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    norm_topk_prob: bool = True  # rescale the top-k router probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name}: num_heads {self.num_heads} must be a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ConfigError(
                f"model {self.name}: {self.num_experts} experts need 1 to {self.num_experts} "
                f"experts per token (got {self.num_experts_per_tok}) and a positive "
                f"moe_intermediate_size (got {self.moe_intermediate_size})"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (global index) runs experts rather than one MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token occupies across all layers (bf16 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def params_per_layer(self) -> int:
        """Weights of one dense decoder layer: attention, SwiGLU MLP and two RMSNorms."""
        return self._attention_params + 3 * self.hidden_size * self.intermediate_size

    def _layers_params(self, experts: int) -> int:
        # all layers, counting `experts` experts (and the router) in each sparse one
        h = self.hidden_size
        moe = self._attention_params + h * self.num_experts  # attention, norms, router
        moe += experts * 3 * h * self.moe_intermediate_size  # each expert's gate, up, down
        num_moe = self.num_moe_layers
        return num_moe * moe + (self.num_layers - num_moe) * self.params_per_layer

    @property
    def _attention_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * q + 2 * h * kv + q * h + 2 * h  # wq, wk, wv, wo; two RMSNorms

    @property
    def num_params(self) -> int:
        """All weights (every expert): embeddings, layers, final norm, the LM head unless tied."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self._layers_params(self.num_experts) + self.hidden_size

    @property
    def num_matmul_params(self) -> int:
        """Weights multiplied once per token in a forward pass (layers, only the experts a
        token runs; not the LM head)."""
        return self._layers_params(self.num_experts_per_tok)

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights, every expert included."""
        return self.num_params * dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Dense FLOPs for one token, excluding attention scores (2 per multiply-add)."""
        return 2 * self.num_matmul_params

    @property
    def attn_flops_per_token_pair(self) -> int:
        """FLOPs of QK^T and PV for one query token against one context token."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def prefill_flops(self, input_len: int, reused_len: int = 0) -> float:
        """FLOPs to prefill tokens [reused_len, input_len) with causal attention."""
        new = input_len - reused_len
        pairs = (input_len * input_len - reused_len * reused_len) / 2  # sum of causal spans
        return self.flops_per_token * new + self.attn_flops_per_token_pair * pairs


_TINY = ModelSpec(
    name="dummy:tiny",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=512,
    max_position_embeddings=8192,
)
_SMALL = ModelSpec(
    name="dummy:small",
    num_layers=2,
    hidden_size=2048,
    num_heads=16,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=7168,
    vocab_size=512,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
_LLAMA2_70B = ModelSpec(
    name="llama2-70b",
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=32000,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
_LLAMA3_8B = ModelSpec(
    name="llama3-8b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
_LLAMA3_70B = msgspec.structs.replace(
    _LLAMA2_70B,
    name="llama3-70b",
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
_MIXTRAL_TINY = ModelSpec(
    name="dummy:mixtral-tiny",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=1e6,
    max_position_embeddings=8192,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
)
_MIXTRAL_8X7B = ModelSpec(
    name="mixtral-8x7b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=32000,
    rope_theta=1e6,
    max_position_embeddings=32768,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=14336,
)
_LLAMA31 = {"rope_scaling": RopeScaling(), "max_position_embeddings": 131072}

MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _TINY,
        _SMALL,
        _LLAMA2_70B,
        _LLAMA3_8B,
        _LLAMA3_70B,
        _MIXTRAL_TINY,
        _MIXTRAL_8X7B,
        msgspec.structs.replace(_LLAMA3_8B, name="llama3.1-8b", **_LLAMA31),
        msgspec.structs.replace(_LLAMA3_70B, name="llama3.1-70b", **_LLAMA31),
    )
}


def list_model_specs() -> list[str]:
    """Names `get_model_spec` accepts (without the `dummy:` aliases)."""
    return sorted(MODEL_SPECS)


def get_model_spec(name: str) -> ModelSpec:
    """The spec called `name`; `dummy:<real>` returns the real shape under the dummy name."""
    key = name.strip().lower()
    if key in MODEL_SPECS:
        return MODEL_SPECS[key]
    if key.startswith("dummy:") and key[len("dummy:") :] in MODEL_SPECS:
        return msgspec.structs.replace(MODEL_SPECS[key[len("dummy:") :]], name=key)
    raise ConfigError(
        f"unknown model {name!r}; known: {', '.join(list_model_specs())} "
        "(or dummy:<name> for random weights of that shape)"
    )


DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A model as the engine loads it: shapes plus what the shapes do not say."""

    spec: ModelSpec
    path: str  # "dummy:NAME", a built-in name, the HF directory or the GGUF file as given
    is_dummy: bool
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) add biases to q/k/v
    checkpoint_dtype: str = "float32"  # dtype the weights are stored in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these
    weight_files: tuple[str, ...] = ()  # *.safetensors, relative to path
    gguf_file: str = ""  # the GGUF file (absolute) when path names one


def normalize_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in DTYPES:
        raise ConfigError(f"model.dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return name

"""The shapes and repeats of one gpubench run: Llama-3.1-8B on one GPU, or tiny ones on
the CPU (`--cpu-smoke`, every path exercised in seconds)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mooncake.model.attention import gpucheck


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures, and how often."""

    device: str  # "cuda" or "cpu"
    dtype: str  # of the timed model and its KV
    model_path: str  # the timed model (random weights)
    block_tokens: int  # KV block size of every cache here
    # correctness: greedy tokens of `check_model` against the CPU's
    check_model: str
    check_prompt_lens: tuple[int, ...]  # tokens per prompt, all decoded in one batch
    check_tokens: int  # greedy tokens per prompt
    attention: gpucheck.CheckConfig  # the attention kernels against their reference
    # decode
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # tokens of context of every sequence of a batch
    warmup_steps: int
    timed_steps: int
    launch_batch: int  # the step whose launches and syncs are counted
    launch_context: int
    # sampling
    sampler_batch: int
    sampler_vocab: int
    sampler_repeats: int
    # prefill
    prefill_lens: tuple[int, ...]  # prompt tokens; each also with its first half reused
    prefill_chunks: tuple[int, ...]  # chunk_tokens; the first is the runner's default
    prefill_repeats: int  # timed runs after one warm-up run
    # families: each family the engine serves, at its own per-layer shapes, few layers
    family_shapes: str  # "real" (the HF shapes, families.REAL) or "tiny" (families.TINY)
    family_layers: int  # decoder layers of each (the real ones: 28 to 48)
    family_batches: tuple[int, ...]
    family_context: int  # tokens of context of every sequence of a decode step
    family_prefill_tokens: int  # one chunk of this many tokens prefilled; 0: none
    # kvsize
    kv_fraction: float  # of the memory free after the weights and a warm-up
    kv_decode_context: int  # tokens per sequence of the B = max decode step in that cache
    kv_prefill_len: int
    cpu_free_bytes: int  # --cpu-smoke: the "free memory" the CPU stands in with
    copy_bytes: int  # of the device-to-device copy measured as a ceiling

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"


GPU = BenchConfig(
    device="cuda",
    dtype="bfloat16",
    # NOTE: Llama-3-8B's shapes with 128k positions (RoPE scaled), so that a 32k prompt is
    # in range; the cost of a step is the same
    model_path="dummy:llama3.1-8b",
    block_tokens=16,  # vLLM's default block size
    check_model="dummy:tiny",
    check_prompt_lens=(5, 37, 150, 700),
    check_tokens=16,
    attention=replace(
        gpucheck.LLAMA3_8B,
        check_block_tokens=(16,),
        time_batches=(1, 32, 128),
        time_contexts=(4096,),
        copy_bytes=1 << 30,
    ),
    decode_batches=(1, 32, 128),
    decode_contexts=(1024, 4096),
    warmup_steps=3,
    timed_steps=20,
    launch_batch=32,
    launch_context=1024,
    sampler_batch=128,
    sampler_vocab=128256,  # Llama 3's
    sampler_repeats=20,
    prefill_lens=(2048, 8192, 32768),
    prefill_chunks=(1024, 8192),
    prefill_repeats=3,
    family_shapes="real",
    family_layers=4,  # NOTE: 4 of Mixtral's layers are 11 GB of experts, drawn in seconds
    family_batches=(1, 32),
    family_context=1024,
    family_prefill_tokens=2048,
    kv_fraction=0.9,
    kv_decode_context=1024,
    kv_prefill_len=8192,
    cpu_free_bytes=0,
    copy_bytes=2 << 30,
)

CPU_SMOKE = BenchConfig(
    device="cpu",
    dtype="float32",
    model_path="dummy:tiny",
    block_tokens=16,
    check_model="dummy:tiny",
    check_prompt_lens=(5, 37),
    check_tokens=4,
    attention=replace(
        gpucheck.CPU_SMOKE,
        check_block_tokens=(16,),
        check_batches=(1, 3),
        check_contexts=(40,),
        time_batches=(1, 3),
        time_contexts=(70,),
    ),
    decode_batches=(1, 3),
    decode_contexts=(20, 40),
    warmup_steps=1,
    timed_steps=2,
    launch_batch=3,
    launch_context=20,
    sampler_batch=4,
    sampler_vocab=1000,
    sampler_repeats=2,
    prefill_lens=(32, 64),
    prefill_chunks=(32,),
    prefill_repeats=1,
    family_shapes="tiny",
    family_layers=1,
    family_batches=(1, 2),
    family_context=24,  # past the tiny Mistral's window of 16
    family_prefill_tokens=16,
    kv_fraction=0.9,
    kv_decode_context=20,
    kv_prefill_len=32,
    cpu_free_bytes=16 << 20,
    copy_bytes=1 << 20,
)


def quick(cfg: BenchConfig) -> BenchConfig:
    """Fewer repeats (`--quick`): the same cases, noisier figures."""
    return replace(
        cfg,
        timed_steps=min(cfg.timed_steps, 6),
        sampler_repeats=min(cfg.sampler_repeats, 5),
        prefill_repeats=1,
    )

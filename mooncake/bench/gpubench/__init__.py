"""`scripts/gpubench`: the one-GPU acceptance bench of the engine (issue 33 item 6).

One run prints one JSON document, each figure beside its physical limit; the sections, in
the order they run (the most telling first; `--sections` picks a subset):

- `config`       the shapes of a run (Llama-3.1-8B on a GPU, `dummy:tiny` in `--cpu-smoke`)
- `limits`       the GPU's HBM bandwidth and bf16 peak by name, and a copy measured here
- `bed`          the shared fixtures: the 8B model filled on the device, a random KV cache,
                 sequences seated with their KV already in it
- `correctness`  greedy tokens on the GPU equal the CPU's; the attention kernels against
                 their reference (`attention/gpucheck.py`)
- `decode`       `DecodeRunner.step` time, eager and CUDA graphs, against the roofline
- `launches`     kernels, host launches and host syncs of one decode step
- `sampling`     the sampler at B = 128 over a 128k vocabulary
- `prefill`      TTFT, TFLOP/s and MFU at 2k / 8k / 32k, with and without a reused half
- `families`     each family served (Llama 3, Qwen2.5, Qwen3, Mistral, Mixtral, Qwen3-MoE) at
                 its per-layer shapes with 4 layers: a decode step at B = 1 and 32 against
                 its roofline (MoE: the experts routed to), a 2k chunk's prefill
- `kvsize`       a KV cache of 90% of the memory left, then a step and a prefill in it
- `run`          the command line, the sections' runner and the verdict against the targets
"""

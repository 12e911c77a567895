"""The inference engine: a LLaMA-family model in torch and what the paper does around it.

Map (torch is imported only by the modules marked *):

- `modelinfo`   what a model path names: its `ModelSpec`, weight layout, special tokens, KV dtype
- `tokenizer`   byte-level tokenizer for dummy models, `tokenizers` for HF dirs, chat templates
- `model` *     RMSNorm, RoPE (llama3 scaling), GQA attention over paged KV, SwiGLU, layer ranges
- `cpugemm` *   CPU linears through oneDNN with weights packed once at load
- `weights` *   deterministic random weights for `dummy:*`, safetensors loading for HF dirs
- `kvcache` *   paged KV in device memory: block allocator and per-layer block tensors
- `kvobject`    the KV object format of the pool: header + layer-contiguous K and V, validation
- `kvio` *      `BaseKVSource` / `BaseKVSink`, the in-process DRAM pool, layer-wise loader
- `prefill` *   chunked prefill with prefix reuse and layer-wise KV load/store (one stage)
- `pipeline` *  chunked pipeline parallelism: the first stage's driver, later stages' server
- `stagelink` * activations between pipeline stages: in-process queues or authenticated TCP
- `stage_worker` * a pipeline stage as a process (`python -m mooncake.engine.stage_worker`)
- `benchmarks` * the measurements behind `mooncake bench engine`
- `sampler` *   greedy / temperature / top-k / top-p sampling with seeds and logprobs
- `sequence`    one request's decode state, stop conditions and incremental detokenization
- `decode` *    continuous-batching decode with admission and preemption
- `profiling` * measures prefill/decode times for `mooncake profile`
"""

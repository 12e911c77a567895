"""The model a prefill or decode node runs, and the runners around it (torch, except
`spec`, `info`, `ggufread`, `ggufinfo`, `params`, `tokenizer`, `stopmatch` and `tpdegree`,
which the master and a node's parent use too).

- `spec`, `info`       model shapes by name; what `model.path` names (HF config, fingerprint)
- `llama`, `weights`   the LLaMA-family decoder over paged KV; dummy and safetensors weights
- `ggufread`, `ggufinfo`, `dequant`, `ggufweights`   GGUF files: header, ModelInfo, weights
- `cpugemm`            CPU linears through oneDNN with weights packed once
- `attention/`         paged attention behind one seam: torch reference, Triton kernels
- `step`, `cudagraph`  a step's inputs uploaded at once; decode steps as CUDA graphs
- `parallel`           tensor parallelism: a model cut over ranks, rank 0 leading each step
- `shardplan`, `tpdegree`   which slice of each weight a rank holds; how many ranks (auto)
- `kvcache`, `prefixcache`   the paged KV cache and the instance-local prefix cache
- `tokenizer`, `params`, `sampler`, `sequence`, `stopmatch`   text in, tokens out
- `grammar`            structured outputs: constraints compiled, token masks (torch-free)
- `prefill`, `decode`  the chunked prefill runner and the continuous-batching decode runner
- `profiling`, `corun` the cost model measured on this node, and co-run slowdowns
"""

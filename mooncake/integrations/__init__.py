"""Other serving engines on the pool: `integrations.vllm` is a vLLM v1 KV connector backed
by the Store and the Transfer Engine; `integrations.upstreamtests` runs upstream Mooncake's
own Python tests against this package. Nothing here is imported by the rest of the package."""

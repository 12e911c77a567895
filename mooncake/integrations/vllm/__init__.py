"""vLLM on the pool: a vLLM v1 KV connector backed by the Store and the Transfer Engine.

    python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32 \\
        --kv-transfer-config '{"kv_connector": "PoolConnector",
            "kv_connector_module_path": "mooncake.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": "mooncake.toml"}}'

The TOML file names the pool (`cluster.master`, `cluster.secret`); any number of vLLM
instances with the same file share one pool. Modules:

- `plan.py`: the scheduler's side as pure logic: which prompt blocks the pool holds past
  vLLM's own cache, what each step loads and stores (`StepPlan`), the supported versions.
- `paged.py`: the worker's side: vLLM's paged KV cache registered with the Transfer Engine,
  a step's loads read layer by layer straight into its blocks and checked against each
  layer's digest, new full blocks written layer by layer from them and sealed.
- `settings.py`: the connector's settings from the TOML file and the model's KV layout.
- `connector.py`: `PoolConnector`, the `KVConnectorBase_V1` subclass wiring them to vLLM;
  the only module that imports vLLM (loaded when vLLM asks for `PoolConnector`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PoolConnector"]


def __getattr__(name: str) -> Any:
    # NOTE: vLLM looks the class up by name on this module; importing it imports vLLM, which
    # the rest of this package (and our CI) does without
    if name == "PoolConnector":
        from mooncake.integrations.vllm.connector import PoolConnector

        return PoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

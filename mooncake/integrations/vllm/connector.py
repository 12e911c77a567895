"""`PoolConnector`: vLLM's `KVConnectorBase_V1` over the pool; the only module importing vLLM.

vLLM makes one instance per side: in the scheduler (`PoolPlanner`: how much of a prompt
the pool holds, what each step loads and stores) and in each worker (`PoolWorker`: the
transfers between the pool and vLLM's paged cache). The scheduler's `StepPlan` reaches the
workers as the step's connector metadata. Refuses, naming the fix: a vLLM version not in
`SUPPORTED_VLLM`, `kv_load_failure_policy` other than "recompute" (a failed load must be
recomputed, never fail the request), tensor or pipeline parallelism (each rank holds part
of a block; not supported yet), and models with several KV cache groups.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform

from mooncake.errors import ConfigError
from mooncake.integrations.vllm.plan import PoolPlanner, Scheduled, StepPlan, check_vllm_version
from mooncake.integrations.vllm.settings import connect, kv_layout, load_settings, vllm_fingerprint
from mooncake.integrations.vllm.worker import PoolWorker
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.object import KVLayout
from mooncake.kv.pool import StoreKVPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class PoolConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler's connector to the workers'."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


def model_layout(vllm_config: VllmConfig) -> KVLayout:
    """The pool object layout of one of vLLM's blocks; refuses what the connector cannot
    store (sharded KV, KV dtypes the pool has no code for)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "mooncake.integrations.vllm: tensor and pipeline parallelism are not supported "
            f"yet (tensor {parallel.tensor_parallel_size}, pipeline "
            f"{parallel.pipeline_parallel_size}); run each vLLM instance on one device"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model.dtype if cache_dtype == "auto" else cache_dtype
    name = str(dtype).removeprefix("torch.")
    return kv_layout(
        model.get_num_layers(parallel),
        vllm_config.cache_config.block_size,
        model.get_num_kv_heads(parallel),
        model.get_head_size(),
        name,
    )


class PoolConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector: prompts' KV shared through the pool (module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                'PoolConnector needs "kv_load_failure_policy": "recompute" in '
                "--kv-transfer-config (a block the pool loses is recomputed; vLLM's default, "
                f"{transfer.kv_load_failure_policy!r}, fails the request instead)"
            )
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) > 1:
            raise ConfigError(
                f"PoolConnector supports models with one KV cache group; this one has "
                f"{len(groups)} (a hybrid model)"
            )
        settings = load_settings(transfer.kv_connector_extra_config or {})
        layout = model_layout(vllm_config)
        fingerprint = vllm_fingerprint(
            vllm_config.model_config.model, current_platform.device_type, layout
        )
        self._planner: PoolPlanner | None = None
        self._worker: PoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            pool = StoreKVPool(connect(settings, "scheduler"), layout, fingerprint)
            hasher = PrefixHasher(layout.block_tokens, settings.secret, fingerprint)
            self._planner, self._lookup_pool = PoolPlanner(hasher, pool.match_prefix), pool
        else:
            store = connect(settings, "worker")
            self._worker = PoolWorker(store, layout, fingerprint, settings.replicas)
        log.info("PoolConnector (%s) on the pool at %s", role.name.lower(), settings.master)

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        tokens = request.prompt_token_ids or []
        return self._planner.match(request.request_id, tokens, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._planner is not None
        self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        counts = scheduler_output.num_scheduled_tokens
        steps = [
            Scheduled(
                r.req_id, list(r.block_ids[0]), r.num_computed_tokens, counts[r.req_id], is_new=True
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            steps.append(
                Scheduled(
                    req_id,
                    list(new_ids[0]) if new_ids is not None else [],
                    cached.num_computed_tokens[i],
                    counts.get(req_id, 0),
                    is_new=req_id in cached.resumed_req_ids,
                )
            )
        return PoolConnectorMetadata(self._planner.build(steps))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        self._planner.finished(request.request_id)
        return False, None  # NOTE: saves end within their step: the blocks are free now

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PoolConnectorMetadata):
            self._worker.start_saves(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self._worker is not None and isinstance(meta, PoolConnectorMetadata)
        self._worker.start_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_block_ids()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        elif self._planner is not None:
            self._lookup_pool.close()
            self._lookup_pool.store.close()

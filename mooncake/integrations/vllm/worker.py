"""The worker connector's state without vLLM: vLLM's KV cache registered with the pool's
Transfer Engine, and the loads and saves of the step being run (transfers.py).

A step, as vLLM drives it: `start_saves` (its plan is bound), `start_loads` (before the
forward when it loads), then per attention layer `wait_layer` and `save_layer`, then
`end_step` (every transfer done, blocks committed, failed loads kept for vLLM to take).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from mooncake.integrations.vllm.paged import PagedCache
from mooncake.integrations.vllm.plan import StepPlan
from mooncake.integrations.vllm.transfers import HeadBuffer, Loads, Saves
from mooncake.kv.object import KVLayout
from mooncake.kv.pool import StoreKVPool
from mooncake.store.client.client import Store

log = logging.getLogger(__name__)


class PoolWorker:
    """One vLLM worker's side of the connector (module docstring)."""

    def __init__(self, store: Store, layout: KVLayout, fingerprint: bytes, replicas: int = 0):
        self.pool = StoreKVPool(store, layout, fingerprint, replicas)
        self.heads = HeadBuffer(self.pool)
        self.cache: PagedCache | None = None
        self.layer_index: dict[str, int] = {}  # vLLM layer name -> layer
        self._loads: Loads | None = None
        self._saves: Saves | None = None
        self._failed_block_ids: set[int] = set()
        self.num_loaded_blocks = 0  # blocks read from the pool and checked
        self.num_failed_blocks = 0  # blocks the pool was asked for and did not give
        self.num_saved_blocks = 0  # blocks committed to the pool

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's KV tensors, one per attention layer in model order."""
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.cache = PagedCache(self.pool.store, self.pool.layout, list(kv_caches.values()))

    def start_saves(self, plan: StepPlan) -> None:
        if plan.saves and self.cache is not None:
            self._saves = Saves(self.cache, self.pool, plan.saves)

    def start_loads(self, plan: StepPlan) -> None:
        if plan.loads and self.cache is not None and self._loads is None:
            self._loads = Loads(self.cache, self.pool, self.heads, plan.loads)

    def wait_layer(self, layer_name: str) -> None:
        if self._loads is not None and (layer := self.layer_index.get(layer_name)) is not None:
            self._loads.wait(layer)

    def save_layer(self, layer_name: str) -> None:
        if self._saves is not None and (layer := self.layer_index.get(layer_name)) is not None:
            self._saves.layer(layer)

    def end_step(self) -> None:
        """Wait for the step's transfers; commit its saves (not those of a request whose
        load failed: computed on a bad prefix); keep the failed loads for vLLM."""
        skip: set[str] = set()
        if self._loads is not None:
            failed = self._loads.finish()
            skip = self._loads.failed_req_ids
            asked = sum(len(r.block_ids) for r in self._loads.runs)
            self.num_loaded_blocks += asked - len(failed)
            self.num_failed_blocks += len(failed)
            self._failed_block_ids |= failed
            self._loads = None
        if self._saves is not None:
            self.num_saved_blocks += self._saves.finish(skip)
            self._saves = None

    def take_failed_block_ids(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def close(self) -> None:
        self.end_step()
        if self.cache is not None:
            self.cache.close()
        self.pool.close()
        self.pool.store.close()

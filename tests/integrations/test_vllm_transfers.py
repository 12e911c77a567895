"""The vLLM connector's worker side against a real pool (a master and a store node as
processes), with torch tensors laid out as vLLM's KV caches: blocks saved by one worker
land byte for byte in another's blocks; what the pool cannot give is reported, never
loaded unchecked. No vLLM needed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mooncake.bench.storeprocs import LocalCluster
from mooncake.integrations.vllm.plan import PoolPlanner, Scheduled, StepPlan
from mooncake.integrations.vllm.settings import kv_layout, vllm_fingerprint
from mooncake.integrations.vllm.worker import PoolWorker
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.keys import kv_key
from mooncake.kv.pool import StoreKVPool
from mooncake.store.client.client import Store
from mooncake.store.node.node import remote_name
from mooncake.transfer import TransferRequest
from mooncake.transfer.types import TransferOp

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
SECRET = b"v" * 32
LAYOUT = kv_layout(num_layers=2, block_tokens=4, num_kv_heads=2, head_dim=8, dtype="float32")
FP = vllm_fingerprint("tiny", "cpu", LAYOUT)
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One pool for the module (each test's prompts differ); a test that kills its node
    takes `own_cluster`."""
    with LocalCluster(SECRET, dram_bytes=8 << 20, lease_ttl_s=5.0) as c:
        yield c


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(SECRET, dram_bytes=8 << 20, lease_ttl_s=5.0) as c:
        yield c


def cpu_caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM for CPU's layout: (num_blocks, kv_heads, block_tokens, 2 * head_dim)."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_tokens, 2 * LAYOUT.head_dim)
    return {f"layers.{i}.attn": torch.rand(shape, generator=g) for i in range(2)}


def split_caches(seed: int) -> dict[str, torch.Tensor]:
    """The (2, num_blocks, block_tokens, kv_heads, head_dim) layout: K, then V."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, LAYOUT.block_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return {f"layers.{i}.attn": torch.rand(shape, generator=g) for i in range(2)}


class Instance:
    """One vLLM instance's two connector sides, each with its own Store client."""

    def __init__(self, cluster: LocalCluster, caches: dict[str, torch.Tensor]):
        self.lookup = StoreKVPool(Store.connect(cluster.master_address, SECRET), LAYOUT, FP)
        hasher = PrefixHasher(LAYOUT.block_tokens, SECRET, FP)
        self.planner = PoolPlanner(hasher, self.lookup.match_prefix)
        self.worker = PoolWorker(Store.connect(cluster.master_address, SECRET), LAYOUT, FP)
        self.caches = caches
        self.worker.register(caches)

    def step(self, plan: StepPlan) -> set[int]:
        """Run one step as vLLM does; returns the block ids that failed to load."""
        self.worker.start_saves(plan)
        self.worker.start_loads(plan)
        for name in self.caches:
            self.worker.wait_layer(name)
            self.worker.save_layer(name)
        self.worker.end_step()
        return self.worker.take_failed_block_ids()

    def prefill(self, req: str, tokens: list[int], block_ids: list[int]) -> tuple[int, set[int]]:
        """Match, allocate, run the prompt in one step; (tokens from the pool, failed ids)."""
        hit = self.planner.match(req, tokens, 0)
        self.planner.allocated(req, hit)
        plan = self.planner.build([Scheduled(req, block_ids, hit, len(tokens) - hit, True)])
        return hit, self.step(plan)

    def close(self) -> None:
        self.worker.close()
        self.lookup.close()
        self.lookup.store.close()


def blocks(caches: dict[str, torch.Tensor], ids: list[int], split: bool) -> list[torch.Tensor]:
    return [t[:, ids] if split else t[ids] for t in caches.values()]


@pytest.mark.parametrize("split", [False, True], ids=["cpu-layout", "k-then-v-layout"])
def test_blocks_saved_by_one_instance_load_byte_for_byte_into_another(
    cluster: LocalCluster, split: bool
) -> None:
    make = split_caches if split else cpu_caches
    a, b = Instance(cluster, make(1)), Instance(cluster, make(2))
    try:
        tokens = list(range(100 + 50 * split, 118 + 50 * split))  # 4 full blocks and 2 more
        assert a.prefill("r1", tokens, [3, 4, 5, 6, 7]) == (0, set())
        assert a.worker.num_saved_blocks == 4
        hit, failed = b.prefill("r2", tokens, [9, 10, 11, 12, 13])
        assert hit == 16 and failed == set() and b.worker.num_loaded_blocks == 4
        for got, want in zip(
            blocks(b.caches, [9, 10, 11, 12], split),
            blocks(a.caches, [3, 4, 5, 6], split),
            strict=True,
        ):
            assert torch.equal(got, want)
        assert b.worker.num_saved_blocks == 0  # nothing new: block 4 is not full
        # a prompt sharing the first two blocks only: a two-block hit
        other = tokens[:8] + [1] * 10
        assert b.prefill("r3", other, [0, 1, 2, 14, 15])[0] == 8
    finally:
        a.close()
        b.close()


def test_a_block_that_does_not_match_its_digest_is_reported(cluster: LocalCluster) -> None:
    """A replica's layer changed after it was committed (memory corrupted): the reader
    checks every layer it landed and refuses that block and every later one."""
    a, b = Instance(cluster, cpu_caches(1)), Instance(cluster, cpu_caches(2))
    try:
        tokens = list(range(300, 313))
        a.prefill("r1", tokens, [0, 1, 2, 3])
        (found,) = a.lookup.store.locate_batch([kv_key(a.planner.hasher.hash_blocks(tokens)[1])])
        d = found.replicas[0]
        engine = a.lookup.store.engine
        junk = engine.allocate("junk", 64)
        junk[:] = 7
        at = d.offset + LAYOUT.k_offset(1) + 16
        remote = remote_name(d.segment, d.endpoint)
        engine.move(TransferRequest(TransferOp.WRITE, "junk", 0, remote, at, 64, d.token))
        hit, failed = b.prefill("r2", tokens, [5, 6, 7, 8])
        assert hit == 12 and failed == {6, 7}  # block 0 loaded; 1 is corrupt, 2 follows it
        assert b.worker.num_loaded_blocks == 1
    finally:
        a.close()
        b.close()


def test_a_dead_store_node_fails_the_loads_and_they_are_reported(
    own_cluster: LocalCluster,
) -> None:
    cluster = own_cluster
    a, b = Instance(cluster, cpu_caches(1)), Instance(cluster, cpu_caches(2))
    try:
        tokens = list(range(200, 213))
        a.prefill("r1", tokens, [0, 1, 2, 3])
        before = [t.clone() for t in b.caches.values()]
        cluster.node.proc.kill()  # the only replica is gone; the master does not know yet
        cluster.node.proc.join(5)
        hit, failed = b.prefill("r2", tokens, [5, 6, 7, 8])
        assert hit == 12  # the master still lists the blocks
        assert failed == {5, 6, 7}  # every block of the hit: vLLM recomputes them
        assert b.worker.num_failed_blocks == 3 and b.worker.num_saved_blocks == 0
        assert all(torch.equal(x, y) for x, y in zip(before, b.caches.values(), strict=True))
    finally:
        a.close()
        b.close()

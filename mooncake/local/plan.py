"""The shape of a local cluster (`mooncake up --local`, `mooncake soak`, the benches): how
many nodes of each role, the model and its sizes, and where each node runs. Plain data, read
by the launcher, the config writer and the cost model's cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PREFILL_NICE = 10  # node.nice of prefill nodes sharing the host's cores with decode nodes


@dataclass(frozen=True)
class Placement:
    """Where one node runs when not beside the launcher (`mooncake soak` puts a node in a
    network namespace of its own): the command prefix that puts it there and its address."""

    prefix: tuple[str, ...]  # e.g. ("ip", "netns", "exec", NS): the node's command follows
    address: str  # node.advertise_address there (peers reach it at this address)


@dataclass
class LocalPlan:
    """The shape of the local cluster."""

    model: str = "dummy:tiny"
    num_prefill: int = 2
    group_size: int = 2  # prefill nodes per pipeline group
    num_decode: int = 1
    num_store: int = 1
    num_masters: int = 1  # > 1: on a local etcd, one leads and the others stand by
    api_host: str = "127.0.0.1"
    api_port: int = 8000  # 0 = any free port
    block_tokens: int = 32
    chunk_tokens: int = 256
    pool: bool = True  # False: no store node and no pool share (a no-reuse baseline)
    cost_model_path: str = ""  # "" = profile once and cache
    run_dir: Path = field(default_factory=lambda: Path.cwd())
    host: str = "127.0.0.1"  # masters' control planes and nodes' addresses (not the API's)
    placements: dict[str, Placement] = field(default_factory=dict)  # node id -> elsewhere
    # more config keys: "section.key" -> a value, typed or as --set text ("false", "64MiB")
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def prefill_nice(self) -> int:
        """The nice its prefill nodes run at: `node.nice` when given; else PREFILL_NICE
        when the compute nodes outnumber this host's cores (one each), so decode steps
        go first as separate devices would keep them apart; else 0."""
        if "node.nice" in self.extra:
            return int(str(self.extra["node.nice"]))
        shared = self.num_prefill + self.num_decode > len(os.sched_getaffinity(0))
        return PREFILL_NICE if shared else 0

    @property
    def cpu_gemm(self) -> str:
        """How its nodes run CPU matmuls: `model.cpu_gemm` when given, else oneDNN."""
        return str(self.extra.get("model.cpu_gemm", "onednn"))

    @property
    def decode_step_interval_s(self) -> float:
        """The pace of its decode steps: `decode.step_interval_s` when given, else 0 (back
        to back; README: where a pace helps on a shared host and where it does not)."""
        return float(str(self.extra.get("decode.step_interval_s", 0.0)))

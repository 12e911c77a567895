"""The config file `mooncake up --local` writes for its cluster: one TOML for every node
(the master's address and a fresh secret, the small model, the KV cache sizes, a small SSD
tier per node under the run directory), with the plan's extra keys typed by their key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mooncake.config.load import typed_override
from mooncake.hw.ssdplace import MEMORY_FILESYSTEMS, fstype_of
from mooncake.local.runfile import write_private

if TYPE_CHECKING:
    from mooncake.local.plan import LocalPlan

DECODE_KV_BYTES = 128 << 20  # the decode node's KV cache (and the cost model's capacity)
LOCAL_SSD_BYTES = "256MiB"  # each node's SSD tier: small, so a newcomer sees DRAM -> SSD moves


def local_ssd_dir(run_dir: Path) -> Path:
    """The SSD tier's directory: under the run directory, unless that is in memory
    (XDG_RUNTIME_DIR is a tmpfs on most desktops); then under /var/tmp, kept on disk."""
    if fstype_of(str(run_dir)) not in MEMORY_FILESYSTEMS:
        return run_dir / "ssd"
    return Path("/var/tmp") / f"mooncake-{os.getuid()}" / "ssd"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_config(
    plan: LocalPlan,
    path: Path,
    secret: str,
    master_port: int,
    cost_model: str,
    ha: dict[str, object] | None = None,  # more [cluster] keys: masters, etcd, state_dir
) -> Path:
    """Write the cluster's config (mode 0600: it holds the secret) without following a
    symlink; `plan.extra` values are typed by their key. Raises ConfigError, RunDirError."""
    cluster = {"name": "local", "master": f"{plan.host}:{master_port}", "secret": secret}
    sections: dict[str, dict[str, object]] = {
        "cluster": {**cluster, **(ha or {})},
        # NOTE: one process per planned node, even on a GPU host ("auto" would be one per GPU)
        "node": {"advertise_address": plan.host, "instances": 1},
        "model": {"path": plan.model, "block_tokens": plan.block_tokens},
        "prefill": {
            "chunk_tokens": plan.chunk_tokens,
            "pipeline_group_size": plan.group_size,
            "kv_cache_bytes": "64MiB",
        },
        "decode": {"kv_cache_bytes": DECODE_KV_BYTES, "max_batch": 32},
        "store": {
            "dram_bytes": "256MiB" if plan.pool else "0",
            "ssd_bytes": LOCAL_SSD_BYTES if plan.pool else "0",
            "ssd_path": str(local_ssd_dir(plan.run_dir)),
            "heartbeat_ttl_s": 6.0,
        },
        "api": {"host": plan.api_host, "port": plan.api_port},
        "metrics": {"host": "127.0.0.1", "port": 0},  # /metrics on the API port
        "scheduler": {"cost_model_path": cost_model},
        "transfer": {"protocol": "auto"},
    }
    for key, value in plan.extra.items():
        sec, _, name = key.partition(".")
        sections.setdefault(sec, {})[name] = typed_override(key, value)
    lines = []
    for sec, kv in sections.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
        lines.append("")
    return write_private(path.parent, path.name, "\n".join(lines).encode())

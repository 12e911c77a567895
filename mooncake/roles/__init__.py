"""Roles: a node process = config + components + a serving loop.

- `master`   Store metadata + Conductor + registry + HTTP API (`master.py`, `cluster.py`,
             `registry.py`)
- `prefill`  prefill with pool reuse, KV handoff to decode, pipeline groups (`prefill.py`)
- `decode`   continuous-batching decode, tokens to the master (`decode.py`)
- `store`    pool memory only (`store.py`)
- `local`    a whole cluster on this machine as child processes (`local.py`)

`run_node(config, role)` starts one of the four; `cli/up.py` calls it.
"""

from __future__ import annotations

import os

from mooncake.config.settings import Config


def run_node(config: Config, role: str) -> None:
    """Run this process as `role` until SIGINT/SIGTERM; raises MooncakeError on bad config."""
    lower_priority(config.node.nice)
    if role == "master":
        from mooncake.roles.master.role import run_master

        run_master(config)
        return
    from mooncake.roles.node.common import create_context

    ctx = create_context(config, role)
    if role == "prefill":
        from mooncake.roles.prefill.role import run_prefill

        run_prefill(ctx)
    elif role == "decode":
        from mooncake.roles.decode.role import run_decode

        run_decode(ctx)
    elif role == "store":
        from mooncake.roles.store.role import run_store

        run_store(ctx)
    else:
        raise ValueError(f"unknown role {role!r}")


def lower_priority(nice: int) -> None:
    """Run at nice value `nice` at least (`[node] nice`); never raises one's priority."""
    if nice:  # NOTE: lowering one's own priority needs no privilege
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), nice))

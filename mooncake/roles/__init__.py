"""Roles: a node process = config + components + a serving loop, one subpackage per role.

- `master/`   Store metadata + Conductor + registry + HTTP API
- `prefill/`  prefill with pool reuse, KV hand-off to decode, pipeline groups (`group/`)
- `decode/`   continuous-batching decode, tokens to the master
- `store/`    pool memory only
- `node/`     what every node process shares (identity, master link, worker, watchdog)

`run_node(config, role)` starts one of the four; `cli/up.py` calls it. A whole cluster on
one machine is `mooncake.local`.
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

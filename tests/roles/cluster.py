"""A local cluster (real processes on loopback) for the role tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mooncake.roles.local import LocalLauncher, LocalPlan, ensure_cost_model


@contextmanager
def local_cluster(run_dir: Path, cost_cache: Path, **plan_kw: object) -> Iterator[LocalLauncher]:
    """Start a cluster (API on a free port, runfile under `run_dir`), stop it after."""
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(run_dir)
    plan = LocalPlan(api_port=0, run_dir=run_dir, **plan_kw)  # type: ignore[arg-type]
    launcher = LocalLauncher(plan)
    try:
        launcher.start(str(ensure_cost_model(plan, cost_cache)))
        yield launcher
    finally:
        launcher.stop()
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old

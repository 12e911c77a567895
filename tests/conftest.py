"""Tests grouped by the hardware they need: `gpu` (a CUDA GPU through torch) and `rdma`
(an RDMA device with an ACTIVE port, and pyverbs). Without it they are skipped with the
reason; `scripts/hwtest` runs them on a GPU+RDMA node."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest


@functools.cache
def missing_gpu() -> str:
    """Why no test marked `gpu` can run here ("" when one can)."""
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__} sees none): run scripts/hwtest"
    return ""


@functools.cache
def missing_rdma() -> str:
    """Why no test marked `rdma` can run here ("" when one can)."""
    from mooncake.native import sysfs, verbs_info

    nics = sysfs.read_rdma_nics(Path("/sys")) or []
    if not any(n.is_active for n in nics):
        found = ", ".join(n.name for n in nics) or "none in /sys/class/infiniband"
        return f"needs an RDMA device with an ACTIVE port (found: {found}): scripts/hwtest"
    if not verbs_info.read_verbs_devices(None).is_installed:
        return "needs pyverbs (apt install python3-pyverbs)"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, why in (("gpu", missing_gpu), ("rdma", missing_rdma)):
            if item.get_closest_marker(marker) is not None and (reason := why()):
                item.add_marker(pytest.mark.skip(reason=reason))

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profiled cost model for every cluster of the session."""
    return tmp_path_factory.mktemp("costmodel")

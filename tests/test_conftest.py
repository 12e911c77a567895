"""The suite's own safety: no test touches the user's local cluster files."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mooncake.local.config import local_ssd_dir
from mooncake.local.runfile import default_run_dir

pytestmark = pytest.mark.cluster


def test_the_run_directory_is_this_sessions_never_the_users(private_run_dir: Path) -> None:
    """The run directory, its SSD tier and the one a started process finds are all under
    the session's private directory, not /tmp/mooncake-<uid> (or the user's XDG one)."""
    run_dir = default_run_dir()
    assert run_dir == private_run_dir / f"mooncake-{os.getuid()}"
    assert run_dir != Path(tempfile.gettempdir()) / f"mooncake-{os.getuid()}"
    assert local_ssd_dir(run_dir).is_relative_to(private_run_dir)
    code = "from mooncake.local.runfile import default_run_dir; print(default_run_dir())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == str(run_dir)

"""The SSD tier in real processes: a node refuses a directory the tier cannot use, and
`mooncake up --local` runs one per node under its run directory, so prompts past DRAM are
demoted to SSD and read back from there, as `mooncake status` and /metrics show."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mooncake.local.launcher import free_port
from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_a_store_node_refuses_an_ssd_path_on_tmpfs_naming_why_and_what_is_allowed(
    tmp_path: Path,
) -> None:
    shm = f"/dev/shm/mooncake-test-{os.getpid()}"
    config = tmp_path / "store.toml"
    config.write_text(
        f'[cluster]\nsecret = "{"s" * 32}"\nmaster = "127.0.0.1:{free_port()}"\n'
        f'[store]\ndram_bytes = "1MiB"\nssd_bytes = "1MiB"\nssd_path = "{shm}"\n'
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mooncake", "up", "--role", "store", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "COLUMNS": "400"},
        )
    finally:
        if os.path.isdir(shm):
            os.rmdir(shm)
    assert proc.returncode != 0
    assert (
        f"store.ssd_path: {shm} is on tmpfs: the SSD tier would take RAM; allowed: a "
        "directory on a local SSD or NVMe filesystem (ext4, xfs, btrfs, f2fs) that accepts "
        "O_DIRECT" in proc.stderr
    ), proc.stderr


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _tiers(url: str) -> dict[str, dict[str, Any]]:
    status = httpx.get(url + "/v1/status", timeout=10).json()
    return {t["tier"]: t for t in status["pool"]} | {"": status}


def test_up_local_demotes_prompts_past_dram_to_ssd_and_serves_hits_from_there(
    tmp_path: Path, cost_cache: Path
) -> None:
    """Three nodes with 4 MiB of DRAM each and up --local's SSD tier: 12 distinct prompts
    of 20 blocks (about 32 MiB of KV) push the oldest out of DRAM onto SSD (demotions, no
    loss); the first prompt sent again reuses its blocks read from SSD, and `mooncake status`
    shows the SSD tier's hits and the moves."""
    extra = {"store.dram_bytes": "4MiB"}
    with local_cluster(tmp_path, cost_cache, num_prefill=1, group_size=1, extra=extra) as cluster:
        ssd_files = sorted(p.name for p in (tmp_path / "ssd").iterdir())
        assert len(ssd_files) == 3 and all(f.endswith(".ssd.pool") for f in ssd_files)
        rng = random.Random(7)
        prompts = [[rng.randrange(256) for _ in range(640)] for _ in range(12)]
        for prompt in prompts:
            _complete(cluster.url, prompt)
        deadline = time.monotonic() + 60
        while _tiers(cluster.url)[""]["num_demotions"] == 0:
            assert time.monotonic() < deadline, "nothing was demoted to SSD"
            time.sleep(0.5)
        before = _tiers(cluster.url)["ssd"]["num_hits"]
        repeat = _complete(cluster.url, prompts[0])
        tiers = _tiers(cluster.url)
        assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 19 * 32
        assert tiers["ssd"]["num_hits"] > before
        assert tiers["ssd"]["capacity_bytes"] == 3 * (256 << 20)
        metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
        assert 'mooncake_store_tier_hits_total{tier="ssd"}' in metrics
        shown = subprocess.run(
            [sys.executable, "-m", "mooncake", "status", "--url", cluster.url, "--once"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "120"},
        )
        assert shown.returncode == 0, shown.stderr
        [ssd_row] = [ln for ln in shown.stdout.splitlines() if ln.strip().startswith("ssd ")]
        assert f"{tiers['ssd']['num_hits']:,} (" in ssd_row
        assert "moved down a tier (DRAM -> SSD)" in shown.stdout

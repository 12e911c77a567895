"""One master, no etcd: a SIGKILLed master started again rebuilds the pool from its journal
(`cluster.state_dir`, which `up --local` sets): every committed object is back and a prefix
stored before is a hit after. Run with -s to see the figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import kill, local_cluster
from tests.roles.failover import complete, nodes_ready, status, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    with local_cluster(
        tmp_path_factory.mktemp("restart-pool"),
        cost_cache,
        num_prefill=1,
        group_size=1,
        extra={"scheduler.rejection": "none"},
    ) as launcher:
        yield launcher


def test_a_restarted_master_keeps_every_committed_object_and_prefix(
    cluster: LocalLauncher,
) -> None:
    complete(cluster.url)
    assert complete(cluster.url)["prompt_tokens_details"]["cached_tokens"] > 0
    before = status(cluster.url)["num_pool_objects"]
    assert before > 0
    kill(cluster, "master")
    cluster.relaunch("master")
    nodes_s = wait_for("nodes back", lambda: nodes_ready(cluster.url, 3))
    after = status(cluster.url)["num_pool_objects"]
    usage = complete(cluster.url)
    print(
        f"\nmaster restarted: nodes back {nodes_s:.2f} s after it serves; committed pool "
        f"objects {before} -> {after}; cached_tokens after: "
        f"{usage['prompt_tokens_details']['cached_tokens']}"
    )
    assert after == before
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

"""Path choice: preferred NICs first and spread round-robin, retries walk the other paths,
a path that keeps failing is paused and comes back after its pause (upstream selectDevice)."""

from __future__ import annotations

import pytest

from mooncake.hw.topology import NicPreference as NicPref
from mooncake.transfer import paths as paths_mod
from mooncake.transfer.paths import Path, PathSet


class _Slice:
    def __init__(self) -> None:
        self.attempt = 0
        self.tried: list[Path] = []


def _paths() -> list[Path]:
    # local NIC x remote NIC; the buffer at cpu:0 prefers mlx5_0, the remote segment mlx5_2
    nics = [(loc, rem) for loc in ("mlx5_0", "mlx5_1") for rem in ("mlx5_2", "mlx5_3")]
    return [Path(f"{loc}->{rem}", loc, rem) for loc, rem in nics]


def test_preferred_pair_comes_first_then_available() -> None:
    ps = PathSet(_paths(), NicPref(["mlx5_0"], ["mlx5_1"]), ["mlx5_2"])
    assert [p.key for p in ps.paths] == [
        "mlx5_0->mlx5_2",
        "mlx5_0->mlx5_3",
        "mlx5_1->mlx5_2",
        "mlx5_1->mlx5_3",
    ]
    assert ps.num_preferred == 1
    assert {ps.first().key for _ in range(4)} == {"mlx5_0->mlx5_2"}  # type: ignore[union-attr]


def test_first_attempts_spread_over_every_preferred_path() -> None:
    ps = PathSet(_paths(), NicPref(["mlx5_0", "mlx5_1"], []), [])
    picks = [ps.first().key for _ in range(8)]  # type: ignore[union-attr]
    assert ps.num_preferred == 4 and set(picks) == {p.key for p in ps.paths}


def test_retry_walks_the_list_and_avoids_paths_that_failed_the_slice() -> None:
    ps = PathSet(_paths(), NicPref(["mlx5_0"], ["mlx5_1"]), ["mlx5_2"])
    s = _Slice()
    s.tried, s.attempt = [ps.paths[0]], 1
    assert ps.retry(s) is ps.paths[1]  # type: ignore[arg-type]
    s.tried, s.attempt = [ps.paths[0], ps.paths[1]], 2
    assert ps.retry(s) is ps.paths[2]  # type: ignore[arg-type]


def test_path_pauses_after_consecutive_failures_and_resumes(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(paths_mod.time, "monotonic", lambda: now[0])
    p = Path("p", "", "", pause_after=3, pause_s=1.0)
    assert not p.record_failure() and not p.record_failure()
    p.record_success(10)  # success resets the count
    assert [p.record_failure() for _ in range(3)] == [False, False, True]
    assert p.is_paused() and not p.record_failure()  # in-flight failures do not re-pause
    other = Path("q", "", "")
    ps = PathSet([p, other])
    assert ps.first() is other and ps.first() is other
    now[0] += 1.5
    assert not p.is_paused()
    assert [p.record_failure() for _ in range(3)] == [False, False, True]
    assert p.paused_until == pytest.approx(now[0] + 2.0)  # the pause doubled
    other.paused_until = now[0] + 10
    assert ps.first() is None and ps.retry(_Slice()) is None  # type: ignore[arg-type]

"""The NIC bench of scripts/hwtest (mooncake/hw/nicbench.py): perftest's output read as
GB/s, each NIC's Transfer Engine figure judged against it with the threshold, the
aggregate against the NICs' sum; nothing to measure is a skip, not a failure."""

from __future__ import annotations

import json

import pytest

from mooncake.hw import nicbench

WRITE_GBITS = """
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF		Device         : mlx5_0
 Number of qps   : 1		Transport type : IB
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 1048576    232800           0.00               390.56  		   0.046559
---------------------------------------------------------------------------------------
"""
READ_MBYTES = """
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 1048576    10000            23000.10            22888.00  		   0.022888
"""


def test_perftest_output_is_read_as_gigabytes_per_second() -> None:
    assert nicbench.parse_perftest(WRITE_GBITS) == pytest.approx(390.56 / 8)
    assert nicbench.parse_perftest(READ_MBYTES) == pytest.approx(22888.0 * 2**20 / 1e9)
    with pytest.raises(ValueError, match="no bandwidth result row"):
        nicbench.parse_perftest("Couldn't connect to 127.0.0.1:18515\n")


def test_each_nic_and_the_aggregate_are_judged_by_the_threshold() -> None:
    base = {"mlx5_0": 48.0, "mlx5_1": 48.0}
    ours = {"mlx5_0": 45.0, "mlx5_1": 30.0, "mlx5_0,mlx5_1": 80.0}

    def perftest(op: str, nic: str) -> float:
        return base[nic]

    def mooncake(op: str, nics: str) -> float:
        return ours[nics]

    rows = nicbench.judge(["mlx5_0", "mlx5_1"], ["write"], perftest, mooncake, 0.9)
    assert [(r.nic, r.passed) for r in rows] == [
        ("mlx5_0", True),
        ("mlx5_1", False),
        ("all", False),
    ]
    assert rows[0].ratio == pytest.approx(45 / 48) and rows[2].perftest_GBps == 96.0
    assert rows[2].ratio == pytest.approx(80 / 96)


def test_a_measurement_that_fails_is_a_failed_row_naming_why() -> None:
    def perftest(op: str, nic: str) -> float:
        raise RuntimeError("ib_read_bw exited 1: Couldn't connect")

    rows = nicbench.judge(["mlx5_0"], ["read"], perftest, lambda op, n: 40.0, 0.9)
    assert len(rows) == 1 and not rows[0].passed and rows[0].ratio is None
    assert "perftest: ib_read_bw exited 1" in rows[0].error and rows[0].mooncake_GBps == 40.0


def test_no_active_nic_is_a_skip(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(nicbench, "active_nics", lambda sysfs_root=None: [])
    assert nicbench.main([]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped"] == "no RDMA device with an ACTIVE port" and report["rows"] == []

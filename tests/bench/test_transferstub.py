"""`mooncake bench transfer --stub-device`: the stub ceiling of the C loop, of the
RdmaTransport over it and of the Python RDMA path in one run, as the JSON object other
tools read (keys and sanity of values, never the timings themselves), and the stub
device's pyverbs-like surface."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from mooncake.bench import stubverbs, transferstub
from mooncake.bench.stubverbs import stub_verbs
from mooncake.cli.app import app, load_verbs
from mooncake.native import rdmaloop


def test_stub_ceiling_json_has_both_paths_and_every_case() -> None:
    if rdmaloop.library() is None:
        pytest.skip("the RDMA C loop is not built (libibverbs headers missing at install)")
    load_verbs()
    args = ["bench", "transfer", "--stub-device", "--duration", "0.8", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)  # NOTE: stderr may carry a log line
    seen = {(f["path"], f["case"]) for f in report["figures"]}
    assert seen == {(p, c.name) for p in ("c", "transport", "python") for c in transferstub.CASES}
    for f in report["figures"]:
        assert f["slices_per_s"] > 0 and f["cpu_us_per_slice"] > 0 and f["gb_per_s"] > 0
        assert f["in_flight"] >= transferstub.IN_FLIGHT, f
    assert report["c_cpu_us_per_64k_slice"] > 0 and report["c_blocks_requests_per_s"] > 0
    assert report["c_busy_thread_cpu_share"] > 0 and report["num_cpus"] >= 1


def test_a_busy_thread_case_queues_one_switch_interval_of_the_unloaded_rate() -> None:
    case = next(c for c in transferstub.CASES if c.busy)
    per_s = 10 * case.slices_per_batch / sys.getswitchinterval()  # 10 batches per interval
    assert transferstub.busy_in_flight(case, per_s) == 10
    assert transferstub.busy_in_flight(case, 1.0) == transferstub.IN_FLIGHT


def test_the_stub_device_completes_only_signalled_requests_of_a_chain() -> None:
    """(With the stand-in SendWR: pyverbs' next_wr getter raises on a chained request.)"""
    v = stub_verbs()
    cq = v.CQ(v.Context(), 16)
    qp = v.QP(v.PD(v.Context()), v.QPInitAttr(scq=cq))
    wrs = [
        stubverbs.SendWR(wr_id=i, opcode=0, num_sge=1, sg=[stubverbs.SGE(0, 8, 1)])
        for i in range(3)
    ]
    wrs[1].send_flags = v.IBV_SEND_SIGNALED
    wrs[0].next_wr, wrs[1].next_wr = wrs[1], wrs[2]
    qp.post_send(wrs[0])
    num, wcs = cq.poll(8)
    assert num == 1 and int(wcs[0].wr_id) == 1 and int(wcs[0].status) == v.IBV_WC_SUCCESS

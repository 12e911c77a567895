"""The rdma transport's failure paths on the verbs emulator: verbs errors become
TransferErrors naming NIC and call with every QP made closed again, completion statuses are
classified, work that may block never runs on a poller, close() joins the pollers first,
memory registration is all-or-nothing (and says `ulimit -l` when pinning fails), fork_init
comes first, and the responder keys QPs by the initiator's path with a per-peer quota."""

from __future__ import annotations

import errno
import logging
import threading

import numpy as np
import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import TransferError
from mooncake.transfer import TransferOp, TransferRequest
from mooncake.transfer import rdma as rdma_transport
from mooncake.transfer.rdmaqp import GEN_SHIFT
from tests.transfer.peer import pattern
from tests.transfer.rdma_helpers import flat_fabric, rdma_engine, rdma_pair, transport

READ, WRITE = TransferOp.READ, TransferOp.WRITE


def _live_qps_match(emulator, *engines) -> bool:
    """Every QP alive in the emulator is one an engine holds (none leaked)."""
    held = 0
    for e in engines:
        t = transport(e)
        held += len(t._served) + sum(len(p.qps()) for p in t._paths.values())
    return held == emulator.live_qps("fake_0") + emulator.live_qps("fake_1")


@pytest.mark.parametrize("call", ["QP", "QP.to_init", "QP.to_rtr", "QP.to_rts", "QP.post_send"])
def test_a_failing_verbs_call_is_a_transfer_error_and_leaks_no_qp(emulator, caplog, call):
    flat_fabric()
    with rdma_pair(timeout_s=10.0) as (a, b):
        pool = b.allocate("pool", 1 << 16)
        src = pattern(1 << 16)
        a.register("src", src)
        emulator.FAIL_CALLS[call] = 1
        with caplog.at_level(logging.WARNING):
            a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check()
        assert (pool == src).all()
        names = {
            "QP": "create_qp",
            "QP.to_init": "modify_qp(INIT)",
            "QP.to_rtr": "modify_qp(RTR)",
            "QP.to_rts": "modify_qp(RTS)",
            "QP.post_send": "post_send",
        }
        assert f"RDMA fake_0: {names[call]} failed" in caplog.text or (
            f"RDMA fake_1: {names[call]} failed" in caplog.text
        )
        assert emulator.FAIL_CALLS[call] == 0 and _live_qps_match(emulator, a, b)


def test_remote_access_error_fails_at_once_and_logs_vendor_err(emulator, caplog) -> None:
    with rdma_pair() as (a, b):
        b.allocate("pool", 8192)
        a.register("src", pattern(8192))
        target = a.resolve("pool")
        # a stale descriptor claiming more memory than the peer registered: the NIC refuses
        import msgspec

        target.desc = msgspec.structs.replace(target.desc, num_bytes=1 << 20)
        with caplog.at_level(logging.WARNING):
            req = TransferRequest(WRITE, "src", 0, "pool", 1 << 19, 4096)
            status = a.submit([req]).wait(5.0)[0]
        assert status.state.value == "failed" and "status 10" in status.reason
        assert "resolved again" in status.reason and a.num_retries == 0
        assert "vendor_err 0x88" in caplog.text
        assert a._targets.peek("pool") is None  # forgotten: the next submit resolves it


def test_stale_completions_of_an_old_generation_are_ignored(emulator) -> None:
    flat_fabric()
    with rdma_pair() as (a, b):
        b.allocate("pool", 1 << 16)
        a.register("src", pattern(1 << 16))
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check()
        t = transport(a)
        gens = sorted(t._by_gen)
        old = gens[0]
        path, q = t._by_gen[old]
        with path.lock:
            path._to_error(q)  # drained already: destroyed at once, its slot emptied
        assert old not in t._by_gen
        flushed = int(emulator.IBV_WC_WR_FLUSH_ERR)
        t._complete([(old << GEN_SHIFT | 1, flushed, 0), (gens[-1] << GEN_SHIFT | 999, 0, 0)])
        assert t.num_stale == 2  # neither an unknown QP nor an unknown wr_id did anything
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check()
        assert min(t._by_gen) > old or len(t._by_gen) == len(gens)


def test_retries_and_reconnects_never_run_on_a_poller(emulator, monkeypatch) -> None:
    flat_fabric()
    calls: list[str] = []
    real = rdma_transport.control_call

    def recording(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(rdma_transport, "control_call", recording)
    with rdma_pair(pause_after_failures=1000) as (a, b):
        pool = b.allocate("pool", 1 << 18)
        src = pattern(1 << 18)
        a.register("src", src)
        reports: list[str] = []
        t = transport(a)
        report = t.report

        def recording_report(s, error, retryable, *more):
            if error:
                reports.append(threading.current_thread().name)
            report(s, error, retryable, *more)

        t.report = recording_report
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check()
        emulator.cut("fake_1")
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 18)]).check()
        emulator.cut("fake_1", False)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 18)]).check()  # reconnects
        assert (pool == src).all() and reports and len(calls) > 4
        pollers = [n for n in calls + reports if n.startswith("te-rdma-fake")]
        assert not pollers, pollers[:5]


def test_close_joins_the_pollers_before_destroying_what_they_poll(emulator) -> None:
    flat_fabric()
    a, b = rdma_engine("a"), rdma_engine("b")
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)
        b.allocate("pool", 1 << 22)
        a.register("src", pattern(1 << 22))
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check()
        for nic in transport(a).nics.values():
            nic.cq.poll_delay_s = 0.2  # widen the window a poller is inside poll()
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 22)])
    finally:
        a.close()
        b.close()
    for t in transport(a)._pollers:
        t.join(5)  # NOTE: a poller that close() left running may crash only now
    assert not emulator.CRASHES  # a poll of a destroyed CQ: a segfault on hardware


def test_partial_registration_is_rolled_back_and_the_name_freed(emulator) -> None:
    with rdma_engine("a") as a:
        buf = np.zeros(1 << 16, np.uint8)
        registered = len(emulator._MRS)
        emulator.DEVICES["fake_1"].mr_error = errno.EFAULT  # e.g. GPU memory, no peermem
        with pytest.raises(TransferError, match=r"RDMA fake_1: reg_mr of 65536 bytes failed"):
            a.register("buf", buf)
        assert len(emulator._MRS) == registered  # fake_0's MR was deregistered again
        emulator.DEVICES["fake_1"].mr_error = 0
        a.register("buf", buf)  # the name is free
        assert [k.nic for k in a.describe("buf").rdma] == ["fake_0", "fake_1"]


def test_a_dmabuf_registration_failing_with_a_foreign_error_rolls_back_every_nic(
    emulator, monkeypatch
) -> None:
    """pyverbs may raise something other than its own error type (an older rdma-core types
    DmaBufMR's fd argument differently: TypeError): the other NICs' MRs are closed, the
    error raised as it was, and the name is free again."""
    from mooncake.native import cudadmabuf

    monkeypatch.setattr(cudadmabuf, "export_dmabuf", emulator.export_dmabuf)
    buf = np.zeros(1 << 16, np.uint8)  # a stand-in for a GPU tensor
    start = buf.__array_interface__["data"][0]
    emulator.DEVICE_MEMORY.append((start, start + (1 << 16)))
    for spec in emulator.DEVICES.values():
        spec.peermem = False
    with rdma_engine("a") as a:
        registered = len(emulator._MRS)
        emulator.DEVICES["fake_1"].dmabuf_type_error = True
        with pytest.raises(TypeError):
            a.register("gpu", buf, location="cuda:0")
        assert len(emulator._MRS) == registered  # fake_0's dma-buf MR was closed again
        assert a.segments.get("gpu") is None
        emulator.DEVICES["fake_1"].dmabuf_type_error = False
        a.register("gpu", buf, location="cuda:0")
        assert [k.nic for k in a.describe("gpu").rdma] == ["fake_0", "fake_1"]


def test_pinning_past_the_memlock_limit_names_ulimit(emulator) -> None:
    with rdma_engine("a") as a:
        emulator.MEMLOCK_LIMIT = emulator._pinned[0] + (1 << 20)
        with pytest.raises(TransferError, match=r"ulimit -l"):
            a.register("big", np.zeros(1 << 21, np.uint8))
        assert a.segments.get("big") is None


def test_fork_init_comes_before_the_first_memory_registration(emulator) -> None:
    with rdma_engine("a") as a:
        a.register("buf", np.zeros(4096, np.uint8))
        mrs = a.segments.get("buf").rdma_handles[0].mrs()
        assert mrs and all(mr.fork_safe for mr in mrs)


def test_responder_keys_qps_by_the_initiators_path(emulator) -> None:
    """Two initiators with one name (a restarted node, or two processes) do not close
    each other's queue pairs on the target."""
    flat_fabric()
    fake0 = ("fake_0",)
    with (
        rdma_engine("b") as b,
        rdma_engine("a", nics=fake0) as a1,
        rdma_engine("a", nics=fake0) as a2,
    ):
        pool = b.allocate("pool", 1 << 16)
        for e in (a1, a2):
            e.directory.add_peer("127.0.0.1", b.server.port)
            e.register("src", pattern(1 << 16, offset=3))
        req = TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)
        a1.submit([req]).check()
        a2.submit([req]).check()
        a1.submit([req]).check()
        assert a1.num_retries == 0 and a2.num_retries == 0
        assert len(transport(b)._served) == 8 and (pool == pattern(1 << 16, offset=3)).all()


def test_a_peer_past_its_qp_quota_is_refused_naming_the_key(emulator, caplog) -> None:
    flat_fabric()
    quota = RdmaConfig(rdma_max_qps_per_peer=3)
    with rdma_pair(target_rdma=quota, pause_after_failures=1000) as (a, b):
        pool = b.allocate("pool", 1 << 18)
        a.register("src", pattern(1 << 18))
        with caplog.at_level(logging.WARNING):
            a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 18)]).check()
        assert (pool == pattern(1 << 18)).all()
        assert len(transport(b)._served) <= 3
        assert "transfer.rdma_max_qps_per_peer = 3" in caplog.text


def test_completion_statuses_are_classified(emulator) -> None:
    from mooncake.transfer.rdmaqp import Outcome, classify

    e = emulator
    want = {
        e.IBV_WC_SUCCESS: Outcome.OK,
        e.IBV_WC_REM_ACCESS_ERR: Outcome.RESOLVE,
        e.IBV_WC_REM_INV_REQ_ERR: Outcome.RESOLVE,
        e.IBV_WC_LOC_LEN_ERR: Outcome.FATAL,
        e.IBV_WC_LOC_PROT_ERR: Outcome.FATAL,
        e.IBV_WC_WR_FLUSH_ERR: Outcome.RETRY,
        e.IBV_WC_RETRY_EXC_ERR: Outcome.RETRY,
        e.IBV_WC_FATAL_ERR: Outcome.RETRY,
    }
    assert {s: classify(e, s) for s in want} == want


def test_gpu_memory_without_peermem_is_registered_as_dma_buf(emulator, monkeypatch) -> None:
    """No nvidia-peermem: a plain MR of device memory fails (EFAULT), the dma-buf of its
    pages is registered instead, addressed from its offset (iova), on both ends."""
    from mooncake.native import cudadmabuf

    flat_fabric()
    monkeypatch.setattr(cudadmabuf, "export_dmabuf", emulator.export_dmabuf)
    for spec in emulator.DEVICES.values():
        spec.peermem = False
    n = 1 << 18
    src, dst = pattern(n, offset=5), np.zeros(n, np.uint8)  # stand-ins for GPU tensors
    for buf in (src, dst):
        start = buf.__array_interface__["data"][0]
        emulator.DEVICE_MEMORY.append((start, start + n))
    with rdma_pair() as (a, b):
        a.register("src", src, location="cuda:0")
        b.register("dst", dst, location="cuda:0")
        keys = a.describe("src").rdma
        assert [k.address for k in keys] == [src.__array_interface__["data"][0] % 4096] * 2
        with pytest.raises(TransferError, match="reg_mr of 65536 bytes failed"):
            emulator.DEVICES["fake_0"].peermem = True  # a host buffer still needs a plain MR
            emulator.DEVICES["fake_0"].mr_error = errno.EFAULT
            a.register("host", np.zeros(1 << 16, np.uint8))
        emulator.DEVICES["fake_0"].mr_error = 0
        a.submit([TransferRequest(WRITE, "src", 0, "dst", 0, n)]).check()
        assert (dst == src).all()
        back = np.zeros(n, np.uint8)
        a.register("back", back)
        a.submit([TransferRequest(READ, "back", 0, "dst", 0, n)]).check()
        assert (back == src).all()

"""The C data loop (mooncake/native/rdmaloop.py) over the fake RDMA provider
(tests/transfer/fake_rdma.c, compiled here once per session): an initiator loop and a
target loop in this process, their QPs connected pairwise through the fake."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mooncake.native import rdmaloop
from mooncake.native.rdma import QpEndpoint, Route
from mooncake.native.rdmaloop import Paths, RdmaLoop, Region

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "transfer" / "fake_rdma.c"
IBV_WC_WR_FLUSH_ERR, IBV_WC_RETRY_EXC_ERR = 5, 12
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_fake: ctypes.CDLL | None = None
_why_not = ""


def build_fake() -> str:
    """Build the fake provider (once): "" when it is there, else why not. Test modules call
    it at import: compiling it is no process a test starts."""
    global _fake, _why_not
    if _fake is not None or _why_not:
        return _why_not
    if rdmaloop.library() is None:
        _why_not = "the RDMA C loop is not built (libibverbs headers missing at install)"
        return _why_not
    cc = shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")
    if cc is None:
        _why_not = "no C compiler to build the fake RDMA provider"
        return _why_not
    out = Path(tempfile.mkdtemp(prefix="fake-rdma-")) / "fake_rdma.so"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra"]
    cmd += ["-I", str(ROOT / "mooncake" / "native"), str(SOURCE), "-o", str(out), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        _why_not = f"the fake RDMA provider does not build: {done.stderr[-500:]}"
        return _why_not
    lib = ctypes.CDLL(str(out))
    lib.fake_provider.restype = ctypes.c_void_p
    lib.fake_last_fatal.restype = ctypes.c_char_p
    lib.fake_post_raw.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint32]
    lib.fake_post_raw.argtypes += [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32]
    _fake = lib
    return ""


def fake_library() -> ctypes.CDLL:
    """The fake provider; skips the test when it could not be built."""
    if build_fake():
        pytest.skip(_why_not)
    assert _fake is not None
    return _fake


def fake_stats(lib: ctypes.CDLL) -> dict[str, int]:
    out = np.zeros(5, np.uint64)
    lib.fake_stats(out.ctypes.data_as(ctypes.c_void_p))
    names = ("post_calls", "work_requests", "completions", "max_sq_used", "live_mrs")
    return dict(zip(names, (int(v) for v in out), strict=True))


@dataclass
class LoopPair:
    """Initiator `a` and target `b`, each with `num_nics` NICs; QPs of every NIC pair."""

    fake: ctypes.CDLL
    a: RdmaLoop
    b: RdmaLoop
    qps: list[tuple[int, int, int]]  # initiator QPs: (handle, local NIC, remote NIC)
    qpns: dict[int, int]  # initiator QP handle -> its QP number in the fake
    peers: dict[int, int]  # initiator QP handle -> the target's QP handle

    def paths(self, region: Region, qps: list[int] | None = None) -> Paths:
        """Paths over `qps` (default: all) toward the target's `region`."""
        chosen = [q for q in self.qps if qps is None or q[0] in qps]
        keys = [region.keys[remote] for _, _, remote in chosen]
        return Paths([q for q, _, _ in chosen], [k.base for k in keys], [k.rkey for k in keys])

    def close(self) -> None:
        self.a.close()
        self.b.close()


def loop_pair(
    num_nics: int = 2,
    qps_per_path: int = 2,
    depth: int = 64,
    signal_every: int = 4,
    max_chain: int = 16,
    cq_depth: int = 0,
) -> LoopPair:
    """`cq_depth`: entries per CQ (0: room for every QP of a NIC in one CQ)."""
    fake = fake_library()
    a = RdmaLoop.create(fake.fake_provider(), signal_every, max_chain)
    b = RdmaLoop.create(fake.fake_provider(), signal_every, max_chain)
    assert a is not None and b is not None
    cq_depth = cq_depth or depth * qps_per_path * num_nics
    for i in range(num_nics):
        a.open_nic(f"fake{i}", cq_depth)
        b.open_nic(f"fake{i}", cq_depth)
    qps, qpns, peers = [], {}, {}
    for local in range(num_nics):
        for remote in range(num_nics):
            for _ in range(qps_per_path):
                qa, qpn_a = a.create_qp(local, depth)
                qb, qpn_b = b.create_qp(remote, depth)
                route = Route(port_num=1, gid_index=0, mtu=5)
                a.connect_qp(qa, QpEndpoint(ZERO_GID, 0, qpn_b, 7, 5, 16), 9, route)
                b.connect_qp(qb, QpEndpoint(ZERO_GID, 0, qpn_a, 9, 5, 16), 7, route)
                qps.append((qa, local, remote))
                qpns[qa], peers[qa] = qpn_a, qb
    return LoopPair(fake, a, b, qps, qpns, peers)


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])

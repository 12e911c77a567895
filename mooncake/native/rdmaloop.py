"""The RDMA data loop in C (`_rdmaloop.c`), when it was built: batches of one-sided READ and
WRITE requests posted and completed with no Python per slice, waited for with the GIL
released.

`pip install` compiles `mooncake/native/_rdmaloop.c` against libibverbs' headers (an
optional extension: without them, or without a C compiler, the install goes on without it).
It is loaded here with ctypes twice: as a CDLL, whose calls release the GIL, for those that
may block (waiting for a batch, opening, closing), and as a PyDLL, whose calls keep it, for
those that return at once (submitting, polling a batch, reading and freeing its result). A
thread that gives the GIL up waits a whole switch interval (`sys.getswitchinterval()`, 5 ms)
to get it back while another Python thread is busy, so a submitter that released it on every
call would post one batch per 5 ms; keeping it, each turn it gets reaps every finished
batch and submits the next ones, and the loop runs on without Python meanwhile as long as
the work queued covers the interval.
`MOONCAKE_NATIVE_RDMALOOP=0` turns it off.

Who owns what: C owns the data-plane verbs objects (per NIC a device context, protection
domain and completion queue; queue pairs; memory regions, each registered on every NIC);
Python keeps discovery, the connection handshake (it passes the peer's GID, QPN, PSN and MTU
to `connect_qp`), path choice, pausing and retries. The loop calls verbs through a table of
function pointers: `provider="verbs"` is libibverbs, `"stub"` a device that completes every
work request at once and moves nothing (the stub ceiling of `mooncake bench transfer
--stub-device`); the tests pass a strict fake's table (tests/transfer/fake_rdma.c).

    loop = RdmaLoop.create("verbs")          # None: not built (or turned off)
    nic = loop.open_nic("mlx5_0", cq_depth)  # starts that NIC's poller thread
    loop.pin_poller(nic, cpus)               # on the CPUs of the NIC's NUMA node
    region = loop.register(address, num_bytes)   # keys per NIC: publish the rkeys
    qp, qpn = loop.create_qp(nic, max_send_wr, port_num)
    loop.connect_qp(qp, remote_endpoint, local_psn, route)
    result = loop.transfer(requests, paths, slice_bytes)   # submit + wait

A batch: `Requests` (one entry per request: op, local region, offset in it, offset in the
remote segment, length) and `Paths` (the QPs it may use, each with the remote NIC's base
address and rkey of that segment: keys differ per NIC, so they belong to the path). C cuts
slices of `slice_bytes`, hands them to the paths' QPs in turn, and posts chains of up to
`max_chain` work requests in one post_send, signalled every `signal_every`-th and on the
chain's last; send-queue room is counted by signalled requests. One poller thread per NIC
polls while that NIC has work in flight and refills its QPs; the waiter sleeps on the
batch's eventfd, written once when the batch's last slice finished. A QP that fails has its
in-flight slices reported failed (with its handle and the completion status); the batch's
unposted slices go to its other QPs, or are reported failed (`NO_PATH`) when none is left:
`BatchResult` is one report for the retry logic.

A region closed while batches use it is deregistered when the last of them finishes
(`close_region` says which happened); a request naming a closed region fails at submit
(`BAD_REGION`), never posted. The RdmaTransport's data plane over this loop is
transfer/rdmaloop.py (`transfer.rdma_data_loop`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np

from mooncake.errors import TransferError
from mooncake.native.cext import load_library
from mooncake.native.rdma import QpEndpoint, Route

OP_READ, OP_WRITE = 0, 1
# a request's status: 0 done, > 0 the ibv_wc_status of its first failed slice, or:
BAD_REGION = -1  # its region is closed or unknown, or the range lies outside it
NO_PATH = -2  # no QP of the batch was left to post it
POST_REFUSED = -3  # post_send refused it (the loop counts room, so a bug or a dying device)
NO_QP = 0xFFFFFFFF  # failed_qp of a request that failed on no QP
STAT_NAMES = (
    "post_calls",
    "work_requests",
    "signalled",
    "completions",
    "polls",
    "post_errors",
    "stale_completions",
    "batches",
    "wakeups",
)
QP_STATES = ("new", "ready", "error", "failed", "destroyed")


def library() -> ctypes.CDLL | None:
    """The loaded library, or None if it was not built or is turned off."""
    return load_library(
        "mooncake.native._rdmaloop",
        "MOONCAKE_NATIVE_RDMALOOP",
        _declare,
        "the Python RDMA path serves transfers (no libibverbs headers at install?)",
    )


def _declare(lib: ctypes.CDLL) -> None:
    ptr, u8, u16, u32, u64 = (
        ctypes.c_void_p,
        ctypes.c_uint8,
        ctypes.c_uint16,
        ctypes.c_uint32,
        ctypes.c_uint64,
    )
    i32 = ctypes.c_int
    sigs: dict[str, tuple[object, list[object]]] = {
        "rl_ops_verbs": (ptr, []),
        "rl_ops_stub": (ptr, []),
        "rl_engine_new": (ptr, [ptr, u32, u32, u32]),
        "rl_nic_open": (i32, [ptr, ctypes.c_char_p, i32]),
        "rl_nic_pin": (i32, [ptr, u32, ptr, u32]),
        "rl_region_register": (ctypes.c_int64, [ptr, u64, u64, i32, u64, ptr, ptr, ptr]),
        "rl_region_close": (i32, [ptr, u32]),
        "rl_qp_create": (i32, [ptr, u32, u32, u8, ptr]),
        "rl_qp_connect": (i32, [ptr, u32, ptr, u16, u32, u32, u32, u8, u8, u8, u8, u8, u8, u8, u8]),
        "rl_qp_to_error": (i32, [ptr, u32]),
        "rl_qp_state": (i32, [ptr, u32]),
        "rl_qp_destroy": (i32, [ptr, u32]),
        "rl_submit": (ptr, [ptr, u32, ptr, ptr, ptr, ptr, ptr, u32, ptr, ptr, ptr, u64, ptr]),
        "rl_wait": (i32, [ptr, i32]),
        "rl_result": (u32, [ptr, ptr, ptr, u32, ptr, ptr, ptr, ptr, ptr]),
        "rl_finish": (ctypes.c_int64, [ptr, i32, ptr, ptr]),
        "rl_finish_ok": (i32, [ptr]),
        "rl_free": (i32, [ptr]),
        "rl_stats": (u32, [ptr, ptr, u32]),
        "rl_engine_close": (None, [ptr]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


# the calls that return at once: called through a PyDLL, keeping the GIL (see above)
_AT_ONCE = ("rl_submit", "rl_finish", "rl_finish_ok", "rl_result", "rl_free")


def _holding_gil(lib: ctypes.CDLL) -> ctypes.PyDLL:
    """The same library's `_AT_ONCE` functions, typed alike, called without releasing the
    GIL (dlopen hands back the loaded library: one copy of its state)."""
    at_once = ctypes.PyDLL(lib._name)
    for name in _AT_ONCE:
        fn, typed = getattr(at_once, name), getattr(lib, name)
        fn.restype, fn.argtypes = typed.restype, typed.argtypes
    return at_once


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class Requests:
    """One batch's requests as arrays (reusable: a caller may refill them in place)."""

    def __init__(self, num: int):
        self.op = np.zeros(num, np.uint8)  # OP_READ or OP_WRITE
        self.region = np.zeros(num, np.uint32)  # local region handle
        self.local_offset = np.zeros(num, np.uint64)  # bytes into the region
        self.remote_offset = np.zeros(num, np.uint64)  # bytes into the remote segment
        self.length = np.zeros(num, np.uint64)  # bytes
        self._addresses = tuple(
            _address(a)
            for a in (self.op, self.region, self.local_offset, self.remote_offset, self.length)
        )

    def __len__(self) -> int:
        return len(self.op)

    @classmethod
    def of(
        cls,
        ops: list[int],
        regions: list[int],
        local_offsets: list[int],
        remote_offsets: list[int],
        lengths: list[int],
    ) -> Requests:
        r = cls(len(ops))
        r.op[:], r.region[:], r.local_offset[:] = ops, regions, local_offsets
        r.remote_offset[:], r.length[:] = remote_offsets, lengths
        return r


class Paths:
    """The QPs a batch may use, each with the remote NIC's base address and rkey of the
    segment the batch targets."""

    def __init__(self, qps: list[int], remote_bases: list[int], rkeys: list[int]):
        self.qp = np.array(qps, np.uint32)  # QP handles
        self.remote_base = np.array(remote_bases, np.uint64)  # address of remote byte 0
        self.rkey = np.array(rkeys, np.uint32)
        self._addresses = (_address(self.qp), _address(self.remote_base), _address(self.rkey))

    def __len__(self) -> int:
        return len(self.qp)


@dataclass(frozen=True)
class RegionKeys:
    """One region as registered on one NIC."""

    lkey: int
    rkey: int
    base: int  # the address work requests name the region's byte 0 by


@dataclass(frozen=True)
class Region:
    handle: int  # what Requests.region names
    keys: list[RegionKeys]  # per NIC, in open_nic order


@dataclass
class BatchResult:
    """What became of a batch: per request, and per failed slice (for retries)."""

    status: np.ndarray  # (num_requests,) int32: 0 done, > 0 wc status, < 0 BAD_REGION...
    failed_qp: np.ndarray  # (num_requests,) uint32: QP of the first failure, NO_QP if none
    slice_request: np.ndarray  # (num_failed,) uint32: the failed slice's request
    slice_offset: np.ndarray  # (num_failed,) uint64: bytes into that request
    slice_length: np.ndarray  # (num_failed,) uint64
    slice_qp: np.ndarray  # (num_failed,) uint32: the QP it failed on (NO_QP: none)
    slice_status: np.ndarray  # (num_failed,) int32

    @property
    def is_ok(self) -> bool:
        return not self.status.any()


@functools.lru_cache(maxsize=256)
def _all_done(num_requests: int) -> BatchResult:
    """The result of a batch whose every request is done (read-only arrays, shared)."""
    u32, u64, i32 = np.uint32, np.uint64, np.int32
    arrays = (
        np.zeros(num_requests, i32),
        np.full(num_requests, NO_QP, u32),
        np.empty(0, u32),
        np.empty(0, u64),
        np.empty(0, u64),
        np.empty(0, u32),
        np.empty(0, i32),
    )
    for a in arrays:
        a.flags.writeable = False
    return BatchResult(*arrays)


class Batch:
    """A submitted batch: wait() for its result (which frees it)."""

    def __init__(self, loop: RdmaLoop, handle: int, num_requests: int):
        self._loop, self._handle, self._num = loop, handle, num_requests

    def wait(self, timeout_s: float | None = None) -> BatchResult | None:
        """The batch's result once every slice finished, or None when `timeout_s` passed
        first (wait again: the slices are still in flight)."""
        at_once, handle = self._loop.at_once, self._handle
        rc = at_once.rl_finish_ok(handle)  # NOTE: the common case: done, every request ok
        if rc == -1 and timeout_s != 0:
            ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000))
            if self._loop.lib.rl_wait(handle, ms) < 0:  # NOTE: blocks, GIL released
                raise TransferError("RDMA C loop: waiting for a batch failed")
            rc = at_once.rl_finish_ok(handle)
        if rc == -1:
            return None
        if rc == 0:
            return _all_done(self._num)
        n = self._num
        status, failed_qp = np.empty(n, np.int32), np.empty(n, np.uint32)
        out = (_address(status), _address(failed_qp))
        num_failed = at_once.rl_finish(handle, 0, *out)
        if num_failed < 0:
            raise TransferError(
                f"RDMA C loop: waiting for a batch failed: {os.strerror(-num_failed)}"
            )
        u32, u64, i32 = np.uint32, np.uint64, np.int32
        arrays = (np.empty(num_failed, u32), np.empty(num_failed, u64), np.empty(num_failed, u64))
        qps, statuses = np.empty(num_failed, u32), np.empty(num_failed, i32)
        if num_failed:  # NOTE: only then is the batch still there (rl_finish freed it)
            at_once.rl_result(
                self._handle,
                _address(status),
                _address(failed_qp),
                num_failed,
                *(_address(a) for a in (*arrays, qps, statuses)),
            )
            at_once.rl_free(self._handle)
        return BatchResult(status, failed_qp, *arrays, qps, statuses)


@dataclass(frozen=True)
class LoopStats:
    counters: dict[str, int]  # STAT_NAMES -> count since the loop was created
    poller_cpu_ns: list[int]  # per NIC: its poller thread's CPU time


class RdmaLoop:
    """One process's C data loop: its NICs, regions, QPs and batches."""

    def __init__(self, lib: ctypes.CDLL, handle: int, provider: str):
        self.lib, self._handle, self.provider = lib, handle, provider
        self.at_once = _holding_gil(lib)  # lib's calls that return at once, keeping the GIL
        self.num_nics = 0
        self._closed = False

    @classmethod
    def create(
        cls,
        provider: str | int = "verbs",
        signal_every: int = 16,
        max_chain: int = 32,
        spin_us: int = 0,
    ) -> RdmaLoop | None:
        """A loop over `provider` ("verbs", "stub", or the address of a verbs table), or
        None when the extension is not built or is turned off. `spin_us`: how long a
        waiter spins on its batch before sleeping on the eventfd."""
        lib = library()
        if lib is None:
            return None
        if isinstance(provider, int):
            ops, name = provider, "table"
        else:
            ops, name = {"verbs": lib.rl_ops_verbs, "stub": lib.rl_ops_stub}[provider](), provider
        handle = lib.rl_engine_new(ops, signal_every, max_chain, spin_us)
        if not handle:
            raise TransferError(f"RDMA C loop: bad settings ({signal_every=}, {max_chain=})")
        return cls(lib, handle, name)

    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            raise TransferError(f"RDMA C loop: {what} failed: {os.strerror(-rc)}")
        return rc

    def open_nic(self, name: str, cq_depth: int) -> int:
        """Open device `name` with a CQ of `cq_depth` entries (the sum of its QPs' send
        queues at most) and start its poller: the NIC's index."""
        rc = self._check(
            self.lib.rl_nic_open(self._handle, name.encode(), cq_depth), f"open {name}"
        )
        self.num_nics += 1
        return rc

    def pin_poller(self, nic: int, cpus: list[int]) -> None:
        """Run NIC `nic`'s poller thread on `cpus` only (its NUMA node's)."""
        ids = np.array(cpus, np.uint32)
        self._check(
            self.lib.rl_nic_pin(self._handle, nic, _address(ids), len(ids)),
            f"pinning NIC {nic}'s poller to CPUs {cpus}",
        )

    def register(self, address: int, length: int) -> Region:
        """Register host memory on every NIC (all or none)."""
        return self._register(address, length, -1, 0)

    def register_dmabuf(self, fd: int, offset: int, length: int) -> Region:
        """Register a dma-buf (GPU memory) on every NIC; its work requests name byte 0 by
        `offset`."""
        return self._register(0, length, fd, offset)

    def _register(self, address: int, length: int, fd: int, offset: int) -> Region:
        n = max(self.num_nics, 1)
        lkeys, rkeys, bases = np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.uint64)
        rc = self.lib.rl_region_register(
            self._handle,
            address,
            length,
            fd,
            offset,
            _address(lkeys),
            _address(rkeys),
            _address(bases),
        )
        self._check(rc, f"registering {length} bytes")
        keys = [
            RegionKeys(int(lkeys[i]), int(rkeys[i]), int(bases[i])) for i in range(self.num_nics)
        ]
        return Region(rc, keys)

    def close_region(self, handle: int) -> bool:
        """Close a region: True deregistered now, False once the batches using it finish."""
        return self._check(self.lib.rl_region_close(self._handle, handle), "closing a region") == 0

    def create_qp(self, nic: int, max_send_wr: int, port_num: int = 1) -> tuple[int, int]:
        """A new RC QP on `nic` in INIT: (handle, QP number)."""
        qpn = ctypes.c_uint32()
        rc = self.lib.rl_qp_create(self._handle, nic, max_send_wr, port_num, ctypes.byref(qpn))
        return self._check(rc, f"create_qp on NIC {nic}"), qpn.value

    def connect_qp(self, qp: int, remote: QpEndpoint, local_psn: int, route: Route) -> None:
        """Move `qp` to RTR toward `remote` (MTU: route.mtu, already negotiated) and RTS."""
        gid = (ctypes.c_uint8 * 16).from_buffer_copy(bytes.fromhex(remote.gid.replace(":", "")))
        rc = self.lib.rl_qp_connect(
            self._handle,
            qp,
            gid,
            remote.lid,
            remote.qpn,
            remote.psn,
            local_psn,
            route.port_num,
            route.gid_index,
            route.mtu,
            route.hop_limit,
            route.traffic_class,
            route.service_level,
            route.max_rd_atomic,
            route.max_dest_rd_atomic,
        )
        self._check(rc, f"connecting QP {qp}")

    def to_error(self, qp: int) -> None:
        """Move `qp` to the error state: its work flushes, its batches use their other QPs."""
        self._check(self.lib.rl_qp_to_error(self._handle, qp), f"QP {qp} to error")

    def qp_state(self, qp: int) -> str:
        return QP_STATES[self._check(self.lib.rl_qp_state(self._handle, qp), f"QP {qp} state")]

    def destroy_qp(self, qp: int) -> bool:
        """Destroy a new or drained failed QP: True, or False while it is still in use."""
        rc = self.lib.rl_qp_destroy(self._handle, qp)
        return rc != -16 and self._check(rc, f"destroying QP {qp}") == 0  # -16: EBUSY

    def submit(self, requests: Requests, paths: Paths, slice_bytes: int) -> Batch:
        """Post a batch (returns at once; its slices are in flight or failed)."""
        err = ctypes.c_int()
        handle = self.at_once.rl_submit(
            self._handle,
            len(requests),
            *requests._addresses,
            len(paths),
            *paths._addresses,
            slice_bytes,
            ctypes.byref(err),
        )
        if not handle:
            self._check(err.value or -22, "submitting a batch")
        return Batch(self, handle, len(requests))

    def transfer(
        self, requests: Requests, paths: Paths, slice_bytes: int, timeout_s: float | None = None
    ) -> BatchResult:
        """Submit a batch and wait for it; TransferError if `timeout_s` passed first."""
        result = self.submit(requests, paths, slice_bytes).wait(timeout_s)
        if result is None:
            raise TransferError(f"RDMA C loop: a batch did not finish in {timeout_s} s")
        return result

    def stats(self) -> LoopStats:
        out = np.zeros(len(STAT_NAMES) + self.num_nics, np.uint64)
        self.lib.rl_stats(self._handle, _address(out), len(out))
        counters = {name: int(out[i]) for i, name in enumerate(STAT_NAMES)}
        return LoopStats(counters, [int(v) for v in out[len(STAT_NAMES) :]])

    def close(self) -> None:
        """Stop the pollers and destroy everything (wait for every batch first)."""
        if not self._closed:
            self._closed = True
            self.lib.rl_engine_close(self._handle)

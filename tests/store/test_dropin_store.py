"""MooncakeDistributedStore against a real master (a child process) with upstream's return
values, from docs/source/api-reference/python/mooncake-store.md and the error-code table:
two clients giving the pool memory (`a`, `c`) and one giving none (`b`), on 127.0.0.1."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.store.dropin import MIB, client, master, secret_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[str, dict[str, MooncakeDistributedStore]]]:
    with secret_env(), master() as addr:
        clients = {"a": client(addr, 32 * MIB), "b": client(addr, 0), "c": client(addr, 32 * MIB)}
        yield addr, clients
        for s in clients.values():
            assert s.close() == 0


def _buffer(size: int) -> tuple[ctypes.Array, int]:
    buf = (ctypes.c_ubyte * size)()
    return buf, ctypes.addressof(buf)


def test_setup_names_host_and_port_and_reports_health(stores) -> None:
    """get_hostname is "localhost:PORT" in upstream's range; a second setup is refused."""
    addr, s = stores
    host, port = s["a"].get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300
    assert s["a"].health_check() == 0
    assert s["a"].setup("localhost", "P2PHANDSHAKE", 0, MIB, "tcp", "", addr) == -600


def test_dict_setup_takes_human_sizes(stores) -> None:
    addr, _ = stores
    store = MooncakeDistributedStore()
    config = {
        "local_hostname": "localhost",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "global_segment_size": "16MB",
        "local_buffer_size": "16 MB",
        "master_server_addr": addr,
    }
    with secret_env():
        assert store.setup(config) == 0
    try:
        assert store.put("dict-setup", b"v") == 0 and store.get("dict-setup") == b"v"
    finally:
        store.close()


def test_put_get_and_repeated_put(stores) -> None:
    """put 0; the same put again 0 (upstream's Put); get of a miss b""; sizes and
    existence as upstream answers them."""
    _, s = stores
    value = os.urandom(10000)
    assert s["b"].put("pg", value) == 0
    assert s["b"].put("pg", value) == 0
    assert s["a"].get("pg") == value and s["b"].get("pg") == value
    assert s["a"].get("pg-missing") == b""
    assert s["a"].get_size("pg") == 10000 and s["a"].get_size("pg-missing") == -704
    assert s["a"].is_exist("pg") == 1 and s["a"].is_exist("pg-missing") == 0
    assert s["a"].batch_is_exist(["pg", "pg-missing"]) == [1, 0] and s["a"].batch_is_exist([]) == []
    assert s["a"].put("pg-empty", b"") == -600


def test_put_parts_upsert_and_batches(stores) -> None:
    _, s = stores
    assert s["a"].put_parts("parts", b"Hello, ", bytearray(b"World"), memoryview(b"!")) == 0
    assert s["b"].get("parts") == b"Hello, World!"
    assert s["a"].put("up", b"old") == 0 and s["a"].upsert("up", b"newer") == 0
    assert s["b"].get("up") == b"newer"
    assert s["a"].upsert_parts("up2", b"a", b"b") == 0 and s["a"].get("up2") == b"ab"
    keys, values = ["pb0", "pb1", "pb2"], [b"1", b"22" * 1000, os.urandom(70000)]
    assert s["b"].put_batch(keys, values) == 0
    assert s["b"].put_batch(keys, values) == 0  # all exist: upstream's BatchPut says 0
    assert s["a"].get_batch([*keys, "pb-missing"]) == [*values, b""]
    assert s["a"].put_batch(["x"], [b"1", b"2"]) == -600
    assert s["a"].upsert_batch(["ub"], [b"9"]) == 0 and s["a"].upsert_batch(["ub"], [b"10"]) == 0
    assert s["a"].get("ub") == b"10"
    assert s["a"].upsert("ub", b"11") == -706  # NOTE: ours: a value being read is not replaced


def test_remove_codes(stores) -> None:
    """remove: 0; a key a reader leases: -706 at once (force removes it); a miss: -704;
    batch_remove per key; remove_all counts what went."""
    _, s = stores
    assert s["a"].put("rm", b"v") == 0 and s["a"].remove("rm") == 0
    assert s["a"].remove("rm") == -704
    assert s["a"].put("rm", b"v") == 0 and s["b"].get("rm") == b"v"
    assert s["a"].remove("rm") == -706
    assert s["a"].remove("rm", force=True) == 0
    assert s["a"].put_batch(["br0", "br1"], [b"0", b"1"]) == 0
    assert s["b"].get("br1") == b"1"
    assert s["a"].batch_remove(["br0", "br1", "br-missing"]) == [0, -706, -704]
    assert s["a"].batch_remove(["br1"], force=True) == [0]
    assert s["a"].put("ra0", b"0") == 0 and s["a"].put("ra1", b"1") == 0
    assert s["a"].get("ra1") == b"1"
    assert s["a"].remove_all() >= 1  # ra0 at least; ra1 is leased
    assert s["a"].is_exist("ra0") == 0 and s["a"].is_exist("ra1") == 1
    assert s["a"].remove_all(force=True) >= 1
    assert s["a"].is_exist("ra1") == 0


def test_zero_copy_put_from_get_into(stores) -> None:
    """put_from / get_into on registered memory; a buffer too small or not registered,
    or overlapping another, answers negative."""
    _, s = stores
    data = b"Hello, Zero-Copy World! " * 1000
    buf, ptr = _buffer(len(data) + 1024)
    assert s["b"].register_buffer(ptr, len(buf)) == 0
    assert s["b"].register_buffer(ptr, len(buf)) == 0  # the same range again
    assert s["b"].register_buffer(ptr + 8, 16) == -600  # overlaps
    ctypes.memmove(ptr, data, len(data))
    assert s["b"].put_from("zc", ptr, len(data)) == 0
    assert s["a"].get("zc") == data
    ctypes.memset(ptr, 0, len(buf))
    assert s["b"].get_into("zc", ptr, len(buf)) == len(data)
    assert bytes(buf[: len(data)]) == data
    assert s["b"].get_into("zc", ptr, len(data) // 2) < 0
    assert s["b"].get_into("zc-missing", ptr, len(buf)) == -704
    other, optr = _buffer(64)
    assert s["b"].put_from("zc2", optr, 64) == -600  # never registered
    assert s["b"].unregister_buffer(ptr) == 0 and s["b"].unregister_buffer(ptr) == -600
    assert s["b"].put_from("zc2", ptr, 64) == -600


def test_batch_put_from_and_batch_get_into(stores) -> None:
    """Per key: 0 / bytes read, a miss -704, a bad pointer -600; lengths that do not
    match: every key negative; empty batches: empty answers."""
    _, s = stores
    values = [b"Batch 1! " * 100, b"Batch 2! " * 200, b"Batch 3! " * 150]
    keys = [f"bpf{i}" for i in range(3)]
    spacing = MIB
    buf, ptr = _buffer(spacing * 4)
    assert s["b"].register_buffer(ptr, len(buf)) == 0
    ptrs = [ptr + i * spacing for i in range(3)]
    for p, v in zip(ptrs, values, strict=True):
        ctypes.memmove(p, v, len(v))
    assert s["b"].batch_put_from(keys, ptrs, [len(v) for v in values]) == [0, 0, 0]
    assert s["b"].batch_put_from(keys, ptrs, [len(v) for v in values]) == [0, 0, 0]
    assert [s["a"].get(k) for k in keys] == values
    assert s["b"].batch_put_from(keys[:2], ptrs, [1, 1, 1]) == [-600, -600]
    assert s["b"].batch_put_from([], [], []) == []
    ctypes.memset(ptr, 0, len(buf))
    got = s["b"].batch_get_into(
        [*keys, "bgi-missing", keys[0]], [*ptrs, ptr + 3 * spacing, 5], [spacing] * 5
    )
    assert got == [len(v) for v in values] + [-704, -600]
    assert [
        bytes(buf[p - ptr : p - ptr + len(v)]) for p, v in zip(ptrs, values, strict=True)
    ] == values
    assert s["b"].batch_get_into(keys[:2], ptrs, [spacing] * 3) == [-600, -600]
    assert s["b"].batch_get_into([], [], []) == []
    assert s["b"].batch_get_into(keys[:1], ptrs[:1], [10]) == [-600]  # the value is larger
    assert s["b"].unregister_buffer(ptr) == 0


def test_multi_buffer_forms(stores) -> None:
    """A value gathered from several buffers comes back whole, and scattered in order."""
    _, s = stores
    src, sptr = _buffer(4096)
    dst, dptr = _buffer(4096)
    assert s["a"].register_buffer(sptr, 4096) == 0 and s["a"].register_buffer(dptr, 4096) == 0
    ctypes.memmove(sptr, os.urandom(4096), 4096)
    keys = ["mb0", "mb1"]
    ptrs = [[sptr, sptr + 1000], [sptr + 2000, sptr + 3000, sptr + 3500]]
    sizes = [[100, 200], [10, 20, 30]]
    assert s["a"].batch_put_from_multi_buffers(keys, ptrs, sizes) == [0, 0]
    expect = [
        bytes(src[0:100]) + bytes(src[1000:1200]),
        bytes(src[2000:2010]) + bytes(src[3000:3020]) + bytes(src[3500:3530]),
    ]
    assert s["b"].get_batch(keys) == expect
    out = s["a"].batch_get_into_multi_buffers(
        [*keys, "mb-missing"],
        [[dptr, dptr + 500], [dptr + 1000], [dptr + 2000]],
        [[150, 150], [60], [8]],
    )
    assert out == [300, 60, -704]
    assert bytes(dst[0:150]) + bytes(dst[500:650]) == expect[0]
    assert bytes(dst[1000:1060]) == expect[1]
    assert s["a"].batch_get_into_multi_buffers(keys[:1], [[dptr]], [[10]]) == [-600]
    assert s["a"].batch_put_from_multi_buffers(keys, ptrs[:1], sizes) == [-600, -600]
    assert s["a"].unregister_buffer(sptr) == 0 and s["a"].unregister_buffer(dptr) == 0


def test_get_into_ranges_as_documented(stores) -> None:
    """Upstream's documented example answers [[[4, 3], [5]], [[6], [4]]] with those bytes;
    mismatched shapes, ranges past the value or the buffer, and misses are negative."""
    _, s = stores
    d1, d2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123456789"
    assert s["a"].put("gr1", d1) == 0 and s["a"].put("gr2", d2) == 0
    b0, p0 = _buffer(32)
    b1, p1 = _buffer(32)
    assert s["b"].register_buffer(p0, 32) == 0 and s["b"].register_buffer(p1, 32) == 0
    got = s["b"].get_into_ranges(
        [p0, p1],
        [["gr1", "gr2"], ["gr2", "gr1"]],
        [[[0, 20], [8]], [[4], [16]]],
        [[[1, 30], [2]], [[0], [10]]],
        [[[4, 3], [5]], [[6], [4]]],
    )
    assert got == [[[4, 3], [5]], [[6], [4]]]
    assert (bytes(b0[0:4]), bytes(b0[8:13]), bytes(b0[20:23])) == (d1[1:5], d2[2:7], d1[30:33])
    assert (bytes(b1[4:10]), bytes(b1[16:20])) == (d2[0:6], d1[10:14])
    bad = s["b"].get_into_ranges([p0], [["gr1", "gr2"]], [[[0], []]], [[[0, 1], []]], [[[], []]])
    assert len(bad[0]) == 2 and bad[0][0][0] < 0 and bad[0][1] == []
    assert s["b"].get_into_ranges([p0], [["gr1"]], [[[0]]], [[[len(d1) - 1]]], [[[4]]])[0][0][0] < 0
    assert s["b"].get_into_ranges([p0], [["gr1"]], [[[31]]], [[[0]]], [[[4]]])[0][0][0] < 0
    missing = s["b"].get_into_ranges(
        [p0], [["gr-none", "gr1"]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]]
    )
    assert missing[0][0][0] == -704 and missing[0][1][0] == 4


def test_buffers_and_replica_descriptors(stores) -> None:
    """get_buffer: a bytes-like BufferHandle with ptr()/size(), None on a miss; replica
    descriptors name memory replicas with their size and endpoint."""
    _, s = stores
    assert s["a"].put("gb", b"buffer-bytes") == 0
    h = s["b"].get_buffer("gb")
    assert h is not None and bytes(h) == b"buffer-bytes" and h.size() == len(h) == 12
    assert h.ptr() != 0 and bytes(memoryview(h)) == b"buffer-bytes"
    assert s["b"].get_buffer("gb-missing") is None
    hs = s["b"].batch_get_buffer(["gb", "gb-missing"])
    assert bytes(hs[0]) == b"buffer-bytes" and hs[1] is None and s["b"].batch_get_buffer([]) == []
    config = ReplicateConfig()
    config.replica_num = 2
    assert s["b"].put("two", b"2" * 100, config) == 0
    descs = s["b"].get_replica_desc("two")
    assert len(descs) == 2 and all(d.is_memory_replica() and not d.is_disk_replica() for d in descs)
    mem = descs[0].get_memory_descriptor().buffer_descriptor
    assert mem.size == 100 and mem.transport_endpoint.startswith("127.0.0.1:")
    assert s["b"].get_replica_desc("two-missing") == []
    assert set(s["b"].batch_get_replica_desc(["two", "gb", "none"])) == {"two", "gb"}


def test_no_room_is_no_available_handle(stores) -> None:
    """A value larger than every segment: -200."""
    _, s = stores
    assert s["b"].put("huge", bytes(40 * MIB)) == -200
    assert s["b"].is_exist("huge") == 0


def test_close_drops_the_clients_objects(stores) -> None:
    """A client that closes unmounts its segment: the objects it held are gone; a client
    set up again works."""
    addr, s = stores
    with secret_env():
        d = client(addr, 16 * MIB)
        config = ReplicateConfig()
        config.preferred_segment = d.get_hostname()
        assert d.put("closing", b"v", config) == 0  # the writer's own segment first
        assert s["b"].get("closing") == b"v"
        assert d.close() == 0 and d.health_check() == 1 and d.close() == 0
        assert s["b"].get("closing") == b""
        assert d.setup("localhost", "P2PHANDSHAKE", 16 * MIB, MIB, "tcp", "", addr) == 0
        # NOTE: another reader: b's paths to the closed client's port pause a moment
        assert d.put("closing", b"w") == 0 and s["a"].get("closing") == b"w"
        d.close()


def test_zero_local_buffer_refuses_put_and_get(stores) -> None:
    addr, _ = stores
    with secret_env():
        z = client(addr, 0, buffer_bytes=0)
    try:
        assert z.put("zero-buffer", b"v") != 0 and z.is_exist("zero-buffer") == 0
        assert z.get("zero-buffer") == b""
    finally:
        z.close()


def test_gigabytes_of_segment_cost_nothing_until_written(stores) -> None:
    """Upstream's tests give each client gigabytes: the segment's pages are taken only
    when written."""
    addr, _ = stores

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    with secret_env():
        big = client(addr, 4 << 30, 16 * MIB)
    try:
        assert rss() - before < 512 * MIB
        assert big.put("big-seg", b"x" * 1000) == 0 and big.get("big-seg") == b"x" * 1000
    finally:
        big.close()

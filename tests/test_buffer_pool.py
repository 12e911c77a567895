"""`from mooncake import BufferPool` (mooncake/buffer_pool.py): upstream's top-level names,
loaded lazily, and the pool's rules against a real MooncakeDistributedStore on our
mooncake_master (as upstream's mooncake-wheel/tests/test_buffer_pool_native.py checks)."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import mooncake
from tests.roles.master.test_mooncake_master_script import (  # noqa: F401 (a fixture)
    SECRET,
    RunningMaster,
    master,
)

LOCAL_BUFFER_BYTES = 4 << 20


@pytest.mark.cluster
def test_import_mooncake_stays_light() -> None:
    """`import mooncake` loads neither the pool nor numpy; the names resolve on access."""
    code = (
        "import sys, mooncake; assert 'mooncake.buffer_pool' not in sys.modules; "
        "assert 'numpy' not in sys.modules; from mooncake import BufferPool, "
        "RegisteredBufferPool; assert BufferPool is RegisteredBufferPool; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mooncake.Nope  # noqa: B018


def test_constructor_rules_need_no_store() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        mooncake.BufferPool(None)


@pytest.fixture
def store_cls() -> Any:
    """Upstream's store class as this tree has it (skips before a master starts if not)."""
    store_mod = importlib.import_module("mooncake.store")
    if not hasattr(store_mod, "MooncakeDistributedStore"):
        pytest.skip("mooncake.store.MooncakeDistributedStore is not in this tree yet")
    return store_mod.MooncakeDistributedStore


@pytest.fixture
def store(
    store_cls: Any,
    master: RunningMaster,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Any]:
    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", SECRET)
    s = store_cls()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, LOCAL_BUFFER_BYTES, "tcp", "", master.rpc)
    assert rc == 0
    yield s
    s.close()


@pytest.mark.cluster
def test_leases_local_then_overflow(store: Any) -> None:
    """Leases come from the local buffer, then from registered overflow buffers; sizes 0
    and odd ones work; views are writable."""
    pool = mooncake.BufferPool(store, min_size_class=4096, alignment=4096)
    local = pool.acquire(LOCAL_BUFFER_BYTES)
    over = pool.acquire(1024, block=False)
    assert (local.size, over.size, over.ptr % 4096) == (LOCAL_BUFFER_BYTES, 1024, 0)
    view = over.buffer
    view[:4] = b"abcd"
    assert bytes(over.buffer[:4]) == b"abcd"
    del view
    gc.collect()
    over.release()
    local.release()
    for size in (0, 1, 128 * 1024 + 1):
        with pool.acquire(size) as lease:
            assert len(lease.buffer) == size
        gc.collect()
    pool.close()


@pytest.mark.cluster
def test_exhaustion_waiting_and_refusals(store: Any) -> None:
    pool = mooncake.BufferPool(store, alignment=4096, max_regions=1, block_on_exhaustion=False)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1, block=True, timeout=5)))
    waiter.start()
    time.sleep(0.1)
    view = lease.buffer
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    del view
    gc.collect()
    lease.release()
    waiter.join(10)
    assert not waiter.is_alive() and got[0].size == 1
    del got[:]
    gc.collect()  # a dropped lease is released
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire((1 << 64) - 1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)
    with pytest.raises(RuntimeError, match="alignment"):
        mooncake.BufferPool(store, 1 << 20, alignment=12345)

"""Buffer views and POSIX shared-memory arenas (mooncake.native.memory, mooncake.native.shm)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess

import numpy as np
import pytest

from mooncake.native.memory import align_up, aligned_empty, as_array, buffer_view
from mooncake.native.shm import ShmArena


def test_numpy_view_shares_memory_and_reports_address() -> None:
    arr = np.zeros((4, 8), dtype=np.float32)
    view = buffer_view(arr, "cpu:1")
    assert (view.num_bytes, view.address, view.location) == (128, arr.ctypes.data, "cpu:1")
    assert view.mv is not None
    view.mv[0:4] = np.float32(2.5).tobytes()
    assert arr[0, 0] == 2.5


def test_bytearray_view_is_writable_bytes() -> None:
    buf = bytearray(16)
    as_array(buffer_view(buf))[3] = 7
    assert buf[3] == 7


@pytest.mark.parametrize(
    "bad", [np.zeros((4, 4))[:, ::2], np.zeros(4).view(), b"read-only bytes", object()]
)
def test_unusable_buffers_are_refused(bad: object) -> None:
    if isinstance(bad, np.ndarray) and bad.flags.c_contiguous:
        bad.flags.writeable = False
    with pytest.raises(ValueError):
        buffer_view(bad)


def test_aligned_empty_is_aligned() -> None:
    assert aligned_empty(1000, 4096).ctypes.data % 4096 == 0
    assert align_up(4097, 4096) == 8192 and align_up(0, 64) == 0


def test_torch_tensor_of_any_dtype_is_viewed_in_place() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(6, dtype=torch.bfloat16)
    view = buffer_view(t)
    assert (view.num_bytes, view.address, view.location) == (12, t.data_ptr(), "cpu:0")
    assert view.mv is not None
    view.mv[0:2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert t[0].item() == 1.5
    with pytest.raises(ValueError, match="contiguous"):
        buffer_view(torch.zeros(4, 4).t())


def _attach_write_exit(name: str) -> None:
    arena = ShmArena.attach(name, 64)
    arena.array[:] = 9
    arena.close()  # a reader closing (or dying) must not unlink the owner's memory


@pytest.mark.cluster
def test_peer_closing_an_arena_does_not_unlink_it() -> None:
    with ShmArena.create(64) as arena:
        p = mp.get_context("spawn").Process(target=_attach_write_exit, args=(arena.name,))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert (arena.array == 9).all()
        again = ShmArena.attach(arena.name)  # still there
        assert again.num_bytes == 64
        again.close()
    with pytest.raises(FileNotFoundError):
        ShmArena.attach(arena.name)  # the owner's close unlinked it


def test_attach_refuses_a_smaller_arena_than_expected() -> None:
    with ShmArena.create(32) as arena, pytest.raises(ValueError, match="expected at least"):
        ShmArena.attach(arena.name, 64)


@pytest.mark.cluster
def test_sweep_removes_only_arenas_of_dead_creators() -> None:
    from mooncake.native.shm import NAME_PREFIX, sweep_stale

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    orphan = ShmArena.create(16, f"{NAME_PREFIX}{dead.pid}-test-orphan")
    orphan.is_owner = False  # as if its creator had been killed
    orphan.close()
    with ShmArena.create(16) as mine:
        removed = sweep_stale()
        assert orphan.name in removed and mine.name not in removed
        ShmArena.attach(mine.name).close()  # still there
    with pytest.raises(FileNotFoundError):
        ShmArena.attach(orphan.name)


def test_a_buffer_whose_type_has_no_module_is_a_buffer() -> None:
    """A ctypes array type made at run time can have __module__ None (seen through the
    Store drop-in's raw-address buffers): it is host memory, not mistaken for anything."""
    import ctypes

    from mooncake.native.memory import buffer_view

    array_type = ctypes.c_ubyte * 16
    array_type.__module__ = None  # type: ignore[assignment]
    view = buffer_view(array_type(), "cpu:0")
    assert view.num_bytes == 16 and view.mv is not None

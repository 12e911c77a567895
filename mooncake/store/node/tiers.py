"""A store node's memory and disk that the pool's segments live in.

- `DramTier`: a shared-memory arena registered with the Transfer Engine as one segment, so
  peers on the same host copy from it without a socket (shm) and remote ones use tcp.
- `VramTier`: a uint8 torch tensor on a device (`cpu` in tests), registered as one segment.
  torch is imported only when a VRAM tier is made.
- `SsdTier`: a file under `ssd_path`, also mapped (`mapping`, MAP_SHARED) so that the node
  registers it with a Transfer Engine: a reader copies an SSD replica straight into its
  own buffer, one-sided like memory, and the kernel pages the bytes in from the SSD (the
  node serves it; no promotion to wait for). The node's own moves use O_DIRECT I/O with
  an xxh3 checksum per object it wrote, checked when it reads the object back. The node
  holds an exclusive flock on its file while it lives (the kernel drops it when the
  process dies, however), so a starting node sweeps the directory's files nobody holds
  (`sweep_stale`: left by a killed node) and never touches a live node's.

Every tier answers `read(offset, size) -> bytes` and `write(offset, data)` for the node's
own moves; memory tiers also have a `segment` name that clients hand the Transfer Engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from typing import Any, Final

import numpy as np
import xxhash

from mooncake.errors import StoreError
from mooncake.native.memory import align_up
from mooncake.store.metadata.objects import Tier
from mooncake.transfer.engine import TransferEngine

log = logging.getLogger(__name__)

SSD_ALIGN_BYTES: Final = 4096  # O_DIRECT needs offsets, lengths and buffers on this grid
SSD_FILE_SUFFIX: Final = ".pool"  # an SSD tier's file: <segment>.pool under ssd_path
MEMORY_ALIGN_BYTES: Final = 64  # a cache line


class BaseTier:
    """One tier of one node: `capacity_bytes` of storage addressed by byte offset."""

    tier: Tier
    segment: str  # the segment name mounted with the master
    capacity_bytes: int
    alignment: int  # bytes; the master aligns allocations in this tier to it

    def read(self, offset: int, size: int) -> bytes:  # pragma: no cover - interface
        """A copy of `size` bytes at `offset`; raises StoreError when they cannot be read."""
        raise NotImplementedError

    def write(self, offset: int, data: bytes | memoryview) -> None:  # pragma: no cover
        """Store `data` at `offset`; raises StoreError when it cannot."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the memory or file."""

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.capacity_bytes:
            raise StoreError(
                f"{self.tier} tier {self.segment!r}: range [{offset}, {offset + size}) is "
                f"outside its {self.capacity_bytes} bytes"
            )


class _ArrayTier(BaseTier):
    """A memory tier whose bytes are a uint8 numpy array registered with the engine."""

    def __init__(self, engine: TransferEngine, segment: str, array: np.ndarray):
        self.engine, self.segment, self.array = engine, segment, array
        self.capacity_bytes = int(array.nbytes)
        self.alignment = MEMORY_ALIGN_BYTES

    def read(self, offset: int, size: int) -> bytes:
        self._check(offset, size)
        return self.array[offset : offset + size].tobytes()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self._check(offset, len(data))
        self.array[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        self.engine.unregister(self.segment)


class DramTier(_ArrayTier):
    tier: Tier = "dram"

    def __init__(
        self,
        engine: TransferEngine,
        segment: str,
        capacity_bytes: int,
        location: str | None = None,
    ):
        """`location`: "cpu:N", the NUMA node of the NICs or GPU that move its bytes (None:
        wherever its pages are first touched)."""
        super().__init__(engine, segment, engine.allocate(segment, capacity_bytes, location))


class VramTier(_ArrayTier):
    tier: Tier = "vram"

    def __init__(
        self, engine: TransferEngine, segment: str, capacity_bytes: int, device: str = "cuda:0"
    ):
        import torch  # only nodes with a VRAM tier pay for the import

        self.tensor: Any = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        location = "cpu:0" if self.tensor.device.type == "cpu" else str(self.tensor.device)
        engine.register(segment, self.tensor, location)
        # NOTE: on a GPU the node's own moves go through the tensor; on cpu it is also numpy
        array = self.tensor.numpy() if self.tensor.device.type == "cpu" else np.empty(0, np.uint8)
        super().__init__(engine, segment, array)
        self.capacity_bytes = capacity_bytes

    def read(self, offset: int, size: int) -> bytes:
        if self.tensor.device.type == "cpu":
            return super().read(offset, size)
        self._check(offset, size)
        return bytes(self.tensor[offset : offset + size].cpu().numpy().tobytes())

    def write(self, offset: int, data: bytes | memoryview) -> None:
        if self.tensor.device.type == "cpu":
            return super().write(offset, data)
        import torch

        self._check(offset, len(data))
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.tensor[offset : offset + len(data)].copy_(src)


class SsdTier(BaseTier):
    """A file of `capacity_bytes`; O_DIRECT when the filesystem takes it, pread otherwise.

    NOTE: the node writes with O_DIRECT while readers fault pages of `mapping` in: the
    kernel drops cached pages of a range a direct write covers, and the master never
    hands out a range that readers may still hold (leases), so readers see whole objects.
    Allocations are 4 KiB aligned, so two objects never share a page. A disk error while
    a page faults in raises SIGBUS in the reading process, as with any mapped file."""

    tier: Tier = "ssd"

    def __init__(self, ssd_path: str, segment: str, capacity_bytes: int):
        """Claim `<segment>.pool` under `ssd_path` (after sweeping the directory's stale
        files), sized to `capacity_bytes` and empty. Raises StoreError when a live node
        holds that file (two nodes with one id) or it cannot be sized."""
        self.segment = segment
        self.alignment = SSD_ALIGN_BYTES
        self.capacity_bytes = capacity_bytes
        os.makedirs(ssd_path, exist_ok=True)
        sweep_stale(ssd_path)
        self.path = os.path.join(ssd_path, f"{segment}{SSD_FILE_SUFFIX}")
        self._checksums: dict[int, tuple[int, int]] = {}  # offset -> (size bytes, xxh3_64)
        self.fd, self.is_direct = self._claim()
        try:
            os.ftruncate(self.fd, 0)  # NOTE: a killed predecessor's bytes go (sparse again)
            os.ftruncate(self.fd, capacity_bytes)
            self.mapping = self._map()
        except OSError as e:
            os.close(self.fd)
            raise StoreError(
                f"cannot size SSD tier file {self.path} to {capacity_bytes} "
                f"bytes: {e}; free space or lower store.ssd_bytes"
            ) from e

    def _claim(self) -> tuple[int, bool]:
        """Open and flock our file (O_DIRECT where the filesystem takes it); returns the
        descriptor and whether it is direct."""
        flags = os.O_RDWR | os.O_CREAT
        while True:
            try:
                fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
                is_direct = hasattr(os, "O_DIRECT")
            except OSError:  # tmpfs and some others refuse O_DIRECT
                fd, is_direct = os.open(self.path, flags, 0o600), False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                os.close(fd)
                raise StoreError(
                    f"SSD tier file {self.path} is held by another live node; give each "
                    "node its own node.id (or its own store.ssd_path)"
                ) from e
            if _is_same_file(self.path, fd):
                return fd, is_direct
            os.close(fd)  # NOTE: swept between our open and our lock: open it again

    def _map(self) -> mmap.mmap:
        """The whole file, shared and writable (a Transfer Engine segment must be writable:
        a cross-node demotion writes into it)."""
        fd = os.open(self.path, os.O_RDWR)  # NOTE: mapped through a page-cache descriptor
        try:
            return mmap.mmap(fd, self.capacity_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping keeps the file open

    def write(self, offset: int, data: bytes | memoryview) -> None:
        size = len(data)
        self._check(offset, size)
        buf = self._buffer(size)
        buf[:size] = data
        try:
            self._io(os.pwritev, buf, offset, size)
        finally:
            buf.close()
        self._checksums[offset] = (size, xxhash.xxh3_64_intdigest(data))

    def read(self, offset: int, size: int) -> bytes:
        """The object at `offset`, checked against the checksum of the node's own write. An
        object a peer wrote into `mapping` (a demotion from another node) has none here:
        it is read unchecked (its readers check their own format, as KV objects do)."""
        self._check(offset, size)
        want = self._checksums.get(offset)
        if want is not None and want[0] != size:
            raise StoreError(
                f"SSD tier {self.segment!r}: the object at {offset} is {want[0]} bytes, not {size}"
            )
        if want is None:
            return bytes(self.mapping[offset : offset + size])
        buf = self._buffer(size)
        try:
            self._io(os.preadv, buf, offset, size)
            data = bytes(buf[:size])
        finally:
            buf.close()
        if xxhash.xxh3_64_intdigest(data) != want[1]:
            raise StoreError(
                f"SSD tier {self.segment!r}: checksum mismatch for the {size}-byte object at "
                f"offset {offset} in {self.path}; the disk returned corrupt data"
            )
        return data

    def forget(self, offset: int) -> None:
        """The object at `offset` was released; its checksum goes with it."""
        self._checksums.pop(offset, None)

    def _buffer(self, size: int) -> mmap.mmap:
        # an anonymous mmap is page-aligned, as O_DIRECT requires of the user buffer
        return mmap.mmap(-1, align_up(max(size, 1), SSD_ALIGN_BYTES))

    def _io(self, fn: Any, buf: mmap.mmap, offset: int, size: int) -> None:
        length = align_up(size, SSD_ALIGN_BYTES) if self.is_direct else size
        length = min(length, len(buf), self.capacity_bytes - offset)
        if self.is_direct and offset % SSD_ALIGN_BYTES:
            raise StoreError(f"SSD tier {self.segment!r}: offset {offset} is not 4 KiB aligned")
        view = memoryview(buf)[:length]
        try:
            done = fn(self.fd, [view], offset)
        except OSError as e:
            raise StoreError(f"SSD tier I/O on {self.path} at offset {offset} failed: {e}") from e
        finally:
            view.release()
        if done < size:
            raise StoreError(f"SSD tier {self.path}: short I/O at {offset} ({done} of {size} B)")

    def close(self) -> None:
        """Close the file and remove it. Unregister `mapping` from its engine first."""
        try:
            self.mapping.close()
        except BufferError:  # NOTE: a view still exported: unmapped when the last one goes
            log.debug("SSD tier %s: mapping still in use; unmapped later", self.segment)
        try:  # NOTE: removed while we hold the lock: never a successor's file
            os.unlink(self.path)
        except OSError:
            log.warning("could not remove SSD tier file %s", self.path)
        os.close(self.fd)


def _is_same_file(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not unlinked, not made anew)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def sweep_stale(ssd_path: str) -> list[str]:
    """Remove the SSD tier files under `ssd_path` that no live process holds (their node
    was killed before it could remove them); returns their paths. A file a live node holds
    (its flock) is never touched, nor one made anew under the same name meanwhile."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(ssd_path))
    except OSError:
        return removed
    for name in names:
        if not name.endswith(SSD_FILE_SUFFIX):
            continue
        path = os.path.join(ssd_path, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _is_same_file(path, fd):
                    os.unlink(path)
                    removed.append(path)
        except OSError as e:
            log.warning("could not sweep stale SSD tier file %s: %s", path, e)
        finally:
            os.close(fd)  # NOTE: releases our lock
    if removed:
        log.warning("removed %d SSD tier files left by dead nodes in %s", len(removed), ssd_path)
    return removed

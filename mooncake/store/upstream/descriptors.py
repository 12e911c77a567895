"""What `get_replica_desc` returns, in upstream's shape (Replica::Descriptor and friends,
bound in mooncake-integration/store/store_py.cpp), built from our `ReplicaDesc`.

A memory replica (VRAM or DRAM tier) has a `MemoryDescriptor` whose buffer `Descriptor`
holds its size, `buffer_address` = its offset in its segment (our segments are addressed
by offset, not by the owner's virtual address) and `transport_endpoint` = the owner's
"host:port"; an SSD replica has a `DiskDescriptor` whose `file_path` is its segment name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mooncake.store.metadata.objects import ReplicaDesc


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


@dataclass
class Descriptor:
    """An allocated buffer: upstream's AllocatedBuffer::Descriptor."""

    size: int = 0  # bytes
    buffer_address: int = 0  # here: the offset in the owner's segment
    transport_endpoint: str = ""  # "host:port" of the owner's transfer server


@dataclass
class MemoryDescriptor:
    buffer_descriptor: Descriptor = field(default_factory=Descriptor)


@dataclass
class DiskDescriptor:
    file_path: str = ""  # here: the SSD segment's name
    object_size: int = 0  # bytes


class ReplicaDescriptor:
    """One replica of an object."""

    def __init__(self, desc: ReplicaDesc):
        self.desc = desc  # ours, for callers who know it
        self.status = (
            ReplicaStatus.COMPLETE if desc.state == "complete" else ReplicaStatus.PROCESSING
        )

    def is_memory_replica(self) -> bool:
        return self.desc.tier != "ssd"

    def is_disk_replica(self) -> bool:
        return self.desc.tier == "ssd"

    def is_local_disk_replica(self) -> bool:
        return False  # NOTE: upstream's client-local disk segments; ours are store nodes'

    def get_memory_descriptor(self) -> MemoryDescriptor:
        """Raises ValueError for a disk replica (upstream throws too)."""
        if not self.is_memory_replica():
            raise ValueError("get_memory_descriptor: this is a disk replica")
        d = self.desc
        return MemoryDescriptor(Descriptor(d.size, d.offset, d.endpoint))

    def get_disk_descriptor(self) -> DiskDescriptor:
        """Raises ValueError for a memory replica."""
        if not self.is_disk_replica():
            raise ValueError("get_disk_descriptor: this is a memory replica")
        return DiskDescriptor(self.desc.segment, self.desc.size)

    def __repr__(self) -> str:
        d = self.desc
        return f"<ReplicaDescriptor {d.tier} {d.segment}@{d.endpoint}+{d.offset} {d.size} B>"

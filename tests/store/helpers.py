"""Small builders for store tests: a service with nodes and segments, and a full put."""

from __future__ import annotations

from mooncake.store.metadata.objects import Instruction, ReplicaDesc
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.settings import MetadataConfig


def make_service(segments: dict[str, dict[str, int]], **config: object) -> MetadataService:
    """A service with `segments` = {node: {tier: capacity}} mounted at t=0, alignment 64;
    each segment is named "<node>-<tier>"."""
    svc = MetadataService(MetadataConfig(**config))  # type: ignore[arg-type]
    for node, tiers in segments.items():
        for tier, cap in tiers.items():
            svc.mount_segment(node, f"{node}-{tier}", tier, cap, now=0.0, alignment=64)
    return svc


def put(svc: MetadataService, key: str, size: int, now: float = 0.0, **kw: object) -> str:
    """put_start + put_end; returns the put_start status."""
    r = svc.writes.put_start(key, size, now, **kw)  # type: ignore[arg-type]
    if r.status == "ok":
        assert svc.writes.put_end(key, now).status == "ok"
    svc.check_integrity()
    return r.status


def dst(ins: Instruction) -> ReplicaDesc:
    """The destination of a move instruction."""
    assert ins.dst is not None, ins
    return ins.dst

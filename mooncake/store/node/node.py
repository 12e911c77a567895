"""What a store node runs: its tiers, mounted with the master, kept alive by heartbeats.

    node = StoreNode("store-0", master_address, secret, TierSizes(dram_bytes=1 << 30))
    node.start()   # registers segments with the Transfer Engine, mounts them, heartbeats
    ...
    node.stop()    # unmounts, closes the engine

Clients read and write the memory tiers straight through the Transfer Engine, and read
the SSD tier the same way (its file is mapped and registered as a segment, so a hit on SSD
is served within the request); the node itself only moves bytes when a heartbeat reply
tells it to (copy or demote DRAM -> SSD, promote SSD -> DRAM, a copy to another node),
then confirms the move to the master. While replies carry work it asks again at once
(tier moves keep up with a burst of puts), otherwise every `heartbeat_s`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake.errors import MooncakeError, RpcTimeout, StoreError
from mooncake.native.memory import align_up
from mooncake.rpc.client import RpcClient
from mooncake.store.metadata.objects import Instruction, Tier
from mooncake.store.node.tiers import SSD_ALIGN_BYTES, BaseTier, DramTier, SsdTier, VramTier
from mooncake.store.server.messages import (
    AckMsg,
    ConfirmMoveMsg,
    HeartbeatMsg,
    HeartbeatReplyMsg,
    KeyReplyMsg,
    MountSegmentMsg,
    UnmountSegmentMsg,
)
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.types import EngineOptions, TransferOp, TransferRequest

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: prefault page tables writable, data unchanged


@dataclass(frozen=True)
class TierSizes:
    """Resolved sizes of one node's tiers (0 = no such tier)."""

    dram_bytes: int = 0
    vram_bytes: int = 0
    ssd_bytes: int = 0
    ssd_path: str = ""  # directory of the SSD tier file
    vram_device: str = "cuda:0"  # torch device of the VRAM arena ("cpu" in tests)
    dram_location: str | None = None  # "cpu:N": the DRAM arena's NUMA node (its NICs')


def populate(array: np.ndarray) -> None:
    """Fault in every page of a shared-memory arena, leaving its bytes as they are (safe
    while clients write it). Otherwise each first write to a page costs a fault inside a
    client's transfer: puts run at half speed until the whole pool was written once. The
    pool's memory is committed now instead (about 1 s per GiB on a small VM)."""
    if array.nbytes == 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)  # NOTE: ctypes releases the GIL for the call
    addr, size = ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(array.nbytes)
    if libc.madvise(addr, size, _MADV_POPULATE_WRITE) != 0:  # Linux < 5.14
        int(array[:: mmap.PAGESIZE].sum())  # reads allocate the pages (writes then fault less)


def remote_name(segment: str, endpoint: str) -> str:
    """The Transfer Engine name of a replica's segment ("seg@host:port" when known)."""
    return f"{segment}@{endpoint}" if endpoint else segment


class StoreNode:
    """A node's tiers, mounted with the master while it runs."""

    def __init__(
        self,
        node_id: str,
        master_address: str,
        secret: bytes | str,
        sizes: TierSizes,
        *,
        host: str = "127.0.0.1",  # address the data-plane server binds
        heartbeat_s: float = 1.0,  # seconds between heartbeats; keep under heartbeat_ttl_s
        engine_options: EngineOptions | None = None,
        prefault: bool = False,  # fault in (commit) the DRAM tier's pages in the background
        nic_preference: Mapping[str, Any] | None = None,  # Topology.nic_preference
        engine: TransferEngine | None = None,  # serve the tiers on this one (not closed)
    ):
        """`engine`: a client's own engine, when the client contributes its memory to the
        pool (store/upstream/store.py): its reads and writes of that memory are then local
        copies. The node registers its tiers there and leaves the engine open at stop."""
        key = secret.encode() if isinstance(secret, str) else secret
        self.node_id = node_id
        self.heartbeat_s = heartbeat_s
        self._owns_engine = engine is None
        self.engine = engine or TransferEngine(
            node_id, key, engine_options, host=host, nic_preference=nic_preference
        )
        ep = self.engine.endpoints[0]
        self.endpoint = f"{ep.host}:{ep.port}"
        self.master = RpcClient(master_address, key, timeout_s=5.0)
        self.tiers: dict[Tier, BaseTier] = {}
        # NOTE: RDMA would pin every page of a registered region: the SSD file's mapping is
        # then served by a TCP-only engine of its own, so that it stays on disk
        self.ssd_engine: TransferEngine | None = None
        try:
            if sizes.vram_bytes:
                self.tiers["vram"] = VramTier(
                    self.engine, f"{node_id}.vram", sizes.vram_bytes, sizes.vram_device
                )
            if sizes.dram_bytes:
                self.tiers["dram"] = DramTier(
                    self.engine, f"{node_id}.dram", sizes.dram_bytes, sizes.dram_location
                )
            if sizes.ssd_bytes:
                if not sizes.ssd_path:
                    raise StoreError(
                        "store.ssd_bytes is set but store.ssd_path is empty; "
                        "name a directory on the SSD"
                    )
                cap = align_up(sizes.ssd_bytes, SSD_ALIGN_BYTES)
                ssd = self.tiers["ssd"] = SsdTier(sizes.ssd_path, f"{node_id}.ssd", cap)
                self._serve_ssd(ssd, key, host, engine_options)
        except BaseException:
            self._close_local()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"store-node-{node_id}", daemon=True
        )
        self.populated = threading.Event()  # set once the DRAM tier's pages are faulted in
        self.mounted: set[str] = set()  # segments the master accepted (what stop unmounts)
        dram = self.tiers.get("dram")
        if prefault and isinstance(dram, DramTier):
            threading.Thread(
                target=self._populate,
                args=(dram.array,),
                daemon=True,
                name=f"store-node-{node_id}-populate",
            ).start()
        else:
            self.populated.set()

    def _serve_ssd(
        self, ssd: SsdTier, key: bytes, host: str, options: EngineOptions | None
    ) -> None:
        engine = self.engine
        if "rdma" in engine.transport_names:
            tcp = dataclasses.replace(options or EngineOptions(), protocol="tcp")
            engine = self.ssd_engine = TransferEngine(f"{self.node_id}.ssd", key, tcp, host=host)
        engine.register(ssd.segment, ssd.mapping, "cpu:0")

    def _engine_of(self, tier: BaseTier) -> TransferEngine:
        return self.ssd_engine if tier.tier == "ssd" and self.ssd_engine else self.engine

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, wait_s: float = 60.0) -> None:
        """Mount every tier with the master, then heartbeat on a background thread. A
        master that is not up yet (nodes may start with it) is waited for up to `wait_s`,
        said at INFO on the first miss; raises RpcTimeout after that ("the master did not
        answer within N s: <the last call's error>"), or the master's refusal at once."""
        deadline, is_waiting = time.monotonic() + wait_s, False
        while True:
            # NOTE: no attempt outlives the wait (a call alone would take its 5 s)
            timeout_s = min(self.master.timeout_s, max(round(deadline - time.monotonic(), 1), 0.1))
            try:
                self.mount(timeout_s=timeout_s)
                break
            except RpcTimeout as e:
                if not is_waiting:
                    is_waiting = True
                    where = self.master.address.removeprefix("tcp://")
                    log.info(
                        "store node %s: waiting up to %g s for the master at %s",
                        self.node_id,
                        wait_s,
                        where,
                    )
                if time.monotonic() >= deadline:
                    raise RpcTimeout(f"the master did not answer within {wait_s:g} s: {e}") from e
        self._thread.start()

    def mount(
        self,
        is_remount: bool = False,
        segments: Collection[str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Mount every tier, or those whose segment is in `segments`; `is_remount`: to a
        master that forgot us (it restarted or expired us), so clients may still hold
        grants of the previous registration on this memory."""
        tiers = [t for t in self.tiers.values() if segments is None or t.segment in segments]
        for t in tiers:
            engine = self._engine_of(t)
            region = engine.segments.get(t.segment)
            assert region is not None, t.segment
            ep = engine.endpoints[0]
            msg = MountSegmentMsg(
                self.node_id,
                t.segment,
                t.tier,
                t.capacity_bytes,
                f"{ep.host}:{ep.port}",
                t.alignment,
                region.token,
                is_remount,
            )
            self.master.call(msg, AckMsg, timeout_s=timeout_s)
            self.mounted.add(t.segment)
        log.info("store node %s mounted %s", self.node_id, ", ".join(t.tier for t in tiers))

    def stop(self) -> None:
        """Stop heartbeats, unmount every tier (best effort) and release memory and files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.populated.wait()  # NOTE: its pages must stay mapped until it is done
        for t in self.tiers.values():
            if t.segment not in self.mounted:
                continue  # NOTE: a start that failed before mounting has nothing to undo
            try:
                self.master.call(UnmountSegmentMsg(self.node_id, t.segment), AckMsg, timeout_s=2)
            except MooncakeError as e:
                log.warning("unmount of %s failed (the master will expire it): %s", t.segment, e)
        self._close_local()

    def _populate(self, array: np.ndarray) -> None:
        try:
            populate(array)
        finally:
            self.populated.set()

    def _close_local(self) -> None:
        ssd = self.tiers.get("ssd")
        if ssd is not None and self._engine_of(ssd).segments.get(ssd.segment) is not None:
            self._engine_of(ssd).unregister(ssd.segment)  # NOTE: before its file is closed
        for t in self.tiers.values():
            t.close()
        if self.ssd_engine is not None:
            self.ssd_engine.close()
        if self._owns_engine:
            self.engine.close()
        self.master.close()

    # -- heartbeats and instructions ---------------------------------------------------------

    def heartbeat(self) -> int:
        """One heartbeat; mounts again the segments the master no longer has (it expired or
        forgot us), then runs the instructions. Returns how many there were."""
        reply = self.master.call(HeartbeatMsg(self.node_id), HeartbeatReplyMsg)
        missing = self.missing_segments(reply)
        if missing:
            # NOTE: mounted empty: the master dropped the objects that were in them
            log.warning(
                "master lost segments %s of store node %s; mounting them again (empty)",
                ", ".join(missing),
                self.node_id,
            )
            self.mount(is_remount=True, segments=missing)
        for ins in reply.instructions:
            self.carry_out(ins)
        return len(reply.instructions)

    def missing_segments(self, reply: HeartbeatReplyMsg) -> list[str]:
        """Our segments the master does not have mounted, as its heartbeat reply says.
        The reply's list, not `is_known`: after a link outage the heartbeats queued during
        it reach the master at once, and the reply to the first (is_known False) is dropped
        as late, so `is_known` alone would leave the segments unmounted for good."""
        if reply.mounted is None:  # an older master: only says whether it knew us
            return [] if reply.is_known else [t.segment for t in self.tiers.values()]
        have = set(reply.mounted)
        return [t.segment for t in self.tiers.values() if t.segment not in have]

    def _loop(self) -> None:
        num_done = 0
        while not self._stop.wait(0.0 if num_done else self.heartbeat_s):
            try:
                num_done = self.heartbeat()  # NOTE: work begets work: ask again at once
            except MooncakeError as e:
                num_done = 0
                log.warning("heartbeat of store node %s failed: %s", self.node_id, e)

    def carry_out(self, ins: Instruction) -> None:
        """Do what one instruction asks; confirm a move to the master (ok or not)."""
        src = self.tiers.get(ins.src.tier)
        if ins.kind == "evict":
            if isinstance(src, SsdTier):
                src.forget(ins.src.offset)
            return
        ok = False
        try:
            ok = self._move(ins)
        except MooncakeError as e:
            log.warning("move %d of %r failed: %s", ins.move_id, ins.key, e)
        self.master.call(ConfirmMoveMsg(ins.move_id, ok), KeyReplyMsg)

    def _move(self, ins: Instruction) -> bool:
        src, dst = self.tiers.get(ins.src.tier), ins.dst
        if src is None or dst is None or ins.src.segment != src.segment:
            return False
        size = ins.src.size
        if dst.node_id == self.node_id:
            target = self.tiers.get(dst.tier)
            if target is None or target.segment != dst.segment:
                return False
            target.write(dst.offset, src.read(ins.src.offset, size))
        elif isinstance(src, DramTier):  # one-sided write straight from our arena
            name = remote_name(dst.segment, dst.endpoint)
            req = TransferRequest(
                TransferOp.WRITE, src.segment, ins.src.offset, name, dst.offset, size, dst.token
            )
            self.engine.submit([req]).check()
        else:
            return False  # NOTE: the master only plans cross-node copies from memory tiers
        if ins.release_src and isinstance(src, SsdTier):
            src.forget(ins.src.offset)
        return True

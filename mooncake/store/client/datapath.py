"""How a Store client moves bytes: straight between its registered memory and the replicas'
segments, through its Transfer Engine, never through the master.

Every request carries the token the replica's segment was mounted with, so a segment that
was registered again since the master handed out the offsets (its node restarted) is
refused instead of written or read. Reads try memory replicas first (the client's own,
then the cheapest transport: shm before tcp), then SSD replicas (the owner serves its SSD
file as a segment: the bytes come straight from the disk), and fall back to the next
replica when one fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake.errors import StoreError, TransferError
from mooncake.store.metadata.objects import ReplicaDesc, Tier
from mooncake.store.node.node import remote_name
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.inline import Finish
from mooncake.transfer.types import TransferOp, TransferRequest, TransferState

_COST = {"local": 0, "rdma": 1, "shm": 1, "tcp": 2}  # transport -> rank (lower is cheaper)
_TIER_RANK: dict[Tier, int] = {"vram": 0, "dram": 1, "ssd": 2}

# (key, replicas to write, local segment, offset in it)
WritePlan = list[tuple[str, Sequence[ReplicaDesc], str, int]]
# (key, replicas to read from in order, local segment, offset in it, bytes)
ReadPlan = list[tuple[str, Sequence[ReplicaDesc], str, int, int]]


class DataPath:
    """The data plane of one client: `engine`, named `node_id` in the pool."""

    def __init__(self, engine: TransferEngine, node_id: str, timeout_s: float):
        self.engine, self.node_id, self.timeout_s = engine, node_id, timeout_s

    def write(self, plan: WritePlan) -> dict[str, str]:
        """Write each value to all its replicas in one batch; key -> why it failed."""
        reqs, owners = [], []
        for key, replicas, seg, off in plan:
            for d in replicas:
                reqs.append(_request(TransferOp.WRITE, seg, off, d, d.size))
                owners.append(key)
        if not reqs:
            return {}
        if len(reqs) == 1:  # a put of one replica: no Batch unless it has to wait
            try:
                self.engine.move(reqs[0], self.timeout_s)
                return {}
            except TransferError as e:
                return {owners[0]: f"writing a replica: {e}"}
        try:
            batch = self.engine.transfer(reqs, self.timeout_s)
        except TransferError as e:
            return {key: str(e) for key in owners}
        if not batch.num_open and not batch.has_failures:
            return {}
        failed: dict[str, str] = {}
        for key, st in zip(owners, batch.poll(), strict=True):
            if st.state is not TransferState.DONE:
                failed.setdefault(key, f"writing a replica: {st.state.value}: {st.reason}")
        return failed

    def read_one(self, d: ReplicaDesc, segment: str, offset: int, size: int) -> None:
        """Copy `size` bytes of replica `d` into `segment` at `offset`; TransferError."""
        try:
            self.engine.move(_request(TransferOp.READ, segment, offset, d, size), self.timeout_s)
        except TransferError:
            self.engine.forget(remote_name(d.segment, d.endpoint))
            raise

    def start_read(self, d: ReplicaDesc, segment: str, offset: int, size: int) -> Finish | None:
        """Begin reading replica `d` on this thread, for the caller to finish after other
        work: finish() says whether the bytes arrived, finish(False) abandons the read.
        None if it cannot begin without a lookup or a connect (TransferEngine.start):
        nothing was sent."""
        return self.engine.start(
            _request(TransferOp.READ, segment, offset, d, size), self.timeout_s
        )

    def read(
        self, key: str, replicas: Sequence[ReplicaDesc], segment: str, offset: int, size: int
    ) -> ReplicaDesc:
        """Copy the value from the best replica that works; returns that replica."""
        errors = []
        for d in self.rank(replicas):
            try:
                self.read_one(d, segment, offset, size)
                return d
            except TransferError as e:
                errors.append(f"{d.node_id}/{d.tier}: {e}")
        raise StoreError(f"get of {key!r}: every replica failed: " + "; ".join(errors))

    def read_many(self, plan: ReadPlan) -> tuple[dict[str, str], dict[str, ReplicaDesc]]:
        """Read every key from its first replica in one batch (the transfers overlap), then
        each key that failed from its other replicas in turn. Returns (key -> why it
        failed, key -> the later replica it was read from instead)."""
        if not plan:
            return {}, {}
        reqs = [
            _request(TransferOp.READ, seg, off, reps[0], size) for _, reps, seg, off, size in plan
        ]
        start = 1  # replicas still to try per key after the batch: the others
        try:
            statuses = self.engine.transfer(reqs, self.timeout_s).poll()
            firsts = [
                f"{st.state.value}: {st.reason}" if st.state is not TransferState.DONE else ""
                for st in statuses
            ]
        except TransferError:  # one bad descriptor rejects the batch: each key on its own
            firsts, start = ["not tried"] * len(plan), 0
        failed, moved = {}, {}
        for (key, reps, seg, off, size), why in zip(plan, firsts, strict=True):
            if not why:
                continue
            if start:
                self.engine.forget(remote_name(reps[0].segment, reps[0].endpoint))
            try:
                used = self.read(key, reps[start:], seg, off, size)
                if used is not reps[0]:
                    moved[key] = used
            except StoreError as e:
                first = f"{reps[0].node_id}/{reps[0].tier}: {why}; " if start else ""
                failed[key] = first + str(e)
        return failed, moved

    def rank(self, replicas: Sequence[ReplicaDesc]) -> list[ReplicaDesc]:
        """The replicas, cheapest to read first: memory before SSD (the reader's own SSD
        too: a page fault reads the disk), then by transport and tier."""

        def cost(d: ReplicaDesc) -> tuple[bool, int, int]:
            on_ssd = d.tier == "ssd"
            if d.node_id == self.node_id:
                return on_ssd, 0, _TIER_RANK[d.tier]
            try:
                transport = self.engine.resolve(remote_name(d.segment, d.endpoint)).transport
                return on_ssd, _COST.get(transport.name, 3), _TIER_RANK[d.tier]
            except TransferError:
                return on_ssd, 9, 0  # unreachable now: try it last

        return sorted(replicas, key=cost) if len(replicas) > 1 else list(replicas)


def _request(
    op: TransferOp, segment: str, offset: int, d: ReplicaDesc, size: int
) -> TransferRequest:
    name = remote_name(d.segment, d.endpoint)
    return TransferRequest(op, segment, offset, name, d.offset, size, d.token)

"""Random put/get/remove/pin/evict/move/expire sequences over the metadata service.

After every step the service passes check_integrity(); an object never vanishes without
an explanation (remove, lost with its nodes, or dropped by eviction); expiry never loses an
object that had a COMPLETE replica on a surviving node; eviction never touches a leased,
pinned or uncommitted object. With SSD room for everything (`BigSsd`), eviction never
loses an object at all. The committed pool's plain entries (`snapshot`) rebuild a service
whose own entries compare equal. An object relocated off a full writer (store/metadata/eviction.py,
`room_on_writer`) reads as a miss until the put carrying its bytes ends, and goes if that
put never does.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mooncake.store.metadata.objects import Instruction
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.settings import MetadataConfig

NODES = ("a", "b", "c")
KEYS = st.sampled_from([f"k{i}" for i in range(16)])
NODE = st.sampled_from(NODES)


class StoreMachine(RuleBasedStateMachine):
    ssd_bytes = 1024  # per node: small, so DRAM victims are sometimes dropped

    def __init__(self) -> None:
        super().__init__()
        cfg = MetadataConfig(
            high_watermark=0.75, low_watermark=0.5, lease_ttl_s=5.0, put_timeout_s=20.0
        )
        self.svc = MetadataService(cfg)
        self.now = 0.0
        self.alive = set(NODES)
        self.pending: list[Instruction] = []
        self.committed: set[str] = set()  # keys the model believes readable
        self.moving: set[str] = set()  # keys relocated by a put not ended yet
        self.explained: set[str] = set()  # keys allowed to vanish during this step
        for node in NODES:
            self._mount(node)

    def _mount(self, node: str) -> None:
        self.svc.mount_segment(node, f"{node}-dram", "dram", 512, self.now)
        self.svc.mount_segment(node, f"{node}-ssd", "ssd", self.ssd_bytes, self.now, alignment=64)

    def _drain(self) -> None:
        for e in self.svc.pool.drain_events():
            if e.kind in ("lost", "removed") or (e.kind == "evicted" and self.may_drop):
                self.explained.add(e.key)
        self.pending += [i for i in self.svc.pool.drain_instructions() if i.kind != "evict"]

    may_drop = True  # eviction may drop objects (no room below)

    @rule(
        key=KEYS,
        size=st.integers(1, 200),
        replicas=st.integers(1, 2),
        writer=NODE,
        end=st.booleans(),
        overwrite=st.booleans(),
        pin=st.sampled_from([0.0, 4.0]),
    )
    def put(self, key, size, replicas, writer, end, overwrite, pin):
        r = self.svc.writes.put_start(
            key, size, self.now, writer, replicas, ("dram",), pin, overwrite
        )
        if r.status == "ok":
            assert {d.node_id for d in r.replicas}.__len__() == len(r.replicas)
            self.committed.discard(key)
            self.explained.add(key)  # an overwrite removes the old object
            moved = {m.key for m in r.relocations}
            assert all(d.node_id == writer for d in r.replicas[:1]) or not moved
            self.committed -= moved
            self.moving |= moved
            if moved:
                event("relocated")
            if end:
                self.end(key)

    @rule(items=st.lists(st.tuples(KEYS, st.integers(1, 200), NODE), min_size=1, max_size=6))
    def fill(self, items):
        for key, size, writer in items:
            self.put(key, size, 1 + len(key) % 2, writer, True, False, 0.0)

    @rule(key=KEYS)
    def end(self, key):
        obj = self.svc.objects.get(key)
        was_writing = obj is not None and not obj.is_committed
        status = self.svc.writes.put_end(key, self.now).status
        assert (status == "ok") == (obj is not None)
        if was_writing:
            self.committed.add(key)
        for k in list(self.moving):  # the relocations its put carried are readable again
            o = self.svc.objects.get(k)
            if o is None or not o.relocated_by:
                self.moving.discard(k)
                if o is not None and o.is_committed:
                    self.committed.add(k)

    @rule(key=KEYS)
    def revoke(self, key):
        if self.svc.writes.put_revoke(key, self.now).status == "ok":
            assert key not in self.committed

    @rule(key=KEYS, reader=NODE)
    def get(self, key, reader):
        r = self.svc.get_replicas(key, self.now, reader)
        assert (r.status == "ok") == (key in self.committed), (key, r)

    @rule(key=KEYS)
    def remove(self, key):
        if self.svc.remove(key, self.now).status == "ok":
            self.committed.discard(key)

    @rule(key=KEYS, ttl=st.sampled_from([0.0, 3.0]))
    def pin(self, key, ttl):
        self.svc.pin(key, ttl, self.now)

    @rule()
    def evict(self):
        protected = {
            k: [(r.segment.name, r.offset) for r in o.replicas]
            for k, o in self.svc.objects.items()
            if o.is_protected(self.now)
        }
        self.svc.evictor.run(self.now)
        for k, where in protected.items():
            obj = self.svc.objects[k]
            assert [(r.segment.name, r.offset) for r in obj.replicas] == where, k
        self._drain()

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 99), ok=st.booleans())
    def confirm(self, i, ok):
        ins = self.pending.pop(i % len(self.pending))
        self.svc.mover.confirm(ins.move_id, ok, self.now)

    @precondition(lambda self: self.pending)
    @rule(keys=st.lists(KEYS, max_size=4))
    def settle(self, keys):
        """Confirm every pending move, then read some keys (SSD hits start promotions)."""
        for ins in self.pending:
            self.svc.mover.confirm(ins.move_id, True, self.now)
        self.pending = []
        for key in keys:
            self.get(key, "a")

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 11.0, 25.0]))
    def advance(self, dt):
        self.now += dt
        for node in self.alive:
            if not self.svc.space.heartbeat(node, self.now):
                self._mount(node)
        before = {k: {r.node_id for r in o.complete()} for k, o in self.svc.objects.items()}
        dead = set(self.svc.expire(self.now))
        assert dead.isdisjoint(self.alive)
        for key, nodes in before.items():
            if key in self.committed and nodes - dead:
                assert key in self.svc.objects, f"{key} lost with a replica on {nodes - dead}"
        self._drain()

    @precondition(lambda self: len(self.alive) > 1)
    @rule(node=NODE)
    def kill(self, node):
        self.alive.discard(node)

    @rule(node=NODE)
    def revive(self, node):
        self.alive.add(node)

    def teardown(self):
        c = self.svc.counters
        for name in ("evictions", "demotions", "promotions", "lost_objects", "removes"):
            if getattr(c, name):
                event(name)

    @invariant()
    def _check(self):
        self.svc.check_integrity()
        self._drain()
        readable = {k for k, o in self.svc.objects.items() if o.is_committed}
        gone = {k for k in self.moving if k not in readable}  # their put never ended
        self.moving -= gone
        readable -= self.moving
        vanished = self.committed - readable
        assert vanished <= self.explained, f"vanished without a reason: {vanished}"
        self.committed -= vanished
        assert self.committed == readable, (self.committed, readable)
        self.explained = set()
        # the committed pool, as plain entries, rebuilds a service that compares equal
        state = self.svc.pool.snapshot()
        fresh = MetadataService(self.svc.config)
        assert fresh.restore(state, self.now) == len(state.objects)
        fresh.check_integrity()
        assert fresh.pool.snapshot() == state


class BigSsdMachine(StoreMachine):
    ssd_bytes = 1 << 16  # room for every object: eviction must never lose one
    may_drop = False


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBigSsd = BigSsdMachine.TestCase
TestBigSsd.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

"""The master's view of its nodes: who registered, their state and load, and the prefill
pipeline groups it forms. Pure bookkeeping: time is passed in, no I/O.

Groups: prefill nodes are packed in registration order into groups of `group_size`; stage
s of a group owns layers [s*L/n, (s+1)*L/n). `group_size` 0 is automatic: at the first
prefill node, the fewest stages whose share of the weights fits in half of that node's
device memory (the other half holds KV and activations).

A group is schedulable (its leader becomes a Conductor prefill instance) once every stage
is ready; it stops being schedulable when any of its nodes goes down, or when its leader
says it is not ready (it lost its link to the next stage, and dials it again). A node
that comes back under its id, after a crash or a clean stop, takes its old place (its
stage's layers) in its group; `group_msg` then tells its neighbour where it listens now.
A stage a restarted master awaits (another stage of its group came back first) is kept for
its node while that one could still come back; once it has been awaited longer than
`ttl_s` (a live node would have registered again by then) the next node that has no place
yet takes it, so a group whose node restarted during the failover is not left waiting
forever (seen in `mooncake soak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake.api.status import NodeState, NodeStatus, host_port
from mooncake.roles.node.messages import GroupMsg, NodeInfoMsg, NodeLoadMsg


@dataclass
class NodeRecord:
    info: NodeInfoMsg
    registered_s: float
    last_seen_s: float
    state: NodeState = "starting"
    load: NodeLoadMsg = field(default_factory=NodeLoadMsg)
    group_id: str = ""
    stage: int = 0

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> str:
        return self.info.role


@dataclass
class Group:
    group_id: str
    size: int
    members: list[str] = field(default_factory=list)  # node ids by stage
    awaited_s: float = 0.0  # when a restarted master rebuilt it with a stage missing

    @property
    def leader(self) -> str:
        return self.members[0] if self.members else ""


class Registry:
    """Nodes by id and prefill groups; `ttl_s` without a heartbeat marks a node down."""

    def __init__(self, num_layers: int, group_size: int, ttl_s: float, weight_bytes: int = 0):
        assert group_size >= 0, group_size
        self.num_layers, self.group_size, self.ttl_s = num_layers, group_size, ttl_s
        self.weight_bytes = weight_bytes  # bytes of the model's weights (automatic groups)
        self.nodes: dict[str, NodeRecord] = {}
        self.groups: dict[str, Group] = {}
        self._num_groups = 0

    def register(self, info: NodeInfoMsg, now: float) -> NodeRecord:
        """Add or update a node; a prefill node gets (or keeps) a place in a group."""
        rec = self.nodes.get(info.node_id)
        if rec is None or rec.state == "down":
            old = rec
            rec = NodeRecord(info, now, now)
            if old is not None and old.group_id in self.groups:
                rec.group_id, rec.stage = old.group_id, old.stage  # rejoins its group
            self.nodes[info.node_id] = rec
        else:
            rec.info, rec.last_seen_s = info, now
        if info.role == "prefill" and info.group_id and not rec.group_id:
            self._rejoin(rec, info.group_id, info.stage, now)  # a master restarted under it
        elif info.role == "prefill" and not rec.group_id:
            place = self._old_place(info.node_id)
            if place is not None:  # deregistered (a clean stop) and started again
                self._rejoin(rec, *place, now)
            else:
                self._place(rec, now)
        return rec

    def _old_place(self, node_id: str) -> tuple[str, int] | None:
        """(group, stage) still listing `node_id` as a member, if any."""
        for g in self.groups.values():
            if node_id in g.members:
                return g.group_id, g.members.index(node_id)
        return None

    def _auto_group_size(self, device_memory_bytes: int) -> int:
        if device_memory_bytes <= 0 or self.weight_bytes <= 0:
            return 1
        return max(1, min(self.num_layers, -(-2 * self.weight_bytes // device_memory_bytes)))

    def _place(self, rec: NodeRecord, now: float) -> None:
        for g in self.groups.values():
            if "" in g.members and now - g.awaited_s > self.ttl_s:  # its node never came back
                rec.group_id, rec.stage = g.group_id, g.members.index("")
                g.members[rec.stage] = rec.node_id
                return
        if self.group_size == 0:
            self.group_size = self._auto_group_size(rec.info.device_memory_bytes)
        size = min(self.group_size, self.num_layers)
        group = next((g for g in self.groups.values() if len(g.members) < g.size), None)
        if group is not None and "" in group.members:  # a stage a restarted master awaits
            group = None
        if group is None:
            self._num_groups += 1
            group = Group(f"pg{self._num_groups}", size)
            self.groups[group.group_id] = group
        rec.group_id, rec.stage = group.group_id, len(group.members)
        group.members.append(rec.node_id)

    def _rejoin(self, rec: NodeRecord, group_id: str, stage: int, now: float) -> None:
        group = self.groups.get(group_id)
        if group is None:
            size = rec.info.group_size or self.group_size or 1
            group = self.groups[group_id] = Group(group_id, min(size, self.num_layers), [], now)
            self._num_groups = max(self._num_groups, int(group_id.removeprefix("pg") or 0))
        while len(group.members) <= stage:
            group.members.append("")
        group.members[stage] = rec.node_id
        rec.group_id, rec.stage = group_id, stage

    def group_msg(self, node_id: str) -> GroupMsg:
        rec = self.nodes[node_id]
        group = self.groups[rec.group_id]
        per = self.num_layers / group.size
        first, end = round(rec.stage * per), round((rec.stage + 1) * per)
        nxt = ""
        if rec.stage + 1 < len(group.members):
            nxt_rec = self.nodes.get(group.members[rec.stage + 1])
            nxt = nxt_rec.info.stage_address if nxt_rec and nxt_rec.state != "down" else ""
        return GroupMsg(group.group_id, rec.stage, group.size, first, end, nxt)

    def heartbeat(self, node_id: str, load: NodeLoadMsg, state: NodeState, now: float) -> bool:
        """Record a heartbeat; False when the node is unknown (or was marked down)."""
        rec = self.nodes.get(node_id)
        if rec is None or rec.state == "down":
            return False
        rec.last_seen_s, rec.load, rec.state = now, load, state
        return True

    def expire(self, now: float) -> list[NodeRecord]:
        """Mark nodes silent for ttl_s down; returns them."""
        gone = [
            r for r in self.nodes.values() if r.state != "down" and now - r.last_seen_s > self.ttl_s
        ]
        for r in gone:
            r.state = "down"
        return gone

    def remove(self, node_id: str) -> NodeRecord | None:
        rec = self.nodes.pop(node_id, None)
        if rec is not None and rec.group_id in self.groups:
            group = self.groups[rec.group_id]
            if all(self.nodes.get(m) is None for m in group.members):
                del self.groups[rec.group_id]
        return rec

    def schedulable_leaders(self) -> set[str]:
        """Leaders of groups whose every stage is ready."""
        out = set()
        for g in self.groups.values():
            recs = [self.nodes.get(m) for m in g.members]
            if len(recs) == g.size and all(r is not None and r.state == "ready" for r in recs):
                out.add(g.leader)
        return out

    def ready_decoders(self) -> set[str]:
        return {r.node_id for r in self.nodes.values() if r.role == "decode" and r.state == "ready"}

    def kv_capacity_tokens(self, role: str) -> int | None:
        """The most tokens of KV one ready decode node, or one schedulable prefill group (its
        smallest stage), holds; None when none is ready or one did not say (an older node):
        then no request is refused for its length here."""
        if role == "decode":
            caps = [self.nodes[n].info.kv_capacity_tokens for n in self.ready_decoders()]
        else:
            caps = [
                min(self.nodes[m].info.kv_capacity_tokens for m in self.groups[g].members)
                for g in (self.nodes[leader].group_id for leader in self.schedulable_leaders())
            ]
        return max(caps) if caps and all(caps) else None

    def missing(self) -> str:
        """What keeps a request from being placed: no schedulable prefill group, no ready
        decode node, or both; "" when neither is missing."""
        out = []
        if not self.schedulable_leaders():
            num = sum(r.role == "prefill" for r in self.nodes.values())
            waits = [
                f"{g.group_id} waits for {self._first_unready(g)}" for g in self.groups.values()
            ]
            detail = "; ".join([f"{num} prefill node{'' if num == 1 else 's'} registered", *waits])
            out.append(f"no prefill group is ready ({detail})")
        if not self.ready_decoders():
            num = sum(r.role == "decode" for r in self.nodes.values())
            out.append(f"no decode node is ready ({num} registered)")
        return " and ".join(out)

    def _first_unready(self, g: Group) -> str:
        """The stage `g` waits for: a stage whose node is gone (never registered, stopped,
        down or failed) before one that is only starting, since a leader that lost its link
        to a stopped next stage reports itself starting while it dials again."""
        starting = ""
        for stage in range(g.size):
            member = g.members[stage] if stage < len(g.members) else ""
            rec = self.nodes.get(member) if member else None
            if rec is None:
                return (
                    f"stage {stage} ({member}, stopped)" if member else f"stage {stage} to register"
                )
            if rec.state not in ("ready", "starting"):
                return f"stage {stage} ({rec.node_id}, {rec.state})"
            if rec.state == "starting" and not starting:
                starting = f"stage {stage} ({rec.node_id}, starting)"
        return starting or "the master to schedule it"


def node_statuses(
    registry: Registry, node_pool_bytes: dict[str, dict[str, int]], now: float
) -> list[NodeStatus]:
    """Every node as `/v1/status` shows it, by role and id (`node_pool_bytes`: node id ->
    tier -> bytes it has mounted in the pool)."""
    return [
        NodeStatus(
            node_id=r.node_id,
            role=r.role,
            address=host_port(r.info.rpc_address or r.info.data_address),
            state=r.state,
            gpus=r.info.gpus,
            nics=r.info.nics,
            num_queued=r.load.num_queued,
            num_running=r.load.num_running,
            num_reserved=r.load.num_reserved,
            load=r.load.load,
            last_seen_s=now - r.last_seen_s,
            pipeline_group=r.group_id,
            pool_bytes=node_pool_bytes.get(r.node_id, {}),
            transfer_bytes=r.load.transfer_bytes,
        )
        for r in sorted(registry.nodes.values(), key=lambda r: (r.role, r.node_id))
    ]

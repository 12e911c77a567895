"""The master role: the Store's metadata service, the Conductor, the node registry, the
OpenAI-compatible HTTP API with `/health` and the `/v1/status` feed, and `/metrics` (on the
API port or its own, as `[metrics]` says).

One control-plane endpoint (`cluster.master`) serves the Store's `store.*` messages and
the cluster's `node.*`/`master.*` ones. A housekeeping thread marks silent nodes down,
keeps the Conductor's instances in step with the registry (a prefill group is placed on
once every stage is ready) and feeds the Store's events into the Conductor's prefix index.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from functools import partial

from prometheus_client import CollectorRegistry

from mooncake.api.app import create_app
from mooncake.api.server import ApiServer, check_open_api
from mooncake.api.stats import RequestStats
from mooncake.api.status import MasterStatus, NodeStatus, Status, host_port, pool_status
from mooncake.conductor import ReplicationOrder
from mooncake.conductor.conductor import create_conductor
from mooncake.conductor.roofline import PrefillHardware
from mooncake.config.portrange import node_ports
from mooncake.config.settings import Config
from mooncake.errors import ConfigError
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.keys import kv_key
from mooncake.kvevents.feed import create_pool_feed
from mooncake.model.info import load_model_info
from mooncake.model.tokenizer import create_tokenizer
from mooncake.roles.master.admin import AdminRoutes, AdminServer, PoolView
from mooncake.roles.master.attribution import AttributionCollector
from mooncake.roles.master.cluster import ClusterBackend
from mooncake.roles.master.ha import MasterHa, exit_to_restart, file_journal
from mooncake.roles.master.metrics import ClusterCollector
from mooncake.roles.master.registry import Registry, node_statuses
from mooncake.roles.master.storefeed import StoreListeners
from mooncake.roles.node import sdnotify
from mooncake.roles.node.common import NODE_TTL_S, report_ready
from mooncake.roles.node.messages import (
    AckMsg,
    DeregisterMsg,
    GroupMsg,
    GroupQueryMsg,
    NodeHeartbeatMsg,
    NodeHeartbeatReplyMsg,
    PrefillEventMsg,
    PrefillStartMsg,
    PrefillStartReplyMsg,
    RegisterMsg,
    RegisterReplyMsg,
    TokensMsg,
)
from mooncake.router.backend import create_router
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.server.metrics import StoreCollector
from mooncake.store.server.service import StoreService

log = logging.getLogger(__name__)
TICK_S = 0.25  # seconds between housekeeping passes


class Master:
    def __init__(self, config: Config):
        self.config = cfg = config
        self.secret = cfg.cluster.require_secret().encode()
        api_keys = cfg.api.load_keys()
        check_open_api(cfg.api.host, api_keys, cfg.api.allow_unauthenticated)
        self.started = time.monotonic()
        self.lock = threading.Lock()  # NOTE: guards the Conductor and the registry
        info = load_model_info(cfg.model.path)
        self.model_name = cfg.api.served_model_name or cfg.model.path  # as vLLM names it
        ttl = max(NODE_TTL_S, cfg.store.heartbeat_ttl_s)  # one liveness rule for every node
        dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
        self.registry = Registry(
            info.spec.num_layers,
            cfg.prefill.pipeline_group_size,
            ttl,
            info.spec.weight_bytes(dtype_bytes),
        )
        self.conductor = create_conductor(cfg, info)
        self.hardware = PrefillHardware(cfg, info, self.conductor.cost)  # roofline's GPUs
        max_len = cfg.model.max_model_len or info.spec.max_position_embeddings
        self.backend = ClusterBackend(
            self.conductor,
            self.registry,
            create_tokenizer(cfg.model.path, info.eos_token_ids),
            self.model_name,
            max_len,
            self.secret,
            cfg.model.block_tokens,
            self.lock,
        )
        self.backend.on_unreachable = self._mark_down
        self.backend.on_replicate = self._replicate
        self.backend.vocab_size = info.spec.vocab_size
        self.backend.configure(cfg)
        self.fingerprint = ""  # hex, from the first engine node
        self.kv_events = create_pool_feed(cfg)  # the pool's changes as vLLM KV events
        listeners = StoreListeners(
            self.conductor.index, self.lock, self.kv_events, self.backend.misses
        )
        self.store = StoreService(
            self.secret,
            MetadataConfig.from_store_config(cfg.store),
            address=f"tcp://{cfg.cluster.master}",
            tick_s=0.1,
            on_events=listeners.on_events,
            direct_port=node_ports(cfg),
            journal=file_journal(cfg),
        )
        # NOTE: a change the journal did not take was not answered ok; start again from it
        self.store.on_journal_error = lambda e: exit_to_restart(f"the pool's journal: {e}")
        srv = self.store.server
        srv.register(RegisterMsg, self._on_register)
        srv.register(NodeHeartbeatMsg, self._on_heartbeat)
        srv.register(DeregisterMsg, self._on_deregister)
        srv.register(GroupQueryMsg, self._on_group_query)
        srv.register(PrefillEventMsg, self._on_prefill_event)
        srv.register(PrefillStartMsg, self._on_prefill_start)
        srv.register(TokensMsg, lambda m, _p: self.backend.receive_tokens(m))
        self.metrics = CollectorRegistry()
        self.metrics.register(StoreCollector(self.store.stats))
        self.metrics.register(ClusterCollector(self.backend.counters, self.registry, self.lock))
        self.metrics.register(AttributionCollector(self.backend.misses))
        self.stats = RequestStats()
        self.backend.phases.register_metrics(self.metrics)
        # NOTE: /metrics follows [metrics]: off when disabled, on its own port (no key: bind
        # metrics.host to a private address) when metrics.port is set, else on the API port
        # behind the API keys. Its own port also answers upstream Mooncake's read-only
        # admin queries (/get_all_segments, /query_key, ...: roles/master/admin.py)
        m = cfg.metrics
        routes = AdminRoutes(
            PoolView(self.store.metadata, self.store.lock), self.metrics, self.role
        )
        self.metrics_server = (
            AdminServer(routes, host=m.host, port=m.port) if m.enabled and m.port else None
        )
        # NOTE: with [router] backends, the API routes across vLLM instances (mooncake.router)
        self.router = create_router(
            cfg, self.conductor, self.lock, self.backend.tokenizer, self.model_name, max_len
        )
        app = create_app(
            self.router or self.backend,
            api_keys=api_keys,
            status_fn=self.status,
            metrics_registry=self.metrics,
            stats=self.stats,
            default_max_tokens=cfg.decode.max_tokens_default,
            serve_metrics=m.enabled and not m.port,
        )
        # NOTE: on etcd, a standby forwards the API to the leader until it leads itself
        self.ha = MasterHa(cfg, self.store, self.take_control) if cfg.cluster.etcd else None
        self.api = ApiServer(
            self.ha.wrap(app) if self.ha else app,
            cfg.api.host,
            cfg.api.port,
            drain_s=cfg.api.drain_s,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="master-house", daemon=True)
        self._instances: set[str] = set()  # Conductor instances (prefill leaders, decoders)

    # -- node handlers (RPC thread) --
    def _on_register(self, msg: RegisterMsg, _peer: object) -> RegisterReplyMsg:
        info, cfg = msg.info, self.config
        fp = info.model_fingerprint
        if fp:
            if not self.fingerprint:
                self.fingerprint = fp
                self.backend.hasher = PrefixHasher(
                    cfg.model.block_tokens, self.secret, bytes.fromhex(fp)
                )
            elif fp != self.fingerprint:
                why = (
                    f"node {info.node_id} serves another model or dtype (its KV fingerprint "
                    "differs from the cluster's)"
                )
                return RegisterReplyMsg(False, why)
        with self.lock:
            old = self.registry.nodes.get(info.node_id)
        if old is not None and old.state != "down" and old.info.incarnation != info.incarnation:
            # NOTE: restarted before its heartbeats lapsed: what the old process held is lost
            log.warning("node %s restarted: what its old process held is lost", info.node_id)
            self._mark_down(info.node_id)
            # NOTE: the new process may have mounted its tiers already (after the old one's
            # last heartbeat): only what the old one mounted goes
            self.store.drop_stale_segments(info.node_id, old.last_seen_s)
        with self.lock:
            rec = self.registry.register(info, time.monotonic())
            group = self.registry.group_msg(rec.node_id) if info.role == "prefill" else None
            if info.role == "prefill":
                self.hardware.follow(info.node_id, info.gpus, self.conductor)
        where = info.rpc_address or info.data_address
        log.info("node %s (%s) registered from %s", info.node_id, info.role, where)
        return RegisterReplyMsg(
            True,
            group=group,
            block_tokens=cfg.model.block_tokens,
            ttft_slo_s=cfg.scheduler.ttft_slo_s,
            tbt_slo_s=cfg.scheduler.tbt_slo_s,
        )

    def _on_heartbeat(self, msg: NodeHeartbeatMsg, _peer: object) -> NodeHeartbeatReplyMsg:
        with self.lock:
            rec = self.registry.nodes.get(msg.node_id)
            before = rec.state if rec is not None else ""
            known = self.registry.heartbeat(msg.node_id, msg.load, msg.state, time.monotonic())
            if known and msg.state != before:  # placeable (or not) from this moment on
                self._sync_instances()
        return NodeHeartbeatReplyMsg(known)

    def _on_deregister(self, msg: DeregisterMsg, _peer: object) -> AckMsg:
        with self.lock:
            rec = self.registry.remove(msg.node_id)
        if rec is not None:
            log.info("node %s left", msg.node_id)
            self._drop_instance(msg.node_id)
        return AckMsg()

    def _on_group_query(self, msg: GroupQueryMsg, _peer: object) -> GroupMsg:
        with self.lock:
            return self.registry.group_msg(msg.node_id)

    def _on_prefill_start(self, msg: PrefillStartMsg, _peer: object) -> PrefillStartReplyMsg:
        with self.lock:
            adm = self.conductor.admit_prefill(msg.req_id, time.monotonic())
            rec = self.registry.nodes.get(adm.decode) if adm.is_accepted else None
            self.backend.misses.started(msg.req_id)  # NOTE: the pool as the prefill starts
        self.backend.on_prefill_admission(msg.req_id, adm)
        if not adm.is_accepted:
            return PrefillStartReplyMsg(False, reason=adm.reason)
        address = rec.info.rpc_address if rec is not None else ""
        return PrefillStartReplyMsg(True, adm.decode if address else "", address)

    def _on_prefill_event(self, msg: PrefillEventMsg, _peer: object) -> AckMsg:
        if msg.phase == "failed":
            log.warning("req %d failed on %s: %s", msg.req_id, msg.node_id, msg.error)
            with self.lock:
                addr = msg.unreachable_address
                dead = [n for n, r in self.registry.nodes.items() if addr == r.info.rpc_address]
            for node_id in dead:  # NOTE: not a restarted one: it answers at a new address
                self._mark_down(node_id)
            self.backend.on_prefill_failed(msg.req_id, msg.node_id, msg.error)
            return AckMsg()
        self.backend.on_prefill_finished(msg)
        return AckMsg()

    def _replicate(self, order: ReplicationOrder) -> None:
        """Carry out a Conductor's hot-spot replication: the blocks' pool objects get a
        copy in the destination node's DRAM (the Store's move machinery; added events then
        tell the prefix index)."""
        keys = [kv_key(h) for h in order.block_hashes if isinstance(h, int)]
        started = self.store.replicate(keys, order.dst)
        log.debug("replicating %d of %d blocks %s -> %s", started, len(keys), order.src, order.dst)

    def role(self) -> str:
        """This master's part: "leader" while it serves the pool, else "standby" (/health)."""
        e = self.ha.election if self.ha is not None else None
        if self.ha is None or (e is not None and e.is_leader):
            return "leader"
        return "standby"

    # -- housekeeping --
    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:
                log.exception("master housekeeping failed")

    def tick(self) -> None:
        now = time.monotonic()
        with self.lock:
            gone = self.registry.expire(now)
        for rec in gone:
            log.warning("node %s (%s) missed its heartbeats: marked down", rec.node_id, rec.role)
            self._drop_instance(rec.node_id)
        with self.lock:
            self._sync_instances()

    def _sync_instances(self) -> None:
        """Make the Conductor's instances the registry's schedulable nodes (lock held)."""
        leaders = self.registry.schedulable_leaders()
        decoders = self.registry.ready_decoders()
        pool = {
            r.node_id
            for r in self.registry.nodes.values()
            if r.state == "ready" and r.role in ("store", "prefill")
        }
        for name in sorted(leaders - self._instances):
            self.conductor.add_prefill_instance(name)
            self._instances.add(name)
            log.info("prefill group led by %s is schedulable", name)
        for name in sorted(decoders - self._instances):
            rec = self.registry.nodes[name]
            self.conductor.add_decode_instance(name, rec.info.kv_capacity_tokens or None)
            self._instances.add(name)
            log.info("decode node %s is schedulable", name)
        for name in sorted(pool - leaders - decoders):
            self.conductor.add_pool_node(name)
        for name in sorted(self._instances - leaders - decoders):
            self._instances.discard(name)
            self.conductor.remove_instance(name)

    def _mark_down(self, node_id: str) -> None:
        """A node did not take a call (timeout, refused connection): down now, not after
        its heartbeat TTL, so the request's next placement avoids it."""
        with self.lock:
            rec = self.registry.nodes.get(node_id)
            if rec is None or rec.state == "down":
                return
            # NOTE: a live node marked down by mistake learns it from its next heartbeat
            # and registers again within a second or two
            rec.state = "down"
        log.warning("node %s (%s) does not answer: marked down", node_id, rec.role)
        self._drop_instance(node_id)

    def _drop_instance(self, node_id: str) -> None:
        with self.lock:
            self._instances.discard(node_id)
            self.conductor.remove_instance(node_id)  # as a pool node too
            self._sync_instances()  # NOTE: also drops the leader of a group it was a stage of
        self.backend.on_node_down(node_id)

    # -- the status feed --
    async def status(self) -> Status:
        s, st = self.stats.snapshot(), self.store.stats()
        now = time.monotonic()
        # NOTE: the lock is taken on the Conductor's thread, never on the event loop
        rows = partial(node_statuses, self.registry, st.node_capacity_bytes, now)
        nodes = await self.backend.tickets.locked(rows)
        kv_rate = await self.backend.tickets.locked(self.backend.counters.kv_bytes_per_s, now)
        if self.ha is not None:
            masters = await asyncio.to_thread(self.ha.masters)
        else:
            masters = [
                MasterStatus(
                    id=self.config.node.id or "master",
                    is_leader=True,
                    address=host_port(self.config.cluster.master),
                    pid=os.getpid(),
                    api=self.api.url,
                )
            ]
        nodes.insert(
            0,
            NodeStatus(
                node_id="master",
                role="master",
                state="ready",
                address=host_port(self.config.cluster.master),
            ),
        )
        pool = pool_status(st)
        c = self.backend.counters
        sched = self.config.scheduler
        return Status(
            cluster=self.config.cluster.name,
            model=self.model_name,
            uptime_s=now - self.started,
            nodes=nodes,
            pool=pool,
            hit_rate=c.hits / c.lookups if c.lookups else 0.0,
            local_hit_rate=c.local_hits / c.lookups if c.lookups else 0.0,
            num_queued=s.num_waiting,
            num_running=s.num_streaming,
            ttft_slo_s=sched.ttft_slo_s,
            tbt_slo_s=sched.tbt_slo_s,
            transfer_bytes_per_s=kv_rate,
            pool_hits=c.hits,
            pool_lookups=c.lookups,
            num_waiting=c.waiting,
            num_waited=c.waited,
            num_waited_out=c.waited_out,
            kv_blocks=await self.backend.tickets.locked(self.backend.misses.shares),
            ttft_phases=self.backend.phases.summary(),
            masters=masters,
            num_pool_objects=st.num_committed,
            num_demotions=st.demotions,
            num_promotions=st.promotions,
            kv_events=self.kv_events.status() if self.kv_events else None,
            backends=await asyncio.to_thread(self.router.statuses) if self.router else [],
            **s.status_fields(),
        )

    # -- lifecycle --
    def take_control(self) -> None:
        """Serve the pool: rebuild it from the journal (if any), listen on the control
        plane, start housekeeping. At start, or (on etcd) once elected."""
        self.store.start()
        self._thread.start()
        if self.router is not None:
            self.router.start()

    def serve(self) -> None:
        """Serve until SIGINT/SIGTERM (uvicorn handles them in the main thread)."""
        if self.ha is None:
            self.take_control()
        else:
            self.ha.start(self.api.url)
        try:
            if self.metrics_server is not None:
                try:
                    self.metrics_server.start()
                except OSError as e:
                    raise ConfigError(
                        f"metrics: cannot listen on {self.metrics_server.url}: "
                        f"{e.strerror}; set metrics.port (0 = the API port)"
                    ) from e
            asyncio.run(self.api.serve(on_ready=self._ready))
        finally:
            sdnotify.notify_stopping()  # uvicorn took the signal; the master stops here
            if self.metrics_server is not None:
                self.metrics_server.stop()
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join()
            self.store.stop()
            if self.router is not None:
                self.router.stop()
            if self.kv_events is not None:
                self.kv_events.close()
            if self.ha is not None:  # NOTE: after the pool is no longer served: then resign
                self.ha.stop()

    def _ready(self) -> None:
        m = self.metrics_server.url if self.metrics_server else "/metrics on the API port"
        m = m if self.config.metrics.enabled else "off"
        rpc = f"tcp://{self.config.cluster.master}"  # NOTE: a standby listens once it leads
        log.info("master: API on %s, rpc %s, metrics %s", self.api.listening, rpc, m)
        report_ready(node_id="master", role="master", url=self.api.url, master=rpc)


def run_master(config: Config) -> None:
    Master(config).serve()

"""The prefill role: prefill prompts with prefix reuse from the pool, store new KV in the
pool layer by layer, and hand each request's KV to its decode node.

One task at a time, first come first served (the Conductor keeps the queue short and
knows its length). A node is one stage of a pipeline group; the master assigns groups on
registration. Stage 0 (the leader) receives tasks and drives the group; later stages
serve their upstream link. Per task on the leader:

    reuse+compute   PrefillRunner (alone, or `prefill_pipelined` through the group) over
                    prompt[:-1]: the decode node computes the last prompt token itself
    hand off        reserve blocks on the decode node, write the KV into them, submit
    report          started / finished / failed events to the master

A leader of a group of 2+ holds a link to stage 1 (`_keep_group`). When it breaks (stage
1 died, or stayed silent past `[prefill] stage_timeout_s` per chunk: stopped, or its
network dark), the leader reports "starting" at once, so the master stops placing on the
group, and only then reports the task it was running and those it holds as failed before
any KV reached a decode node (the master may place them again). It asks the master where
stage 1 listens now and dials it, backing off, until the restarted stage answers: then
it is ready again. A later stage serves one upstream link at a time; a new one (its
leader restarted, or dialled again) replaces it, and the requests the old one left half
done give their KV blocks back.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Literal

import msgspec

from mooncake.engine.kvhandoff import place_cache_in_segments
from mooncake.engine.pipeline import StageServer, prefill_pipelined
from mooncake.engine.prefill import PrefillRunner
from mooncake.engine.stagelink import StageListener, StageTimeoutError, TcpStageLink
from mooncake.errors import MooncakeError, TransferError
from mooncake.roles.common import MasterLink, NodeContext, install_signal_handlers, report_ready
from mooncake.roles.handoff import DecodeHandoff, DecodeUnreachable
from mooncake.roles.messages import (
    AckMsg,
    GroupMsg,
    GroupQueryMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    PrefillAbortMsg,
    PrefillEventMsg,
    PrefillStartMsg,
    PrefillStartReplyMsg,
    PrefillTaskMsg,
    TokenMsg,
    TokensMsg,
)
from mooncake.roles.worker import Worker, close_pool, connect_pool, load_worker, mount_local_tiers
from mooncake.rpc import RpcServer

log = logging.getLogger(__name__)


class GroupBroken(TransferError):
    """The leader has no working link to its next stage: the task goes back to the master."""


class PrefillNode:
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        cfg = ctx.config
        self.tasks: queue.Queue[PrefillTaskMsg | None] = queue.Queue()
        self.queued: set[int] = set()  # req ids in `tasks`
        self.aborted: set[int] = set()  # of those, the ones to skip
        self.busy = False
        self.server = RpcServer(f"tcp://{ctx.host}:0", ctx.secret, name="prefill", ports=ctx.ports)
        self.server.register(PrefillTaskMsg, self._on_task)
        self.server.register(PrefillAbortMsg, self._on_abort)
        self.server.start()
        self.store_node = mount_local_tiers(ctx)
        info = NodeInfoMsg(ctx.node_id, "prefill", self.server.address, ctx.gpu_names,
                           ctx.nic_names, device_memory_bytes=ctx.device_memory_bytes)  # fmt: skip
        self.link = MasterLink(ctx, info, self._load)
        reply = self.link.register()
        self.link.start()  # heartbeats (state "starting") while the model loads
        assert reply.group is not None, "the master assigns every prefill node a group"
        self.group: GroupMsg = reply.group
        layers = (self.group.first_layer, self.group.end_layer)
        self.worker: Worker = load_worker(ctx, cfg.prefill.kv_cache_bytes, layers)
        self.store, self.pool = connect_pool(ctx, self.worker, self.store_node)
        self.kv_prefix = f"{ctx.node_id}.kv."
        place_cache_in_segments(self.store.engine, self.worker.cache, self.kv_prefix)
        w = self.worker
        self.runner = PrefillRunner(
            w.model, w.cache, chunk_tokens=cfg.prefill.chunk_tokens, hasher=w.hasher,
            source=self.pool, sink=self.pool if self.group.stage == 0 else None,
            fingerprint=w.fingerprint,
        )  # fmt: skip
        self.next_link: TcpStageLink | None = None  # leader: the link to stage 1, if up
        self._formed = threading.Event()  # leader: set while it holds that link
        # NOTE: held while the master is told the group's state, so that a task reported
        # for re-placement reaches it after the leader left the schedulable set
        self._group_lock = threading.Lock()
        self.listener: StageListener | None = None
        if self.group.stage > 0:
            t = cfg.transfer
            self.listener = StageListener(
                ctx.secret,
                ctx.host,
                ctx.ports,
                handshake_timeout_s=t.handshake_timeout_s,
                max_handshakes_per_peer=t.max_handshakes_per_peer,
            )
            self.link.info = NodeInfoMsg(
                ctx.node_id, "prefill", self.server.address, ctx.gpu_names, ctx.nic_names,
                w.fingerprint.hex(), stage_address=f"{ctx.host}:{self.listener.port}",
            )  # fmt: skip
        else:
            self.link.info = NodeInfoMsg(
                ctx.node_id, "prefill", self.server.address, ctx.gpu_names, ctx.nic_names,
                w.fingerprint.hex(),
            )  # fmt: skip
        self.link.info = msgspec.structs.replace(
            self.link.info, group_id=self.group.group_id, stage=self.group.stage,
            group_size=self.group.group_size, device_memory_bytes=ctx.device_memory_bytes,
        )  # fmt: skip
        self.link.register()  # again, with what loading the model told us
        self.handoff = DecodeHandoff(self.store.engine, w.cache, self.kv_prefix, ctx.secret)

    # -- RPC handlers (server thread) --
    def _on_task(self, msg: PrefillTaskMsg, _peer: object) -> AckMsg:
        if self.group.stage != 0:
            raise MooncakeError(
                f"node {self.ctx.node_id} is stage {self.group.stage}, not a leader"
            )
        self.queued.add(msg.req_id)
        self.tasks.put(msg)
        return AckMsg()

    def _on_abort(self, msg: PrefillAbortMsg, _peer: object) -> AckMsg:
        if msg.req_id in self.queued:  # only a task still waiting can be skipped
            self.aborted.add(msg.req_id)
        return AckMsg()

    def _load(self) -> NodeLoadMsg:
        q = self.tasks.qsize()
        # NOTE: heartbeats begin while the model loads, before the pool (and its engine) is up
        store = getattr(self, "store", None)
        return NodeLoadMsg(
            num_queued=q,
            num_running=int(self.busy),
            load=float(self.busy),
            transfer_bytes=store.engine.bytes_by_transport() if store is not None else {},
        )

    # -- serving --
    def serve(self) -> None:
        """Serve until stopped; then drain the queue's current task, deregister, clean up."""
        is_leader = self.group.stage == 0 and self.group.group_size > 1
        if self.group.stage > 0:
            threading.Thread(target=self._serve_stage, name="stage-accept", daemon=True).start()
        if is_leader:  # ready once stage 1 answers
            threading.Thread(target=self._keep_group, name="stage-keeper", daemon=True).start()
        else:
            self.link.state = "ready"
        worker = threading.Thread(target=self._work, name="prefill-worker", daemon=True)
        worker.start()
        while is_leader and not (self._formed.is_set() or self.ctx.stop.is_set()):
            self._formed.wait(self.ctx.config.prefill.stage_retry_s)
        if not self.ctx.stop.is_set():
            self.link.beat()  # NOTE: the master knows it is ready before its ready line
            g = self.group
            report_ready(node_id=self.ctx.node_id, role="prefill", stage=g.stage, group=g.group_id)
        self.ctx.stop.wait()
        self.link.drain()  # queued tasks still run; nothing new is placed here
        self.tasks.put(None)
        worker.join(timeout=30)
        self.close()

    def _keep_group(self) -> None:
        """Leader of a group of 2+: hold a link to stage 1. Without one the group takes no
        requests; the leader asks the master where stage 1 listens now and dials it,
        pausing from a tenth of [prefill] stage_retry_s up to it between attempts."""
        retry_s = self.ctx.config.prefill.stage_retry_s
        gid, pause_s = self.group.group_id, 0.0
        while not self.ctx.stop.is_set():
            link = self.next_link
            if link is not None:
                if link.ended.wait(retry_s):  # NOTE: a timeout only looks at `stop` again
                    log.warning("pipeline group %s: the link to stage 1 broke", gid)
                    self._lose_next_link(link)
                continue
            try:
                link = self._dial_next()
            except MooncakeError as e:
                log.info("pipeline group %s: stage 1 does not answer yet: %s", gid, e)
            if link is not None:
                self._hold_next_link(link)
                pause_s = 0.0
                continue
            pause_s = min(retry_s, max(retry_s / 10, 2 * pause_s))
            self.ctx.stop.wait(pause_s)

    def _dial_next(self) -> TcpStageLink | None:
        """A link to stage 1 where the master says it listens now (None: not known yet)."""
        group = self.link.client.call(GroupQueryMsg(self.ctx.node_id), GroupMsg)
        if not group.next_stage_address:
            return None
        host, _, port = group.next_stage_address.rpartition(":")
        timeout_s = self.ctx.config.transfer.handshake_timeout_s
        link = TcpStageLink.connect(host, int(port), self.ctx.secret, timeout_s)
        log.info("pipeline group %s: stage 1 at %s", group.group_id, group.next_stage_address)
        return link

    def _hold_next_link(self, link: TcpStageLink) -> None:
        with self._group_lock:
            self.next_link = link
            self._formed.set()
            self._tell_master("ready")

    def _lose_next_link(self, link: TcpStageLink | None) -> None:
        """`link` broke: not ready until another is up. Returns once the master knows (for
        None, once a report under way is done), so that tasks reported after this call
        are placed elsewhere."""
        with self._group_lock:
            if link is None or self.next_link is not link:
                return  # already reported, or a new link is up
            self.next_link = None
            self._formed.clear()
            self._tell_master("starting")
        link.abort()

    def _tell_master(self, state: Literal["ready", "starting"]) -> None:
        if self.link.state in ("ready", "starting"):  # NOTE: never undoes draining or failed
            self.link.state = state
            self.link.beat()  # at once, not at the next heartbeat

    def _serve_stage(self) -> None:
        """Stage > 0: serve the upstream link. A new authenticated link (the leader came
        back, or dialled again after its link broke) replaces the one being served."""
        assert self.listener is not None
        serving: tuple[TcpStageLink, threading.Thread] | None = None
        while True:
            try:
                upstream = self.listener.accept()
            except OSError:  # the listener closed: stopping
                break
            if serving is not None:
                old, thread = serving
                if thread.is_alive():
                    log.info("a new link from the leader replaces the one being served")
                old.abort()
                thread.join()
            server = StageServer(self.runner, upstream)
            thread = threading.Thread(target=server.serve, name="stage", daemon=True)
            thread.start()
            serving = (upstream, thread)
        if serving is not None:
            serving[0].abort()

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            self.queued.discard(task.req_id)
            if task.req_id in self.aborted:
                self.aborted.discard(task.req_id)
                continue
            self.busy = True
            try:
                self._run(task)
            except DecodeUnreachable as e:  # the master marks it down, places the task again
                log.warning("req %d: %s", task.req_id, e)
                self._event(task.req_id, "failed", error=str(e), unreachable_address=e.address)
                self._fail_to_client(task.req_id, f"prefill node {self.ctx.node_id}: {e}")
            except GroupBroken as e:  # NOTE: the master now knows the group is not ready
                log.warning("req %d: %s", task.req_id, e)
                self._event(task.req_id, "failed", error=str(e))
                self._fail_to_client(task.req_id, f"prefill node {self.ctx.node_id}: {e}")
            except Exception as e:  # a failed request never stops the node
                log.exception("req %d failed", task.req_id)
                self._event(task.req_id, "failed", error=str(e))
                self._fail_to_client(task.req_id, f"prefill failed on {self.ctx.node_id}: {e}")
            finally:
                self.busy = False

    def _admit(self, task: PrefillTaskMsg) -> PrefillTaskMsg | None:
        """Ask the master whether the task still runs and where its KV goes now; None =
        skip it. An unreachable master keeps the task as it was placed."""
        try:
            reply = self.link.client.call(
                PrefillStartMsg(task.req_id, self.ctx.node_id), PrefillStartReplyMsg
            )
        except MooncakeError as e:
            log.warning("req %d: admission check failed, running it as placed: %s",
                        task.req_id, e)  # fmt: skip
            return task
        if not reply.is_accepted:
            log.info("req %d: not prefilled (%s)", task.req_id, reply.reason)
            return None
        # NOTE: a decode node restarted under its id answers at a new address
        moved = (reply.decode_node, reply.decode_address) != (task.decode_node, task.decode_address)
        if reply.decode_node and moved:
            return msgspec.structs.replace(
                task, decode_node=reply.decode_node, decode_address=reply.decode_address
            )
        return task

    def _run(self, task: PrefillTaskMsg) -> None:
        link = self.next_link
        is_piped = self.group.group_size > 1 and len(task.prompt_ids) > 1
        if is_piped and (link is None or link.ended.is_set()):
            self._lose_next_link(link)
            raise GroupBroken(f"pipeline group {self.group.group_id} has lost its stage 1")
        admitted = self._admit(task)
        if admitted is None:
            return
        task = admitted
        log.debug("req %d: prefill of %d tokens", task.req_id, len(task.prompt_ids))
        prompt = task.prompt_ids[:-1]
        kw: dict[str, Any] = {}
        if task.max_reuse_blocks >= 0:
            kw["max_reuse_blocks"] = task.max_reuse_blocks
        if len(prompt) == 0:
            result = None  # one-token prompt: the decode node computes it
        elif link is not None:
            timeout_s = self.ctx.config.prefill.stage_timeout_s
            try:
                result = prefill_pipelined(
                    self.runner,
                    prompt,
                    link,
                    req_id=task.req_id,
                    store_remote_kv=True,
                    stage_timeout_s=timeout_s,
                    **kw,
                )
            except TransferError as e:
                # NOTE: a stage that went silent (stopped, its network dark) never closes
                # the link: past its deadline it counts as broken, as a closed one does
                if link.ended.is_set() or isinstance(e, StageTimeoutError):
                    self._lose_next_link(link)
                    raise GroupBroken(f"the link to stage 1 broke: {e}") from e
                raise
        else:
            result = self.runner.prefill(prompt, req_id=task.req_id, **kw)
        try:
            kv_bytes = self.handoff.send(task, result, len(prompt))
        finally:
            if result is not None:
                self.worker.cache.free(result.block_ids)
        stats = result.stats if result is not None else None
        self._event(task.req_id, "finished",
                    num_reused_tokens=stats.num_reused_tokens if stats else 0,
                    num_stored_blocks=stats.num_stored_blocks if stats else 0,
                    kv_bytes=kv_bytes)  # fmt: skip

    def _event(self, req_id: int, phase: str, **kw: object) -> None:
        msg = PrefillEventMsg(req_id, self.ctx.node_id, phase, **kw)  # type: ignore[arg-type]
        try:
            self.link.client.send_event(msg)
        except MooncakeError as e:
            log.warning("req %d: could not tell the master (%s): %s", req_id, phase, e)

    def _fail_to_client(self, req_id: int, error: str) -> None:
        end = TokenMsg(req_id, -1, "", finish_reason="abort", error=error)
        try:
            self.link.client.send_event(TokensMsg(self.ctx.node_id, [end]))
        except MooncakeError as e:
            log.warning("req %d: could not report its failure: %s", req_id, e)

    def close(self) -> None:
        self.link.deregister()
        if self.next_link is not None:  # NOTE: a stopped stage 1 must not hold up our exit
            self.next_link.close(self.ctx.config.prefill.stage_timeout_s)
        if self.listener is not None:
            self.listener.close()
        self.server.stop()
        self.handoff.close()
        close_pool(self.store, self.pool, self.store_node)


def run_prefill(ctx: NodeContext) -> None:
    install_signal_handlers(ctx.stop)
    PrefillNode(ctx).serve()


__all__ = ["PrefillNode", "run_prefill"]

"""The master's serving backend: every request's way through the cluster.

    match+place   hash the prompt's blocks; the Conductor picks a prefill group and a
                  decode node, or rejects (HTTP 429 before any work is done)
    dispatch      send the prefill task to the group's leader
    stream        the decode node's tokens arrive (RPC thread) and go to the request's
                  asyncio queue; the first one is the TTFT
    end           finished, failed or cancelled: the Conductor's load is released

Node failures: a request whose prefill or decode node went down is placed again under a
new request id (so late outputs of the dead placement are dropped): before its first token
it is prefilled again; while decoding, its prompt and the tokens already streamed are
prefilled again (mostly pool hits) and decoding goes on for the tokens still owed. When no
node can take it, it waits up to `scheduler.node_wait_s` for one (a restarted node),
then ends with an error naming why. A new request that finds no node ready waits the same.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from mooncake.api.backend import BaseBackend, GenerateRequest, Output, Rejected
from mooncake.conductor import Conductor
from mooncake.conductor.types import (
    Decision,
    PrefillAdmission,
    ReplicationOrder,
    ScheduleRequest,
)
from mooncake.engine.tokenizer import BaseTokenizer
from mooncake.errors import ApiError, MooncakeError, SchedulingError
from mooncake.hashing import PrefixHasher
from mooncake.roles.cluster_metrics import PoolCounters
from mooncake.roles.flight import Flight
from mooncake.roles.messages import (
    AckMsg,
    DecodeAbortMsg,
    PrefillAbortMsg,
    PrefillTaskMsg,
    TokenMsg,
)
from mooncake.roles.registry import Registry
from mooncake.roles.timeline import PhaseLog
from mooncake.rpc import AsyncRpcClient

log = logging.getLogger(__name__)


class NoInstance(MooncakeError):
    """No prefill group or no decode node can take a request now."""


class ClusterBackend(BaseBackend):
    def __init__(
        self,
        conductor: Conductor,
        registry: Registry,
        tokenizer: BaseTokenizer,
        model_name: str,
        max_model_len: int,
        secret: bytes,
        block_tokens: int,
        lock: threading.Lock,
    ):
        self.conductor, self.registry, self.tokenizer = conductor, registry, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.secret, self.block_tokens, self.lock = secret, block_tokens, lock
        self.hasher: PrefixHasher | None = None  # set once a node tells the KV fingerprint
        self.loop: asyncio.AbstractEventLoop | None = None
        self.flights: dict[int, Flight] = {}
        self.counters = PoolCounters()
        self.phases = PhaseLog()  # where each request's TTFT went
        self.max_retries = 2
        self.node_wait_s = 60.0  # [scheduler] node_wait_s
        self.node_poll_s = 0.25  # seconds between attempts to place a waiting request
        # NOTE: ids never repeat across master restarts (nodes outlive the master)
        self._ids = itertools.count(time.time_ns() // 1000)
        self.on_unreachable: Callable[[str], None] = lambda _node: None  # the master marks it down
        # hot-spot replication orders of the Conductor, for the Store to carry out
        self.on_replicate: Callable[[ReplicationOrder], None] = lambda _order: None
        self._clients: dict[str, AsyncRpcClient] = {}
        self._tasks: set[asyncio.Future[None]] = set()  # re-placements under way

    # -- the API's entry point --
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        self.loop = asyncio.get_running_loop()
        if self.hasher is None:
            raise MooncakeError("no prefill or decode node has joined yet; retry shortly")
        rid = next(self._ids)
        hashes = self.hasher.hash_blocks(req.prompt_ids)
        decision = await self._place_waiting(rid, len(req.prompt_ids), hashes)
        flight = Flight(rid, req, hashes, asyncio.Queue(), decision)
        self.counters.add_lookup(len(hashes), decision.best_blocks, decision.local_blocks)
        self.flights[rid] = flight
        log.debug("req %d: %d tokens -> %s", rid, len(req.prompt_ids), decision)
        try:
            await self._dispatch_retrying(flight)
        except BaseException:
            self._end(flight, dropped=True)
            raise
        first = True
        try:
            while True:
                tok = await flight.queue.get()
                if tok.kind == "dispatch_again":  # placed again: send the task there
                    await self._dispatch_retrying(flight)
                    continue
                if tok.kind == "rejected" and first:  # before any output: a 429
                    self._end(flight, dropped=True)
                    raise Rejected(tok.error, retry_after_s=2.0)
                if flight.phase != "decoding":  # the first token of this placement
                    self._on_first_token(flight)
                if tok.token_id >= 0:
                    flight.output_ids.append(tok.token_id)
                out = Output(token_id=tok.token_id, text=tok.text, logprob=tok.logprob,
                             top_logprobs=tok.top_logprobs, finish_reason=tok.finish_reason,
                             error=tok.error,
                             num_cached_tokens=flight.num_cached_tokens if first else 0,
                             )  # fmt: skip
                first = False
                if tok.finish_reason is not None:
                    # NOTE: ended before the last yield: a consumer that stops at the last
                    # output must not turn a finished request into an abort
                    self._end(flight, dropped=tok.finish_reason == "abort")
                    yield out
                    return
                yield out
        finally:
            if not flight.done:  # the client went away (or the loop is closing)
                await self._abort_remote(flight)
                self._end(flight, dropped=True)

    def _place(self, rid: int, n: int, hashes: list[int]) -> Decision:
        with self.lock:
            try:
                d = self.conductor.schedule(ScheduleRequest(rid, n, hashes), time.monotonic())
            except SchedulingError as e:
                raise MooncakeError(f"cannot place the request: {e}") from e
        for order in d.replications:
            self.on_replicate(order)
        if not d.is_accepted:
            if d.reason == "no_instance":
                with self.lock:
                    missing = self.registry.missing() or "ready nodes are not scheduled yet"
                raise NoInstance(f"{missing}; retry shortly")
            raise Rejected(f"the cluster is overloaded ({d.reason}); retry later",
                           retry_after_s=2.0)  # fmt: skip
        return d

    async def _place_waiting(self, rid: int, n: int, hashes: list[int]) -> Decision:
        """Place a new request, waiting up to node_wait_s while no node can take it."""
        deadline = time.monotonic() + self.node_wait_s
        while True:
            try:
                return self._place(rid, n, hashes)
            except NoInstance:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(self.node_poll_s)

    async def _dispatch_retrying(self, flight: Flight) -> None:
        """Send the task; a leader that does not answer is reported down and the request
        is placed again (up to max_retries times)."""
        for attempt in range(self.max_retries + 1):
            target = flight.decision  # NOTE: a node failure may re-place it while we wait
            try:
                await self._dispatch(flight)
                return
            except MooncakeError as e:
                node = target.prefill
                log.warning("req %d: prefill node %s did not take it (%s)", flight.req_id, node, e)
                self.on_unreachable(node)
                if flight.decision is not target or flight.is_replacing:
                    return  # placed again meanwhile; that placement dispatches it
                if attempt == self.max_retries:
                    raise
                if not await self._place_again(flight):
                    return  # its end is queued

    async def _dispatch(self, flight: Flight) -> None:
        d = flight.decision
        leader, decoder = self.registry.nodes.get(d.prefill), self.registry.nodes.get(d.decode)
        if leader is None or decoder is None:
            raise MooncakeError(f"node {d.prefill if leader is None else d.decode} left")
        # NOTE: the index lags the pool by a tick; a limit only where the Conductor chose to
        # recompute blocks it knows are held (Algorithm 1's balancing rule)
        limit = d.reused_blocks if d.reused_blocks < d.best_blocks else -1
        task = PrefillTaskMsg(flight.req_id, flight.task_prompt, flight.task_params, d.decode,
                              decoder.info.rpc_address, limit)  # fmt: skip
        await self._client(leader.info.rpc_address).call(task, AckMsg, timeout_s=5.0)
        log.debug("req %d: %s took it", flight.req_id, d.prefill)

    def _on_first_token(self, flight: Flight) -> None:
        flight.phase = "decoding"
        with self.lock:
            self.conductor.on_decode_started(flight.req_id, time.monotonic())
        if flight.num_placements == 1:  # NOTE: only a first placement's moments are whole
            self.phases.record(flight.moments, time.monotonic())

    def _end(self, flight: Flight, dropped: bool) -> None:
        if flight.done:
            return
        flight.done = True
        self.flights.pop(flight.req_id, None)
        with self.lock:
            now = time.monotonic()
            if dropped:
                self.conductor.on_request_dropped(flight.req_id, now)
            else:
                self.conductor.on_decode_finished(flight.req_id, now)

    async def _abort_remote(self, flight: Flight) -> None:
        d = flight.decision
        writer = self.registry.nodes.get(d.prefill)
        is_down = writer is None or writer.state == "down"  # NOTE: it streams no more KV
        aborts = (
            (d.prefill, PrefillAbortMsg(flight.req_id)),
            (d.decode, DecodeAbortMsg(flight.req_id, is_writer_down=is_down)),
        )
        for node_id, msg in aborts:
            rec = self.registry.nodes.get(node_id)
            if rec is None or rec.state == "down":
                continue
            try:
                await self._client(rec.info.rpc_address).call(msg, AckMsg, timeout_s=1.0)
            except MooncakeError as e:
                log.info("req %d: abort on %s not confirmed: %s", flight.req_id, node_id, e)

    def _client(self, address: str) -> AsyncRpcClient:
        if address not in self._clients:
            self._clients[address] = AsyncRpcClient(address, self.secret, timeout_s=5.0)
        return self._clients[address]

    # -- events from nodes (RPC server thread) --
    def deliver(self, node_id: str, tokens: list[TokenMsg]) -> None:
        """Route outputs to their requests' queues (thread-safe). A failure reported by a
        node the request was moved away from is stale and dropped."""
        loop = self.loop
        if loop is None:
            return
        for tok in tokens:
            flight = self.flights.get(tok.req_id)
            if flight is None:
                continue  # ended, or placed again under a new id
            d = flight.decision
            # NOTE: outputs come from the decode node; failures from either node
            senders = (d.prefill, d.decode) if tok.finish_reason == "abort" else (d.decode,)
            if node_id not in senders:
                continue
            if tok.finish_reason == "abort" and node_id == d.prefill and flight.phase != "decoding":
                # its prefill (or the hand-off to decode) failed: try another placement
                loop.call_soon_threadsafe(self._replace, flight, node_id, tok)
            else:
                loop.call_soon_threadsafe(flight.queue.put_nowait, tok)

    def on_prefill_admission(self, req_id: int, adm: PrefillAdmission) -> None:
        """The Conductor's decision at prefill start (RPC thread): follow a moved decode
        node, or tell the client its request was rejected before any work."""
        flight, loop = self.flights.get(req_id), self.loop
        if flight is None or loop is None:
            return
        if adm.is_accepted:
            flight.phase = "prefilling"
            flight.moments.started = flight.moments.started or time.monotonic()
            if adm.decode and adm.decode != flight.decision.decode:
                flight.decision = msgspec.structs.replace(flight.decision, decode=adm.decode)
            return
        if adm.reason != "unknown_request":
            # NOTE: after some output (a resumed request) it ends the stream as an abort
            why = f"the cluster is overloaded ({adm.reason})"
            end = TokenMsg(req_id, -1, "", finish_reason="abort", error=why, kind="rejected")
            loop.call_soon_threadsafe(flight.queue.put_nowait, end)

    def on_prefill_finished(self, req_id: int, reused: int, kv_bytes: int) -> None:
        """A prefill node computed the request and handed its KV to decode (RPC thread);
        the start was recorded by `on_prefill_admission`."""
        now = time.monotonic()
        with self.lock:
            self.conductor.on_prefill_finished(req_id, now)
            self.counters.add_kv(now, kv_bytes)
        flight = self.flights.get(req_id)
        if flight is not None:
            flight.num_cached_tokens = reused
            flight.moments.prefilled = now

    def on_node_down(self, node_id: str) -> None:
        """Place again every request the dead node was working on, except those already
        decoding elsewhere (thread-safe: called from the master's housekeeping thread)."""
        loop = self.loop
        if loop is None:
            return
        for flight in list(self.flights.values()):
            d = flight.decision
            if d.decode == node_id or (d.prefill == node_id and flight.phase != "decoding"):
                loop.call_soon_threadsafe(self._replace, flight, node_id)

    def _replace(self, flight: Flight, node_id: str, failure: TokenMsg | None = None) -> None:
        """On the loop: place the request again, then tell its generator to dispatch.
        `failure`: the prefill node's report that ended this placement."""
        if flight.done or flight.is_replacing:
            return
        if node_id not in (flight.decision.prefill, flight.decision.decode):
            return  # already moved away from the dead node
        if failure is not None:
            flight.last_error = failure.error
            if flight.num_placements > self.max_retries:
                flight.queue.put_nowait(failure)  # it failed on every node tried
                return

        async def replace() -> None:
            if await self._place_again(flight) and not flight.done:
                flight.queue.put_nowait(TokenMsg(flight.req_id, -1, "", kind="dispatch_again"))

        task = asyncio.ensure_future(replace())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _place_again(self, flight: Flight) -> bool:
        """Give the request a new id and a new placement, waiting up to node_wait_s for a
        node to take it; False when it ended meanwhile or none took it (or it was moved too
        often: then its end, with the error, is queued)."""
        flight.is_replacing = True
        try:
            await self._abort_remote(flight)  # NOTE: a live node stops work nobody awaits
            old = flight.req_id
            self.flights.pop(old, None)
            with self.lock:
                self.conductor.on_request_dropped(old, time.monotonic())
            flight.req_id = next(self._ids)
            self.flights[flight.req_id] = flight
            flight.phase = "queued"
            flight.num_placements += 1
            if flight.num_placements > self.max_retries + 2:
                why = f"; the last failure: {flight.last_error}" if flight.last_error else ""
                raise MooncakeError(f"it was placed {flight.num_placements - 1} times{why}")
            deadline = time.monotonic() + self.node_wait_s
            while True:
                try:
                    flight.decision = self._replacement(flight)
                    break
                except (MooncakeError, ApiError) as e:
                    if flight.done:
                        return False
                    if time.monotonic() >= deadline:
                        raise MooncakeError(
                            f"no node took it within {self.node_wait_s:.0f} s: {e}"
                        ) from e
                    await asyncio.sleep(self.node_poll_s)
            d = flight.decision
            log.info(
                "req %d (was %d) placed again on %s, %s", flight.req_id, old, d.prefill, d.decode
            )
            return True
        except (MooncakeError, ApiError) as e:
            end = TokenMsg(
                flight.req_id, -1, "", finish_reason="abort", error=f"could not place it again: {e}"
            )
            flight.queue.put_nowait(end)
            return False
        finally:
            flight.is_replacing = False

    def _replacement(self, flight: Flight) -> Decision:
        prompt = flight.task_prompt
        assert self.hasher is not None
        hashes = flight.block_hashes
        if flight.output_ids:
            hashes = self.hasher.hash_blocks(prompt)
        return self._place(flight.req_id, len(prompt), hashes)

    async def health(self) -> dict[str, object]:
        """ok while a prefill group and a decode node can take requests; raises
        MooncakeError naming what is missing otherwise."""
        with self.lock:
            leaders = self.registry.schedulable_leaders()
            decoders = self.registry.ready_decoders()
            missing = self.registry.missing()
        if missing:
            raise MooncakeError(missing)
        return {
            "status": "ok",
            "num_prefill_groups": len(leaders),
            "num_decode_nodes": len(decoders),
            "num_running": len(self.flights),
        }

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()

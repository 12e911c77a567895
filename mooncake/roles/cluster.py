"""The master's serving backend: every request's way through the cluster.

    match+place   hash the prompt's blocks; the Conductor picks a prefill group and a
                  decode node, or rejects (HTTP 429 before any work is done)
    dispatch      send the prefill task to the group's leader
    stream        the decode node's tokens arrive (RPC thread) and go to the request's
                  asyncio queue; the first one is the TTFT
    end           finished, failed or cancelled: the Conductor's load is released

Node failures: requests waiting on a prefill node that went down are placed again; those
on a decode node that went down end with an error naming it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

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
from mooncake.roles.messages import (
    AckMsg,
    DecodeAbortMsg,
    PrefillAbortMsg,
    PrefillTaskMsg,
    TokenMsg,
)
from mooncake.roles.registry import Registry
from mooncake.rpc import AsyncRpcClient

log = logging.getLogger(__name__)
REJECTED = "rejected: "  # error prefix of a request the Conductor refused at prefill start


@dataclass
class Flight:
    """A request in the cluster."""

    req_id: int
    gen: GenerateRequest
    block_hashes: list[int]  # the prompt's, hashed once (placing again reuses them)
    queue: asyncio.Queue[TokenMsg]
    decision: Decision
    phase: str = "queued"  # queued (at prefill) | prefilling | decoding
    num_cached_tokens: int = 0
    done: bool = False


@dataclass
class PoolCounters:
    lookups: int = 0  # prompt blocks looked up
    hits: int = 0  # of those, held anywhere in the pool
    local_hits: int = 0  # held by the chosen prefill node itself
    kv_bytes: int = 0  # KV handed from prefill to decode nodes
    kv_window: deque[tuple[float, int]] = field(default_factory=deque)  # (time, bytes)

    def add_kv(self, now: float, num_bytes: int) -> None:
        self.kv_bytes += num_bytes
        self.kv_window.append((now, num_bytes))

    def kv_bytes_per_s(self, now: float, window_s: float = 10.0) -> float:
        """KV handed off over the last `window_s` seconds, per second (drops older ones)."""
        while self.kv_window and self.kv_window[0][0] < now - window_s:
            self.kv_window.popleft()
        return sum(b for _, b in self.kv_window) / window_s


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
        self.max_retries = 2
        # NOTE: ids never repeat across master restarts (nodes outlive the master)
        self._ids = itertools.count(time.time_ns() // 1000)
        self.on_unreachable: Callable[[str], None] = lambda _node: None  # the master marks it down
        # hot-spot replication orders of the Conductor, for the Store to carry out
        self.on_replicate: Callable[[ReplicationOrder], None] = lambda _order: None
        self._clients: dict[str, AsyncRpcClient] = {}

    # -- the API's entry point --
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        self.loop = asyncio.get_running_loop()
        if self.hasher is None:
            raise MooncakeError("no prefill or decode node has joined yet; retry shortly")
        rid = next(self._ids)
        hashes = self.hasher.hash_blocks(req.prompt_ids)
        decision = self._place(rid, len(req.prompt_ids), hashes)
        flight = Flight(rid, req, hashes, asyncio.Queue(), decision)
        c = self.counters
        c.lookups += len(hashes)
        c.hits += flight.decision.best_blocks
        c.local_hits += flight.decision.local_blocks
        self.flights[rid] = flight
        d = flight.decision
        log.debug("req %d: %d tokens -> prefill %s, decode %s, reuse %d of %d blocks",
                  rid, len(req.prompt_ids), d.prefill, d.decode, d.reused_blocks,
                  len(hashes))  # fmt: skip
        try:
            await self._dispatch_retrying(flight)
        except BaseException:
            self._end(flight, dropped=True)
            raise
        first = True
        try:
            while True:
                tok = await flight.queue.get()
                if tok.req_id == -1:  # a re-placement asked us to send the task again
                    await self._dispatch_retrying(flight)
                    continue
                if first and tok.error.startswith(REJECTED):  # before any output: a 429
                    self._end(flight, dropped=True)
                    raise Rejected(tok.error.removeprefix(REJECTED), retry_after_s=2.0)
                if first:
                    self._on_first_token(flight)
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
                raise MooncakeError("no prefill group or decode node is ready; retry shortly")
            raise Rejected(f"the cluster is overloaded ({d.reason}); retry later",
                           retry_after_s=2.0)  # fmt: skip
        return d

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
                if flight.decision is not target:
                    return  # placed again meanwhile; that placement dispatches it
                if attempt == self.max_retries:
                    raise
                with self.lock:
                    self.conductor.on_request_dropped(flight.req_id, time.monotonic())
                flight.decision = self._replacement(flight)

    async def _dispatch(self, flight: Flight) -> None:
        d = flight.decision
        leader, decoder = self.registry.nodes.get(d.prefill), self.registry.nodes.get(d.decode)
        if leader is None or decoder is None:
            raise MooncakeError(f"node {d.prefill if leader is None else d.decode} left")
        g = flight.gen
        # NOTE: the index lags the pool by a tick; a limit only where the Conductor chose to
        # recompute blocks it knows are held (Algorithm 1's balancing rule)
        limit = d.reused_blocks if d.reused_blocks < d.best_blocks else -1
        task = PrefillTaskMsg(flight.req_id, g.prompt_ids, g.params, d.decode,
                              decoder.info.rpc_address, limit)  # fmt: skip
        await self._client(leader.info.rpc_address).call(task, AckMsg, timeout_s=5.0)
        log.debug("req %d: %s took it", flight.req_id, d.prefill)

    def _on_first_token(self, flight: Flight) -> None:
        flight.phase = "decoding"
        with self.lock:
            self.conductor.on_decode_started(flight.req_id, time.monotonic())

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
        for node_id, msg in ((d.prefill, PrefillAbortMsg(flight.req_id)),
                             (d.decode, DecodeAbortMsg(flight.req_id))):  # fmt: skip
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
            d = flight.decision if flight is not None else None
            if (
                d is not None
                and tok.finish_reason == "abort"
                and node_id not in (d.prefill, d.decode)
            ):
                continue
            if flight is not None:
                loop.call_soon_threadsafe(flight.queue.put_nowait, tok)

    def on_prefill_admission(self, req_id: int, adm: PrefillAdmission) -> None:
        """The Conductor's decision at prefill start (RPC thread): follow a moved decode
        node, or tell the client its request was rejected before any work."""
        flight, loop = self.flights.get(req_id), self.loop
        if flight is None or loop is None:
            return
        if adm.is_accepted:
            flight.phase = "prefilling"
            if adm.decode and adm.decode != flight.decision.decode:
                flight.decision = msgspec.structs.replace(flight.decision, decode=adm.decode)
            return
        if adm.reason != "unknown_request":
            end = TokenMsg(req_id, -1, "", finish_reason="abort",
                           error=f"{REJECTED}the cluster is overloaded ({adm.reason})")  # fmt: skip
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

    def on_node_down(self, node_id: str) -> None:
        """Re-place requests still queued on a dead prefill group; fail those whose decode
        node died (thread-safe: called from the master's housekeeping thread)."""
        loop = self.loop
        if loop is None:
            return
        for flight in list(self.flights.values()):
            d = flight.decision
            if node_id not in (d.prefill, d.decode):
                continue
            if flight.phase != "decoding":  # its KV is not on a decode node yet: redo it
                loop.call_soon_threadsafe(self._replace, flight, node_id)
            elif d.decode == node_id:
                end = TokenMsg(flight.req_id, -1, "", finish_reason="abort",
                               error=f"decode node {node_id} failed while generating")  # fmt: skip
                loop.call_soon_threadsafe(flight.queue.put_nowait, end)

    def _replace(self, flight: Flight, node_id: str) -> None:
        """On the loop: schedule the request again and tell its generator to dispatch."""
        if flight.done or node_id not in (flight.decision.prefill, flight.decision.decode):
            return  # finished, or already moved away from the dead node
        with self.lock:
            self.conductor.on_request_dropped(flight.req_id, time.monotonic())
        try:
            flight.decision = self._replacement(flight)
            log.info("req %d placed again on %s", flight.req_id, flight.decision.prefill)
            flight.queue.put_nowait(TokenMsg(-1, -1, ""))
        except (MooncakeError, ApiError) as e:
            flight.queue.put_nowait(TokenMsg(flight.req_id, -1, "", finish_reason="abort",
                                             error=f"could not place it again: {e}"))  # fmt: skip

    def _replacement(self, flight: Flight) -> Decision:
        return self._place(flight.req_id, len(flight.gen.prompt_ids), flight.block_hashes)

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()

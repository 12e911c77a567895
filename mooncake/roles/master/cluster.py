"""The master's serving backend: every request's way through the cluster.

    check         a request no ready node's KV cache holds even alone is refused (400)
    match+place   hash the prompt's blocks; the Conductor picks a prefill group and a
                  decode node, or rejects (HTTP 429 before any work is done; one refused
                  for the queue alone waits up to `scheduler.defer_s` for an idle group)
    dispatch      send the prefill task to the group's leader
    stream        the decode node's tokens arrive (RPC thread) and go to the request's
                  asyncio queue; the first one is the TTFT
    end           finished, failed, cancelled or past its deadline: the Conductor's
                  ticket is closed and the nodes drop what they still hold of it

Token streams: each decode node numbers a request's token events; the master hands them
on in order, each once, and acknowledges them (roles/node/delivery.py). Every request has a
deadline from its arrival (`request_deadline_s`): past it the HTTP request ends with an
error naming where it was, never a hang. The Conductor is reached through `Tickets`
(roles/master/tickets.py), so the event loop never waits on the master's lock.

Node failures: a request whose prefill or decode node went down is placed again under a
new request id (so late outputs of the dead placement are dropped): before its first token
it is prefilled again; while decoding, its prompt and the tokens already streamed are
prefilled again (mostly pool hits) and decoding goes on for the tokens still owed. When no
node can take it, it waits up to `scheduler.node_wait_s` for one (a restarted node),
then ends with an error naming why. A new request that finds no node ready waits the same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from mooncake.api.backend import BaseBackend, GenerateRequest, Output, Rejected
from mooncake.conductor import Conductor
from mooncake.conductor.types import Decision, PrefillAdmission, ReplicationOrder
from mooncake.config.settings import Config
from mooncake.errors import ApiError, MooncakeError
from mooncake.kv.hashing import PrefixHasher
from mooncake.model.tokenizer import BaseTokenizer
from mooncake.roles.master.attribution import Attribution
from mooncake.roles.master.flight import Flight, Flights, request_deadline_s
from mooncake.roles.master.metrics import PoolCounters
from mooncake.roles.master.nodecalls import NodeCalls
from mooncake.roles.master.registry import Registry
from mooncake.roles.master.tickets import NoInstance, Tickets, place_waiting
from mooncake.roles.master.timeline import PhaseLog
from mooncake.roles.node.messages import PrefillEventMsg, TokenMsg, TokensAckMsg, TokensMsg

log = logging.getLogger(__name__)
__all__ = ["ClusterBackend", "NoInstance"]


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
        self.tickets = Tickets(conductor, registry, lock)
        self.hasher: PrefixHasher | None = None  # set once a node tells the KV fingerprint
        self.loop: asyncio.AbstractEventLoop | None = None
        self.flights = Flights()
        self.counters = PoolCounters()
        self.misses = Attribution(conductor.index, block_tokens)  # why prefills missed
        self.phases = PhaseLog()  # where each request's TTFT went
        self.max_retries = 2
        self.calls = NodeCalls(registry, secret)
        self.configure(Config())
        self.on_unreachable: Callable[[str], None] = lambda _node: None  # the master marks it down
        self._tasks: set[asyncio.Future[None]] = set()  # re-placements under way

    def configure(self, config: Config) -> None:
        """Take the scheduler's waits and deadlines and the cluster's call timeouts."""
        self.scheduler = config.scheduler
        self.node_wait_s = config.scheduler.node_wait_s
        self.misses.configure(config.scheduler.miss_memory_blocks)
        self.calls.configure(config.cluster)

    @property
    def on_replicate(self) -> Callable[[ReplicationOrder], None]:
        """Where the Conductor's hot-spot replication orders go (the Store)."""
        return self.tickets.on_replicate

    @on_replicate.setter
    def on_replicate(self, fn: Callable[[ReplicationOrder], None]) -> None:
        self.tickets.on_replicate = fn

    # -- the API's entry point --
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        self.loop = asyncio.get_running_loop()
        if self.hasher is None:
            raise MooncakeError("no prefill or decode node has joined yet; retry shortly")
        await self.tickets.locked(
            self._check_kv_room, len(req.prompt_ids), req.params.max_tokens, req.params.n
        )
        deadline_s = request_deadline_s(self.scheduler, req.params.max_tokens)
        ends_at = time.monotonic() + deadline_s
        rid = self.flights.new_id()
        hashes = self.hasher.hash_blocks(req.prompt_ids)
        decision = await self._place_waiting(rid, len(req.prompt_ids), hashes, ends_at)
        flight = Flight(rid, req, hashes, asyncio.Queue(), decision, ends_at=ends_at)
        self.counters.add_lookup(len(hashes), decision.best_blocks, decision.local_blocks)
        self.flights[rid] = flight
        log.debug("req %d: %d tokens -> %s", rid, len(req.prompt_ids), decision)
        first, tok = True, TokenMsg(rid, None, "", kind="dispatch_again")
        try:
            while True:
                try:
                    async with asyncio.timeout(max(0.0, ends_at - time.monotonic())):
                        if tok.kind == "dispatch_again":  # (placed again:) send the task
                            await self._dispatch_retrying(flight)
                        tok = await flight.queue.get()
                except TimeoutError:
                    why = f"no end within its deadline of {deadline_s:.1f} s ({flight.where})"
                    log.warning("req %d: %s", flight.req_id, why)
                    self._end(flight, dropped=True, abort=True)
                    yield Output(token_id=None, text="", finish_reason="abort", error=why)
                    return
                except BaseException:
                    self._end(flight, dropped=True, abort=True)
                    raise
                if tok.kind == "dispatch_again":
                    continue
                if tok.kind == "rejected" and first:  # before any output: a 429
                    self._end(flight, dropped=True)
                    raise Rejected(tok.error, retry_after_s=2.0)
                if flight.phase != "decoding":  # the first token of this placement
                    flight.phase = "decoding"
                    self.tickets.decode_started(flight.req_id)
                    if flight.num_placements == 1:  # NOTE: only a first one's moments are whole
                        self.phases.first_token(flight.moments, time.monotonic())
                if tok.ends_request and tok.finish_reason != "abort":
                    # NOTE: the stream ends once its new blocks are committed to the pool (the
                    # prefill node reports after that): an immediate repeat reuses them
                    await flight.wait_reported(self.scheduler.commit_wait_s)
                if tok.token_id is not None:
                    flight.output_ids.append(tok.token_id)
                out = flight.output(tok)
                first = False
                if tok.ends_request:
                    # NOTE: ended before the last yield: a consumer that stops at the last
                    # output must not turn a finished request into an abort. An abort of
                    # one choice ends the others too
                    is_abort = tok.finish_reason == "abort"
                    self._end(flight, dropped=is_abort, abort=is_abort and tok.more_choices)
                    yield out
                    return
                yield out
        finally:
            # NOTE: no await here: a client gone cancels every await (anyio's cancel scope)
            if not flight.done:  # the client went away (or the loop is closing)
                self._end(flight, dropped=True, abort=True)

    def _check_kv_room(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Refuse (ApiError, HTTP 400) a request no ready node's KV cache could hold even
        alone: its prompt on a prefill group, its prompt and the output of its `n` choices
        (which share the prompt's KV) on a decode node."""
        choices = f" x n {n}" if n > 1 else ""
        limits = [
            ("prefill", prompt_len, f"prompt of {prompt_len} tokens"),
            (
                "decode",
                prompt_len + n * max_tokens,
                f"prompt of {prompt_len} tokens (+ max_tokens {max_tokens}{choices})",
            ),
        ]
        for role, num_tokens, what in limits:
            limit = self.registry.kv_capacity_tokens(role)
            if limit is not None and num_tokens > limit:
                raise ApiError(
                    f"{what} exceeds the KV cache of the {role} nodes: at most {limit} tokens "
                    f"({role}.kv_cache_bytes); shorten the request or give the nodes more"
                )

    async def _place(self, rid: int, n: int, hashes: list[int], waited: bool = False) -> Decision:
        d = await self.tickets.place(rid, n, hashes, waited)
        self.misses.placed(rid, n, hashes, d)
        return d

    async def _place_waiting(self, rid: int, n: int, hashes: list[int], ends_at: float) -> Decision:
        """Place a new request, waiting for a node and for an idle group (`place_waiting`)."""
        place = functools.partial(self._place, rid, n, hashes)
        end_wait = functools.partial(self.tickets.end_wait, rid)
        return await place_waiting(
            place, self.scheduler, self.node_wait_s, self.counters, ends_at, end_wait
        )

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
                await self.tickets.call(self.on_unreachable, node)  # NOTE: takes the lock
                if flight.decision is not target or flight.is_replacing:
                    return  # placed again meanwhile; that placement dispatches it
                if attempt == self.max_retries:
                    raise
                if not await self._place_again(flight):
                    return  # its end is queued

    async def _dispatch(self, flight: Flight) -> None:
        await self.calls.send_task(flight)

    async def _abort_remote(self, flight: Flight) -> None:
        await self.calls.abort(flight)

    def _end(self, flight: Flight, dropped: bool, abort: bool = False) -> None:
        """The request ends: it leaves the flights (late events of it are refused) and
        its Conductor ticket closes; `abort`: its nodes are told to drop it (a task of its
        own: whatever cancels the caller, the ticket is closed first)."""
        if not self.flights.end(flight):
            return
        self.misses.forget(flight.req_id)
        self.tickets.close(flight.req_id, dropped)
        if abort:
            task = asyncio.ensure_future(self._abort_remote(flight))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- events from nodes (RPC server thread) --
    def receive_tokens(self, msg: TokensMsg) -> TokensAckMsg:
        """A decode node's token events: each request's go to its queue in seq order, each
        once; the answer acknowledges them (roles/master/flight.py `Flights.receive`)."""
        ready, acks = self.flights.receive(msg.node_id, msg.tokens)
        loop = self.loop
        if ready and loop is not None:
            loop.call_soon_threadsafe(self._queue_tokens, ready)
        return TokensAckMsg(acks)

    def _queue_tokens(self, ready: list[tuple[Flight, TokenMsg]]) -> None:
        for flight, tok in ready:
            if not flight.done and flight.req_id == tok.req_id:  # NOTE: not placed again since
                flight.queue.put_nowait(tok)

    def on_prefill_failed(self, req_id: int, node_id: str, error: str) -> None:
        """The request's prefill (or its hand-off to decode) failed on `node_id` (RPC
        thread): before its first token it is placed again; else it ends with the error. A
        report from a node the request was moved away from is stale and dropped."""
        flight, loop = self.flights.get(req_id), self.loop
        if flight is None or loop is None or flight.decision.prefill != node_id:
            return
        end = TokenMsg(req_id, None, "", finish_reason="abort", error=error)
        if flight.phase != "decoding":
            loop.call_soon_threadsafe(self._replace, flight, node_id, end)
        else:
            loop.call_soon_threadsafe(self._queue_tokens, [(flight, end)])

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
            end = TokenMsg(req_id, None, "", finish_reason="abort", error=why, kind="rejected")
            loop.call_soon_threadsafe(self._queue_tokens, [(flight, end)])

    def on_prefill_finished(self, msg: PrefillEventMsg) -> None:
        """A prefill node computed the request, handed its KV to decode and committed its
        new blocks to the pool (RPC thread); the start was recorded by
        `on_prefill_admission`. Its blocks get their causes (roles/master/attribution.py)."""
        now, req_id = time.monotonic(), msg.req_id
        with self.lock:
            self.conductor.on_prefill_finished(req_id, now)
            self.counters.add_kv(now, msg.kv_bytes)
            is_unverified = msg.num_rejected_blocks > 0
            counts = self.misses.finished(req_id, msg.num_reused_tokens, is_unverified, now)
        flight, loop = self.flights.get(req_id), self.loop
        if flight is not None:
            flight.num_cached_tokens, flight.is_handed_off = msg.num_reused_tokens, True
            flight.kv_blocks = counts
            if flight.num_placements == 1:
                self.phases.handed_off(flight.moments, now - msg.seal_s)
            if loop is not None:
                loop.call_soon_threadsafe(flight.reported.set)

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
            elif d.prefill == node_id:  # decoding on: no report will come from it
                loop.call_soon_threadsafe(flight.reported.set)

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
                flight.queue.put_nowait(TokenMsg(flight.req_id, None, "", kind="dispatch_again"))

        task = asyncio.ensure_future(replace())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _place_again(self, flight: Flight) -> bool:
        """Give the request a new id and a new placement, waiting up to node_wait_s
        (within its deadline) for a node to take it; False when it ended meanwhile or none
        took it (or it was moved too often: then its end, with the error, is queued).

        NOTE: the request may end (its client left, its deadline passed) at any await
        here: from then on every ticket this opens is closed again at once."""
        flight.is_replacing = True
        try:
            await self._abort_remote(flight)  # NOTE: a live node stops work nobody awaits
            if flight.done:
                return False
            old = self.flights.move(flight)
            self.misses.forget(old)
            self.tickets.close(old, dropped=True)
            flight.phase, flight.is_handed_off = "queued", False
            flight.reported.clear()
            flight.num_placements += 1
            if flight.gen.params.n > 1 and flight.output_ids:
                raise MooncakeError(
                    f"its {flight.gen.params.n} choices had begun their output, and several "
                    "choices cannot resume on another node; send the request again"
                )
            if flight.num_placements > self.max_retries + 2:
                why = f"; the last failure: {flight.last_error}" if flight.last_error else ""
                raise MooncakeError(f"it was placed {flight.num_placements - 1} times{why}")
            give_up = min(time.monotonic() + self.node_wait_s, flight.ends_at)
            while True:
                try:
                    decision = await self._replacement(flight)
                except (MooncakeError, ApiError) as e:
                    if flight.done:
                        return False
                    if time.monotonic() >= give_up:
                        raise MooncakeError(
                            f"no node took it within {self.node_wait_s:.0f} s: {e}"
                        ) from e
                    await asyncio.sleep(self.scheduler.node_poll_s)
                    continue
                if flight.done:  # ended while it was placed: that ticket closes at once
                    self.tickets.close(flight.req_id, dropped=True)
                    return False
                flight.decision = decision
                break
            d = flight.decision
            log.info(
                "req %d (was %d) placed again on %s, %s", flight.req_id, old, d.prefill, d.decode
            )
            return True
        except (MooncakeError, ApiError) as e:
            why = f"could not place it again: {e}"
            flight.queue.put_nowait(
                TokenMsg(flight.req_id, None, "", finish_reason="abort", error=why)
            )
            return False
        finally:
            flight.is_replacing = False

    async def _replacement(self, flight: Flight) -> Decision:
        prompt = flight.task_prompt
        assert self.hasher is not None
        hashes = self.hasher.hash_blocks(prompt) if flight.output_ids else flight.block_hashes
        return await self._place(flight.req_id, len(prompt), hashes)

    async def health(self) -> dict[str, object]:
        """ok while a prefill group and a decode node can take requests, else MooncakeError
        naming what is missing. `num_tickets`: the Conductor's open tickets (one a request)."""
        leaders, decoders, missing = await self.tickets.locked(self._health_facts)
        if missing:
            raise MooncakeError(missing)
        return {
            "status": "ok",
            "num_prefill_groups": len(leaders),
            "num_decode_nodes": len(decoders),
            "num_running": len(self.flights),
            "num_tickets": await self.tickets.num_open(),
        }

    def _health_facts(self) -> tuple[set[str], set[str], str]:
        r = self.registry
        return r.schedulable_leaders(), r.ready_decoders(), r.missing()

    async def close(self) -> None:
        await self.calls.close()
        self.tickets.shutdown()

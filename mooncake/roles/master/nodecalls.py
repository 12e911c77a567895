"""The master's calls to the nodes for one request: send its prefill task to its group's
leader, and abort it on its prefill and decode nodes (best effort, within
`[cluster] notice_timeout_s`). One asyncio RPC client per node address."""

from __future__ import annotations

import logging

from mooncake.config.settings import ClusterConfig
from mooncake.errors import MooncakeError
from mooncake.roles.master.flight import Flight
from mooncake.roles.master.registry import Registry
from mooncake.roles.node.messages import AckMsg, DecodeAbortMsg, PrefillAbortMsg, PrefillTaskMsg
from mooncake.rpc import AsyncRpcClient

log = logging.getLogger(__name__)


class NodeCalls:
    """Calls from the event loop to the nodes a request is placed on."""

    def __init__(self, registry: Registry, secret: bytes):
        self.registry, self.secret = registry, secret
        self._clients: dict[str, AsyncRpcClient] = {}
        self.configure(ClusterConfig())

    def configure(self, cluster: ClusterConfig) -> None:
        self.call_timeout_s = cluster.call_timeout_s
        self.notice_timeout_s = cluster.notice_timeout_s

    async def send_task(self, flight: Flight) -> None:
        """Send the request's prefill task to its group's leader; raises MooncakeError when
        a node left or the leader did not take it."""
        d = flight.decision
        leader, decoder = self.registry.nodes.get(d.prefill), self.registry.nodes.get(d.decode)
        if leader is None or decoder is None:
            raise MooncakeError(f"node {d.prefill if leader is None else d.decode} left")
        # NOTE: the index lags the pool by a tick; a limit only where the Conductor chose to
        # recompute blocks it knows are held (Algorithm 1's balancing rule)
        limit = d.reused_blocks if d.reused_blocks < d.best_blocks else None
        task = PrefillTaskMsg(
            flight.req_id,
            flight.task_prompt,
            flight.task_params,
            d.decode,
            decoder.info.rpc_address,
            limit,
            num_resumed=len(flight.output_ids),
        )
        client = self._client(leader.info.rpc_address)
        await client.call(task, AckMsg, timeout_s=self.call_timeout_s)
        log.debug("req %d: %s took it", flight.req_id, d.prefill)

    async def abort(self, flight: Flight) -> None:
        """Tell its prefill and decode nodes to drop the request (a queued task is skipped,
        reserved KV blocks are freed, a decoding request stops)."""
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
                client = self._client(rec.info.rpc_address)
                await client.call(msg, AckMsg, timeout_s=self.notice_timeout_s)
            except MooncakeError as e:
                log.info("req %d: abort on %s not confirmed: %s", flight.req_id, node_id, e)

    def _client(self, address: str) -> AsyncRpcClient:
        if address not in self._clients:
            self._clients[address] = AsyncRpcClient(
                address, self.secret, timeout_s=self.call_timeout_s
            )
        return self._clients[address]

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()

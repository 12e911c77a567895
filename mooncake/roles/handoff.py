"""The prefill side of a request's KV hand-off to its decode node.

    reserve   ask the decode node for blocks (retrying while it has no room)
    write     one-sided writes of the KV into those blocks (engine/kvhandoff.py)
    submit    the request joins the decode node's queue

A decode node that does not answer raises `DecodeUnreachable` with the address it was
placed at, so the master can tell a dead node (mark it down, place its requests again)
from one that was merely full.
"""

from __future__ import annotations

import logging
import time

from mooncake.engine.kvcache import PagedKVCache
from mooncake.engine.kvhandoff import send_kv
from mooncake.engine.prefill import PrefillResult
from mooncake.errors import RpcTimeout, TransferError
from mooncake.roles.messages import (
    AckMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
    DecodeSubmitMsg,
    PrefillTaskMsg,
)
from mooncake.rpc import RpcClient
from mooncake.transfer import TransferEngine

log = logging.getLogger(__name__)
RESERVE_TIMEOUT_S = 30.0  # seconds to wait for room on the decode node
CALL_TIMEOUT_S = 10.0  # seconds a decode node may take to answer one call


class DecodeUnreachable(TransferError):
    """The decode node a task was placed on did not answer a call."""

    def __init__(self, node_id: str, address: str, cause: Exception):
        super().__init__(f"decode node {node_id} at {address} does not answer: {cause}")
        self.node_id, self.address = node_id, address


class DecodeHandoff:
    """Hands KV from this prefill node's cache to decode nodes; one RPC client per decode
    address. Not thread-safe: the prefill worker thread is its only caller."""

    def __init__(self, engine: TransferEngine, cache: PagedKVCache, kv_prefix: str, secret: bytes):
        self.engine, self.cache, self.kv_prefix, self.secret = engine, cache, kv_prefix, secret
        self._clients: dict[str, RpcClient] = {}

    def send(self, task: PrefillTaskMsg, result: PrefillResult | None, n: int) -> int:
        """Reserve, write the first `n` tokens' KV of `result`, submit; returns the bytes
        written. Raises DecodeUnreachable, or TransferError when no room came in time."""
        try:
            return self._send(task, result, n)
        except RpcTimeout as e:
            raise DecodeUnreachable(task.decode_node, task.decode_address, e) from e

    def _send(self, task: PrefillTaskMsg, result: PrefillResult | None, n: int) -> int:
        client = self._client(task.decode_address)
        reply = DecodeReserveReplyMsg([])
        deadline = time.monotonic() + RESERVE_TIMEOUT_S
        while n > 0:
            reply = client.call(DecodeReserveMsg(task.req_id, n), DecodeReserveReplyMsg)
            if reply.block_ids:
                break
            if time.monotonic() > deadline:
                raise TransferError(
                    f"decode node {task.decode_node} had no room for {n} tokens of KV "
                    f"within {RESERVE_TIMEOUT_S} s"
                )
            time.sleep(0.02)
        sent = 0
        if n > 0:
            assert result is not None
            try:
                sent = send_kv(
                    self.engine,
                    self.cache,
                    self.kv_prefix,
                    result.block_ids,
                    n,
                    reply.segment_prefix,
                    reply.endpoint,
                    reply.block_ids,
                    result.remote_kv,
                )
            except BaseException:
                client.call(DecodeReleaseMsg(task.req_id), AckMsg)
                raise
        log.debug("req %d: %d bytes of KV written to %s", task.req_id, sent, task.decode_node)
        submit = DecodeSubmitMsg(
            task.req_id, task.prompt_ids, task.params, list(reply.block_ids), n
        )
        client.call(submit, AckMsg)
        return sent

    def _client(self, address: str) -> RpcClient:
        if address not in self._clients:
            self._clients[address] = RpcClient(address, self.secret, timeout_s=CALL_TIMEOUT_S)
        return self._clients[address]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()

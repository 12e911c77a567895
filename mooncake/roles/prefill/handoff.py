"""The prefill side of a request's KV hand-off to its decode node.

    reserve   before the prefill starts, ask the decode node for blocks (retrying while
              it has no room, up to [prefill] reserve_timeout_s)
    stream    every stage writes its layers' KV into those blocks as they finish
              (kv/stream.py)
    submit    with the tokens written per layer: the request joins the decode node's
              queue (the node checks every layer landed)
    release   on any failure, the blocks go back

A decode node that does not answer raises `DecodeUnreachable` with the address it was
placed at, so the master can tell a dead node (mark it down, place its requests again)
from one that was merely full.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TypeVar

from mooncake.config.roles import PrefillConfig
from mooncake.errors import MooncakeError, RpcTimeout, TransferError
from mooncake.kv.stream import KVDest
from mooncake.roles.node.messages import (
    AckMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
    DecodeSubmitMsg,
    PrefillTaskMsg,
)
from mooncake.rpc import RpcClient
from mooncake.rpc.wire import Msg

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Msg)


@dataclass(frozen=True)
class DecodeTarget:
    """The decode node a request's KV goes to, at the RPC address it answers at."""

    node: str
    address: str

    @classmethod
    def placed(cls, task: PrefillTaskMsg) -> DecodeTarget:
        """Where the master placed `task` (its admission may move it: roles/prefill/role.py)."""
        return cls(task.decode_node, task.decode_address)


class DecodeUnreachable(TransferError):
    """The decode node a task was placed on did not answer a call."""

    def __init__(self, node_id: str, address: str, cause: Exception):
        super().__init__(f"decode node {node_id} at {address} does not answer: {cause}")
        self.node_id, self.address = node_id, address


class DecodeHandoff:
    """Reserves blocks on decode nodes and submits requests to them; one RPC client per
    decode node, of the address its latest task named. The KV itself streams into the
    blocks during the prefill (kv/stream.py). Any thread may call it (the worker
    reserves, the completer submits). Each call names its `DecodeTarget`, the one the
    task holds (roles/prefill/flow.py `TaskInFlight.decode`).

    A decode node restarted under its id answers at a new address: its client of the old
    one is closed once no call is in flight on it, so that a node restarted again and
    again leaves no sockets (each reconnecting to a dead address) behind."""

    def __init__(self, secret: bytes, settings: PrefillConfig):
        """`settings`: reserve_timeout_s, reserve_poll_s, decode_call_timeout_s."""
        self.secret, self.settings = secret, settings
        self._clients: dict[str, RpcClient] = {}  # decode node id -> client
        self._calls: dict[RpcClient, int] = {}  # client -> calls in flight on it
        self._lock = threading.Lock()  # guards both

    def reserve(self, req_id: int, to: DecodeTarget, n: int) -> KVDest:
        """Blocks for `n` tokens of request `req_id`'s KV on decode node `to`, waiting while
        it has no room. Raises DecodeUnreachable, or TransferError when no room came in time."""
        deadline = time.monotonic() + self.settings.reserve_timeout_s
        msg = DecodeReserveMsg(req_id, n)
        while not (reply := self._call(to, msg, DecodeReserveReplyMsg)).block_ids:
            if time.monotonic() > deadline:
                raise TransferError(
                    f"decode node {to.node} had no room for {n} tokens of KV within "
                    f"{self.settings.reserve_timeout_s:g} s ([prefill] reserve_timeout_s)"
                )
            time.sleep(self.settings.reserve_poll_s)
        return KVDest(
            endpoint=reply.endpoint,
            prefix=reply.segment_prefix,
            ranks=reply.tensor_parallel,
            block_ids=list(reply.block_ids),
            num_tokens=n,
        )

    def submit(
        self, task: PrefillTaskMsg, to: DecodeTarget, dest: KVDest | None, layer_tokens: list[int]
    ) -> None:
        """The KV is in place (`layer_tokens` per layer): the request joins the queue of
        decode node `to`. None: a one-token prompt, computed by the decode node itself."""
        blocks = list(dest.block_ids) if dest is not None else []
        n = dest.num_tokens if dest is not None else 0
        msg = DecodeSubmitMsg(
            task.req_id,
            task.prompt_ids,
            task.params,
            blocks,
            n,
            layer_tokens,
            num_resumed=task.num_resumed,
        )
        self._call(to, msg, AckMsg)

    def release(self, req_id: int, to: DecodeTarget) -> None:
        """Give back a reservation that will not be submitted (best effort: the decode
        node frees it after decode.reserve_ttl_s anyway)."""
        try:
            self._call(to, DecodeReleaseMsg(req_id), AckMsg)
        except MooncakeError as e:
            log.warning("req %d: could not release its KV blocks on %s: %s", req_id, to.node, e)

    def _call(self, to: DecodeTarget, msg: Msg, reply_type: type[R]) -> R:
        client = self._take(to)
        try:
            return client.call(msg, reply_type)
        except RpcTimeout as e:
            raise DecodeUnreachable(to.node, to.address, e) from e
        finally:
            self._give_back(client)

    def _take(self, to: DecodeTarget) -> RpcClient:
        """The client of decode node `to` at its address, with a call counted."""
        with self._lock:
            client = self._clients.get(to.node)
            if client is None or client.address != to.address:
                if client is not None:
                    self._retire(client)
                timeout_s = self.settings.decode_call_timeout_s
                client = RpcClient(to.address, self.secret, timeout_s=timeout_s)
                self._clients[to.node] = client
            self._calls[client] = self._calls.get(client, 0) + 1
            return client

    def _give_back(self, client: RpcClient) -> None:
        with self._lock:
            if client in self._calls:  # NOTE: not after close()
                self._calls[client] -= 1
            if client not in self._clients.values():
                self._retire(client)

    def _retire(self, client: RpcClient) -> None:
        """Close a client no task will get again, once its last call returned; the caller
        holds the lock."""
        if self._calls.get(client, 0) == 0:
            self._calls.pop(client, None)
            client.close()

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
            self._calls.clear()

"""The cluster's control-plane messages (`node.*`, `prefill.*`, `decode.*`, `master.*`).

Nodes register with the master and heartbeat; the master sends prefill tasks to prefill
group leaders; a prefill node reserves blocks on a decode node, writes the request's KV
into them (Transfer Engine) and submits the request; decode nodes send tokens back to the
master, numbered and acknowledged (roles/node/delivery.py). The Store's own messages
(`store.*`) share the master's endpoint.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from mooncake.model.params import SamplingParams
from mooncake.rpc.wire import Msg

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Addr = Annotated[str, Meta(max_length=300)]  # "tcp://host:port" or "host:port"
TokenIds = Annotated[list[int], Meta(max_length=1 << 22)]
BlockIds = Annotated[list[int], Meta(max_length=1 << 20)]
NodeRole = Literal["prefill", "decode", "store"]


class NodeInfoMsg(Msg, frozen=True, tag="node.info"):
    """What a node is: sent inside a registration."""

    node_id: Name
    role: NodeRole
    rpc_address: Addr  # where the node serves its own RPC ("" for a store node)
    gpus: list[str] = []
    nics: list[str] = []
    model_fingerprint: str = ""  # hex; prefill/decode nodes must match the master's
    # tokens its KV cache holds (a prefill stage: of its layers); 0 = not told (yet)
    kv_capacity_tokens: Annotated[int, Meta(ge=0)] = 0
    max_batch: int = 0  # decode: most requests per step
    stage_address: Addr = ""  # prefill stage > 0: host:port its upstream stage dials
    device_memory_bytes: int = 0  # memory of the device the model runs on (GPU, else RAM)
    group_id: str = ""  # prefill: the group it already serves in ("" = not placed yet)
    stage: int = -1  # prefill: its stage in that group (its layers are loaded)
    group_size: int = 0  # prefill: stages in that group
    incarnation: str = ""  # random per node process: a new one = the node restarted
    data_address: Addr = ""  # host:port of its Transfer Engine's data plane ("" = none)


class RegisterMsg(Msg, frozen=True, tag="node.register"):
    info: NodeInfoMsg


class GroupMsg(Msg, frozen=True, tag="node.group"):
    """A prefill node's place in its pipeline group (layers [first_layer, end_layer))."""

    group_id: str
    stage: int  # 0 = the leader the master sends tasks to
    group_size: int
    first_layer: int
    end_layer: int
    next_stage_address: str = ""  # host:port of stage+1 ("" on the last stage / not yet known)


class RegisterReplyMsg(Msg, frozen=True, tag="node.register_reply"):
    is_accepted: bool
    message: str = ""  # why not
    group: GroupMsg | None = None  # prefill nodes only
    block_tokens: int = 0
    ttft_slo_s: float = 0.0
    tbt_slo_s: float = 0.0


class GroupQueryMsg(Msg, frozen=True, tag="node.group_query"):
    node_id: Name


class NodeLoadMsg(Msg, frozen=True, tag="node.load"):
    """A node's load, sent with each heartbeat."""

    num_queued: int = 0
    num_running: int = 0
    load: float = 0.0  # 0..1
    context_tokens: int = 0  # decode: tokens of KV held by running requests
    num_reserved: int = 0  # decode: requests whose KV blocks are reserved, not yet submitted
    transfer_bytes: dict[str, int] = {}  # transport (shm, tcp, rdma) -> bytes it moved


class NodeHeartbeatMsg(Msg, frozen=True, tag="node.heartbeat"):
    node_id: Name
    load: NodeLoadMsg = NodeLoadMsg()
    state: Literal["starting", "ready", "draining", "failed"] = "ready"  # failed: its loop died


class NodeHeartbeatReplyMsg(Msg, frozen=True, tag="node.heartbeat_reply"):
    is_known: bool  # False: the master restarted or expired us; register again


class DeregisterMsg(Msg, frozen=True, tag="node.deregister"):
    node_id: Name


class AckMsg(Msg, frozen=True, tag="node.ack"):
    pass


# -- a request's way through the cluster --------------------------------------------------


class PrefillTaskMsg(Msg, frozen=True, tag="prefill.task"):
    """Master -> prefill leader: prefill `prompt_ids[:-1]`, hand the KV to `decode_node`."""

    req_id: int
    prompt_ids: TokenIds
    params: SamplingParams
    decode_node: Name
    decode_address: Addr  # the decode node's RPC address
    max_reuse_blocks: int | None = None  # the Conductor's choice of reused blocks (None: any)
    # the last this many of prompt_ids are output streamed before the request was placed
    # again (a guided request's grammar replays them on its new decode node)
    num_resumed: int = 0


class PrefillAbortMsg(Msg, frozen=True, tag="prefill.abort"):
    req_id: int


class PrefillStartMsg(Msg, frozen=True, tag="master.prefill_start"):
    """Prefill leader -> master, just before a task's prefill starts: still admitted, and
    to which decode node does its KV go? (the Conductor's second, later decision, §7.4)"""

    req_id: int
    node_id: Name


class PrefillStartReplyMsg(Msg, frozen=True, tag="master.prefill_start_reply"):
    is_accepted: bool  # False: skip it (rejected now, or no longer wanted)
    decode_node: str = ""  # where its KV goes ("" = as the task said)
    decode_address: str = ""
    reason: str = ""


class PrefillEventMsg(Msg, frozen=True, tag="master.prefill_event"):
    """Prefill node -> master (a call, answered by AckMsg): a task finished (its KV is with
    the decode node) or failed (`error` says why; the master places it again or ends it)."""

    req_id: int
    node_id: Name
    phase: Literal["finished", "failed"]  # the start is asked for: PrefillStartMsg
    num_reused_tokens: int = 0
    num_stored_blocks: int = 0
    num_rejected_blocks: int = 0  # pool blocks found by hash whose check failed
    kv_bytes: int = 0  # bytes handed to the decode node
    seal_s: float = 0.0  # s from the hand-off to decode to this report (the pool's seal)
    error: str = ""
    unreachable_address: str = ""  # failed: the decode node at this RPC address did not answer


class DecodeReserveMsg(Msg, frozen=True, tag="decode.reserve"):
    """Prefill -> decode: blocks for `num_tokens` tokens of KV of request `req_id`."""

    req_id: int
    num_tokens: int


class DecodeReserveReplyMsg(Msg, frozen=True, tag="decode.reserve_reply"):
    block_ids: BlockIds  # [] = no room now; try again
    segment_prefix: str = ""  # layer l's K is segment f"{prefix}k{l}", V f"{prefix}v{l}"
    endpoint: str = ""  # host:port of the decode node's transfer server
    # the decode instance's tensor-parallel degree: rank r's segments are under
    # kv/handoff.py rank_prefix(segment_prefix, r, tensor_parallel)
    tensor_parallel: int = 1


class DecodeSubmitMsg(Msg, frozen=True, tag="decode.submit"):
    """Prefill -> decode: the KV of prompt_ids[:-1] is in `block_ids`; decode from there
    (once `layer_tokens` shows every layer landed)."""

    req_id: int
    prompt_ids: TokenIds
    params: SamplingParams
    block_ids: BlockIds
    num_cached_tokens: int
    # layer -> tokens of KV written into `block_ids` (every stage's stream reports): the
    # decode node starts only when each of its model's layers holds all num_cached_tokens
    layer_tokens: list[int] = []
    num_resumed: int = 0  # as PrefillTaskMsg's


class DecodeReleaseMsg(Msg, frozen=True, tag="decode.release"):
    """Prefill -> decode: give back a reservation that will not be submitted."""

    req_id: int


class DecodeAbortMsg(Msg, frozen=True, tag="decode.abort"):
    req_id: int
    # the prefill node streaming its KV is down: its reserved blocks may be freed at once
    # (else they are freed when that node submits or releases them)
    is_writer_down: bool = False


class TokenMsg(Msg, frozen=True, tag="master.token"):
    """One output step of one request (see `api.backend.Output`), or (`kind`) what else
    the master queues for a request itself."""

    req_id: int
    token_id: int | None  # None: no token, the message only ends the request
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    error: str = ""
    seq: int = 0  # "output": its number in the request's stream from its decode node (0, 1..)
    # "output": a node's step (nodes send only these). The master's own: "dispatch_again"
    # (the request was placed again: send its task to the new nodes), "rejected" (the
    # Conductor refused it at prefill start: an HTTP 429 before any output; `error` says why)
    kind: Literal["output", "dispatch_again", "rejected"] = "output"
    index: int = 0  # "output": the choice of a request of several (SamplingParams.n)
    # "output" with a finish_reason other than abort: other choices of the request go on
    # (the stream ends at a finish without it, or at any abort)
    more_choices: bool = False

    @property
    def ends_request(self) -> bool:
        """Whether nothing of the request follows this event."""
        return self.finish_reason == "abort" or (
            self.finish_reason is not None and not self.more_choices
        )


class TokensMsg(Msg, frozen=True, tag="master.tokens"):
    """Decode -> master: token events (of one step, or sent again), each numbered by
    `seq` within its request; answered by TokensAckMsg (see roles/node/delivery.py)."""

    node_id: Name
    tokens: list[TokenMsg]


class TokenAck(msgspec.Struct, frozen=True):
    """The master's cumulative acknowledgement of one request's token events."""

    req_id: int
    next_seq: int  # every event below this seq arrived (the decode node forgets them)
    is_known: bool = True  # False: the master no longer tracks the request: stop it


class TokensAckMsg(Msg, frozen=True, tag="master.tokens_ack"):
    acks: list[TokenAck]

"""What every node process shares: identity, the cluster secret, readiness, signals, and
the link to the master (registration, heartbeats, re-registration after a master restart).

A node reports ready with one JSON line on stdout (`{"ready": true, ...}`), printed once it
serves and the master accepted it; `mooncake up --local` waits for that line, never sleeps.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from mooncake.config.portrange import PortRange, node_ports
from mooncake.config.settings import ClusterConfig, Config
from mooncake.errors import ConfigError, MooncakeError
from mooncake.ha.election import find_masters
from mooncake.ha.etcdaccess import create_etcd
from mooncake.ha.sealed import Sealer
from mooncake.hw.topology import NicPreference, Topology, detect_topology
from mooncake.native import cudamap
from mooncake.native.nvml import GpuInfo
from mooncake.roles.node import sdnotify
from mooncake.roles.node.messages import (
    AckMsg,
    DeregisterMsg,
    NodeHeartbeatMsg,
    NodeHeartbeatReplyMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    RegisterMsg,
    RegisterReplyMsg,
)
from mooncake.rpc import RpcClient

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0  # seconds between a node's heartbeats
NODE_TTL_S = 5.0  # seconds without a heartbeat before the master marks a node down


@dataclass
class NodeContext:
    """A node's settings and runtime facts (never written back into config)."""

    config: Config
    node_id: str
    host: str  # address peers reach this node at
    secret: bytes
    topology: Topology
    stop: threading.Event = field(default_factory=threading.Event)
    master_wait_s: float = 60.0  # how long a starting node waits for its master to answer
    masters: tuple[str, ...] = ()  # host:port of every master; () = the config's

    @property
    def master_rpc(self) -> str:
        """The masters' RPC addresses, comma-separated (only the leader listens)."""
        masters = self.masters or self.config.cluster.master_addresses
        return ",".join(f"tcp://{m}" for m in masters)

    @property
    def ports(self) -> PortRange:
        """Where every listener of this node binds ([node] port_range)."""
        return node_ports(self.config)

    @property
    def gpu_names(self) -> list[str]:
        return [f"{g.name} {g.memory_total_bytes >> 30}GiB" for g in self.topology.gpus]

    @property
    def device_memory_bytes(self) -> int:
        """Memory of the device the model runs on: torch's cuda:0 (NVML's figure, else
        CUDA's when NVML does not report it), else this host's RAM."""
        gpu = self.gpu("cuda:0")
        if gpu is not None:
            return gpu.memory_total_bytes
        return cudamap.torch_memory_bytes() or self.topology.memory_total_bytes

    @functools.cached_property
    def visible_gpus(self) -> list[GpuInfo]:
        """The GPUs torch sees, element i being cuda:i (native/cudamap.py)."""
        return cudamap.visible_gpus(self.topology.gpus, torch_uuids=cudamap.torch_uuids())

    def gpu(self, device: str) -> GpuInfo | None:
        """The physical GPU (NVML's facts) behind torch device `device`; None for cpu."""
        return cudamap.gpu_of(device, self.visible_gpus)

    @property
    def arena_location(self) -> str | None:
        """ "cpu:N" for this node's host arenas: the NUMA node of the GPU torch uses, else
        the node with the most usable NICs; None when neither is known."""
        gpu = self.gpu("cuda:0")
        if gpu is not None and gpu.numa_node is not None:
            return f"cpu:{gpu.numa_node}"
        usable = set(self.topology.usable_nic_names)
        nodes = [
            n.numa_node for n in self.topology.nics if n.name in usable and n.numa_node is not None
        ]
        return f"cpu:{max(sorted(set(nodes)), key=nodes.count)}" if nodes else None

    @property
    def nic_preference(self) -> dict[str, NicPreference]:
        """The topology's NIC preference keyed as this process's tensors are ("cuda:i" is
        torch's device i), for its Transfer Engines."""
        return cudamap.torch_keyed(self.topology.nic_preference, self.visible_gpus)

    @property
    def nic_names(self) -> list[str]:
        return [n.name for n in self.topology.nics]


def create_context(config: Config, role: str) -> NodeContext:
    """Resolve identity and secret, detect hardware; raises ConfigError when the cluster has
    no secret or `cluster.master` cannot be the master (see `check_master_address`)."""
    secret = config.cluster.require_secret().encode()
    for master in config.cluster.master_addresses:
        check_master_address(master)
    host = config.node.advertise_address or default_host(config.cluster.master)
    node_id = config.node.id or default_node_id(role)
    topo = detect_topology(nic_allow=list(config.transfer.nics) or None)
    return NodeContext(config, node_id, host, secret, topo, masters=masters_to_dial(config))


def default_node_id(role: str) -> str:
    """The id of a node without `node.id`: hostname-role-pid-random."""
    # NOTE: the pid tells processes of one host apart, the random part hosts that share a
    # name but not a pid namespace (containers on the host's network, each pid 1)
    return f"{socket.gethostname()}-{role}-{os.getpid()}-{secrets.token_hex(2)}"


def masters_to_dial(config: Config) -> tuple[str, ...]:
    """Every master to dial: `cluster.masters`, else (on etcd) those registered there now
    and `cluster.master`; a master that joins later is dialed after a restart (or list them
    all in cluster.masters)."""
    c = config.cluster
    if c.masters or not c.etcd:
        return c.master_addresses
    # NOTE: outside the try: a bad setting stops the node (ConfigError), not just a warning
    etcd, sealer = create_etcd(c), Sealer(c.require_secret().encode())
    try:
        found = find_masters(etcd, c.etcd_key_prefix, sealer)
    except MooncakeError as e:
        log.warning("cannot read the masters from etcd (%s); dialing cluster.master only", e)
        return (c.master,)
    finally:
        etcd.close()
    return tuple(dict.fromkeys([c.master, *(m.rpc for m in found)]))


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_master_address(master: str) -> None:
    """Fail at once, naming the key, when `cluster.master` cannot be the master: a host name
    that does not exist, or the default (127.0.0.1:50051, what a node's file left without
    the key says) where nothing listens. A master named explicitly that is not up yet is
    waited for (`MasterLink.register`): nodes may start alongside it."""
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:  # NOTE: DNS not up yet (boot) is worth waiting for
            return
        raise ConfigError(
            f"cluster.master: no host {host!r} ({e.strerror}); set it to the master's "
            "host:port, the same on every node"
        ) from e
    if master != ClusterConfig().master:
        return
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        raise ConfigError(
            f"cluster.master: not set, and no master listens at its default {master} on this "
            "host; set cluster.master to the master's host:port (the same on every node), or "
            "start the master first"
        ) from None
    except OSError:
        pass  # NOTE: anything but a refusal is left to registration's retries


def default_host(master: str) -> str:
    """The local address that routes to the master (loopback for a local cluster)."""
    host = master.rpartition(":")[0].strip("[]")
    if host in _LOOPBACK:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop` (the role then drains and deregisters); one ignored
    as this process starts stays ignored (`up --local` leaves Ctrl-C to its launcher)."""

    def handler(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        if not stop.is_set():  # a second signal is not a second stop
            sdnotify.notify_stopping()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, handler)


def report_ready(**info: Any) -> None:
    """The ready handshake: one JSON line on stdout, and READY=1 to systemd when it
    started this process (`NOTIFY_SOCKET`)."""
    sys.stdout.write(json.dumps({"ready": True, **info}) + "\n")
    sys.stdout.flush()
    sdnotify.notify_ready(str(info.get("role", "node")), str(info.get("node_id", "")))


class MasterLink:
    """Registers this node and heartbeats on a thread; registers again when the master
    forgets it (a master restart), calling `on_registered` with each accepted reply."""

    def __init__(
        self,
        ctx: NodeContext,
        info: NodeInfoMsg,
        load_fn: Callable[[], NodeLoadMsg] = NodeLoadMsg,
        on_registered: Callable[[RegisterReplyMsg], None] | None = None,
    ):
        self.ctx, self.info, self.load_fn = ctx, info, load_fn
        self.incarnation = secrets.token_hex(8)  # this process, as the master tells restarts
        self.on_registered = on_registered
        self.cluster = ctx.config.cluster  # call_timeout_s, register_retry_s, notice_timeout_s
        self.client = RpcClient(ctx.master_rpc, ctx.secret, timeout_s=self.cluster.call_timeout_s)
        self.state: Literal["starting", "ready", "draining", "failed"] = "starting"
        self.reply: RegisterReplyMsg | None = None
        self._halt = threading.Event()  # heartbeats go on while the node drains
        self._thread = threading.Thread(target=self._loop, name="master-link", daemon=True)

    def register(self, timeout_s: float | None = None) -> RegisterReplyMsg:
        """Register, retrying while the master is not up yet; raises MooncakeError when it
        refuses this node or stays unreachable for `timeout_s` (None: the context's
        `master_wait_s`)."""
        if timeout_s is None:
            timeout_s = self.ctx.master_wait_s
        deadline, is_waiting = time.monotonic() + timeout_s, False
        master = self.ctx.config.cluster.master
        while True:
            try:
                info = msgspec.structs.replace(self.info, incarnation=self.incarnation)
                reply = self.client.call(RegisterMsg(info), RegisterReplyMsg)
                break
            except MooncakeError as e:
                if not (is_waiting or self.reply):  # NOTE: said once, at first registration
                    is_waiting = True
                    log.info("waiting up to %g s for the master at %s: %s", timeout_s, master, e)
                if time.monotonic() > deadline or self.ctx.stop.is_set():
                    raise MooncakeError(
                        f"cannot register with the master at cluster.master = {master} "
                        f"within {timeout_s:g} s: {e}"
                    ) from e
                self.ctx.stop.wait(self.cluster.register_retry_s)
        if not reply.is_accepted:
            raise MooncakeError(f"the master refused node {self.info.node_id}: {reply.message}")
        self.reply = reply
        if self.on_registered is not None:
            self.on_registered(reply)
        return reply

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        # NOTE: after a lost heartbeat the next comes `register_retry_s` later, not a whole
        # HEARTBEAT_S: a failover's new leader then sees this node within that pause of
        # starting to serve, which keeps the node's reattachment inside the 5 s the HA
        # design promises (docs/ha.md) when the election itself took 4 s
        wait_s = HEARTBEAT_S
        while not self._halt.wait(wait_s):
            wait_s = HEARTBEAT_S if self.beat() else min(HEARTBEAT_S, self.cluster.register_retry_s)

    def drain(self) -> None:
        """Tell the master at once that this node takes no new work."""
        self.state = "draining"
        self.beat()

    def beat(self) -> bool:
        """One heartbeat (registering again when the master forgot this node); whether the
        master answered."""
        try:
            msg = NodeHeartbeatMsg(self.info.node_id, self.load_fn(), self.state)
            timeout_s = self.cluster.heartbeat_timeout_s  # NOTE: see the key's doc
            if not self.client.call(msg, NodeHeartbeatReplyMsg, timeout_s=timeout_s).is_known:
                log.warning(
                    "the master does not know node %s; registering again", self.info.node_id
                )
                self.register(timeout_s=self.cluster.call_timeout_s)
                # NOTE: a node registers as starting; its state and load reach the master
                # now, not a heartbeat later (a second of a failover's reattachment)
                msg = NodeHeartbeatMsg(self.info.node_id, self.load_fn(), self.state)
                self.client.call(msg, NodeHeartbeatReplyMsg, timeout_s=timeout_s)
        except MooncakeError as e:
            log.warning("heartbeat to the master failed: %s", e)
            return False
        return True

    def deregister(self) -> None:
        """Leave the cluster (best effort) and close the link."""
        self.ctx.stop.set()
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.reply is None:  # NOTE: never registered (a failed start): nothing to leave
            self.client.close()
            return
        try:
            timeout_s = self.cluster.notice_timeout_s
            self.client.call(DeregisterMsg(self.info.node_id), AckMsg, timeout_s=timeout_s)
        except MooncakeError as e:
            log.info("deregistration not confirmed: %s", e)
        self.client.close()

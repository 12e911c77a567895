"""The parent of a node's instances (`[node] instances` > 1): `mooncake up` starts one
child `mooncake up` per instance (split by `instances.plan_instances`), waits for each
one's ready line, reports ready itself (stdout and systemd), and supervises them: SIGINT
or SIGTERM is forwarded to every child as SIGTERM (they drain and deregister); a child
that exits on its own stops the others and the parent exits non-zero, so that systemd
(or whoever runs the node) restarts the whole node. No restarts here: one supervisor
restarts, the one above.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from mooncake.config.settings import Config
from mooncake.errors import MooncakeError
from mooncake.local.supervisor import (
    Child,
    NodeEvent,
    RestartPolicy,
    Supervisor,
    die_with_parent,
    terminate,
    wait_ready,
)
from mooncake.native.nvml import GpuInfo
from mooncake.roles.node import sdnotify
from mooncake.roles.node.instances import HostShare, InstancePlan, plan_instances
from mooncake.roles.node.instances import resolve_instances as resolve_count

log = logging.getLogger(__name__)
# NOTE: a backstop only: an instance that cannot load its model or reach its master fails
# on its own first (with the reason on stderr)
READY_TIMEOUT_S = 1800.0
POLICY = RestartPolicy(limit=0)  # any exit of an instance stops the node


class InstanceExited(MooncakeError):
    """An instance exited while the node served; the others were stopped."""


def visible_gpus() -> list[GpuInfo]:
    """The GPUs this process may use (NVML's, under CUDA_VISIBLE_DEVICES), in CUDA's
    order; [] on a CPU node. Raises MooncakeError when torch sees GPUs that NVML does not
    report: they could not be told apart to be split."""
    from mooncake.hw.topology import detect_topology
    from mooncake.native import cudamap

    gpus = cudamap.visible_gpus(detect_topology().gpus)
    if not gpus:
        import torch

        if torch.cuda.is_available():
            raise MooncakeError(
                f"node.instances: torch sees {torch.cuda.device_count()} CUDA devices but NVML "
                "reports none, so they cannot be split among instances: install nvidia-ml-py "
                "and run `mooncake doctor`, or set node.instances = 1"
            )
    return gpus


def node_tensor_parallel(config: Config, gpu_bytes: list[int]) -> int:
    """The degree each instance splits its model over: `model.tensor_parallel`, or for 0
    the automatic one for the model over GPUs of `gpu_bytes` memory each (1 on a CPU node:
    []). Raises ConfigError as `tpdegree.resolve_degree` does."""
    from mooncake.model.info import load_model_info, resolve_dtype
    from mooncake.model.tpdegree import resolve_degree

    if not gpu_bytes:
        return 1
    info = load_model_info(config.model.path)
    dtype = resolve_dtype(info, config.model.dtype, "cuda")
    return resolve_degree(config.model.tensor_parallel, info.spec, dtype, gpu_bytes)


def count_instances(config: Config, role: str) -> tuple[int, list[str]]:
    """How many instances this node runs, and the GPU ids to split among them (none looked
    up for a master or store). Automatic: one per `node_tensor_parallel` GPUs. Raises
    ConfigError (see `instances.resolve_instances`)."""
    if role in ("master", "store"):
        return resolve_count(config.node, role, 0), []
    gpus = visible_gpus()
    tp = 1
    if config.node.num_instances is None:
        tp = node_tensor_parallel(config, [g.memory_total_bytes for g in gpus])
    return resolve_count(config.node, role, len(gpus), tp), [g.uuid for g in gpus]


def host_share(config: Config) -> HostShare:
    """The host's free RAM and SSD tier now, to be split among the instances."""
    import psutil

    from mooncake.hw.ssdplace import place_ssd
    from mooncake.hw.topology import detect_topology

    ssd = place_ssd(config.store, detect_topology().filesystems)
    return HostShare(
        psutil.virtual_memory().available,
        ssd.num_bytes if ssd else 0,
        ssd.path if ssd else "",
    )


@dataclass
class Instances:
    """The running children; the supervisor's view of them (`supervisor.Nodes`)."""

    children: list[Child]

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        return {c.node_id: c.proc for c in self.children}

    def respawn(self, node_id: str) -> subprocess.Popen[bytes] | None:
        return None  # NOTE: never called: POLICY restarts nothing

    def is_ready(self, node_id: str) -> bool:
        return True


def run_instances(
    config: Config, role: str, gpus: list[str], up_args: list[str], num_instances: int
) -> None:
    """Start `num_instances` instances of a `role` node (`up_args`: the parent's `mooncake up`
    arguments after the role, its config and --set flags), serve until SIGINT/SIGTERM, stop
    them. Raises ConfigError when the GPUs or ports do not split, MooncakeError when an
    instance fails to start or exits on its own."""
    from mooncake.roles.node.common import default_node_id, report_ready

    base_id = config.node.id or default_node_id(role)
    plans = plan_instances(config, role, num_instances, gpus, base_id, host_share(config))
    stop = threading.Event()
    children: list[Child] = []

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping the instances", signal.Signals(signum).name)
        if not stop.is_set():
            sdnotify.notify_stopping()
        stop.set()
        if not all(c.ready for c in children):  # NOTE: still starting: leave the wait
            raise InstanceExited(f"{base_id}: stopped while its instances started")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    gone: list[NodeEvent] = []
    try:
        children += [_launch(role, plan, up_args) for plan in plans]
        for child in children:
            wait_ready(child, READY_TIMEOUT_S)
            log.info("instance %s ready (pid %d)", child.node_id, child.proc.pid)
        report_ready(
            role=role, node_id=base_id, instances=[c.ready for c in children], pid=os.getpid()
        )
        Supervisor(Instances(children), POLICY).run(stop, gone.append)
    except InstanceExited:
        if not stop.is_set():
            raise
    finally:
        terminate(children, lambda c: _grace_s(config, c.role))
        for c in children:
            if c.proc.stdout is not None:
                c.proc.stdout.close()
    if gone:
        ev = gone[-1]
        raise InstanceExited(
            f"instance {ev.node_id} (pid {ev.pid}) exited with code {ev.code}; the other "
            f"instances of {base_id} were stopped (its log is above)"
        )


def _grace_s(config: Config, role: str) -> float:
    """Seconds an instance may take to stop after SIGTERM before it is killed."""
    return POLICY.stop_grace_s + (config.decode.drain_s if role == "decode" else 0.0)


def _launch(role: str, plan: InstancePlan, up_args: list[str]) -> Child:
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)  # NOTE: systemd's readiness is the parent's to tell
    if plan.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", role, *up_args]
    for value in plan.sets:
        cmd += ["--set", value]
    log.info("starting instance %s (GPUs %s)", plan.node_id, plan.cuda_visible_devices or "none")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent)
    return Child(plan.node_id, role, proc)

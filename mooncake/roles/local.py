"""`mooncake up --local`: a whole cluster on this machine, one process per node.

    master  +  prefill x N (one pipeline group of `group_size`)  +  decode x M  +  store x K

The launcher writes one config (a fresh secret, free ports, the small model), profiles
the model once for the Conductor's cost model (cached per model and shape), starts the
master, then the other nodes, each reporting ready with a JSON line on stdout (no sleeps),
writes the runfile `mooncake status` and `mooncake replay` read, and on SIGINT/SIGTERM
stops every child (SIGTERM, then SIGKILL after a grace period). Children die with the
launcher even if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mooncake.errors import MooncakeError
from mooncake.roles.runfile import LocalCluster, remove_runfile, write_runfile

log = logging.getLogger(__name__)
DECODE_KV_BYTES = 128 << 20  # the decode node's KV cache (and the cost model's capacity)
READY_TIMEOUT_S = 180.0  # seconds a node may take to load and report ready


@dataclass
class LocalPlan:
    """The shape of the local cluster."""

    model: str = "dummy:tiny"
    num_prefill: int = 2
    group_size: int = 2  # prefill nodes per pipeline group
    num_decode: int = 1
    num_store: int = 1
    api_host: str = "127.0.0.1"
    api_port: int = 8000  # 0 = any free port
    block_tokens: int = 32
    chunk_tokens: int = 256
    pool: bool = True  # False: no store node and no pool share (a no-reuse baseline)
    cost_model_path: str = ""  # "" = profile once and cache
    run_dir: Path = field(default_factory=lambda: Path.cwd())
    extra: dict[str, object] = field(default_factory=dict)  # more config keys "sec.key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_config(plan: LocalPlan, path: Path, secret: str, master_port: int,
                 cost_model: str) -> None:  # fmt: skip
    sections: dict[str, dict[str, object]] = {
        "cluster": {"name": "local", "master": f"127.0.0.1:{master_port}", "secret": secret},
        "node": {"advertise_address": "127.0.0.1"},
        "model": {"path": plan.model, "block_tokens": plan.block_tokens},
        "prefill": {
            "chunk_tokens": plan.chunk_tokens,
            "pipeline_group_size": plan.group_size,
            "kv_cache_bytes": "64MiB",
        },
        "decode": {"kv_cache_bytes": DECODE_KV_BYTES, "max_batch": 32},
        "store": {"dram_bytes": "256MiB" if plan.pool else "0", "heartbeat_ttl_s": 6.0},
        "api": {"host": plan.api_host, "port": plan.api_port},
        "scheduler": {"cost_model_path": cost_model},
        "transfer": {"protocol": "auto"},
    }
    for key, value in plan.extra.items():
        sec, _, name = key.partition(".")
        sections.setdefault(sec, {})[name] = value
    lines = []
    for sec, kv in sections.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    path.chmod(0o600)  # it holds the secret


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle


@dataclass
class Child:
    node_id: str
    role: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, object] = field(default_factory=dict)


class LocalLauncher:
    """The running children of one local cluster."""

    def __init__(self, plan: LocalPlan, on_progress: Callable[[str], None] = lambda _: None):
        self.plan, self.on_progress = plan, on_progress
        self.children: list[Child] = []
        self.config_path = plan.run_dir / "mooncake-local.toml"
        self.url = ""
        self.is_stopping = False

    def start(self, cost_model: str) -> LocalCluster:
        plan = self.plan
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        master_port = free_port()
        if plan.api_port == 0:
            plan.api_port = free_port()
        secret = secrets.token_urlsafe(24)
        write_config(plan, self.config_path, secret, master_port, cost_model)
        try:
            # NOTE: all at once; nodes retry registering until the master is up
            master = self._launch("master", "master")
            nodes = [("prefill", f"prefill-{i}") for i in range(plan.num_prefill)]
            nodes += [("decode", f"decode-{i}") for i in range(plan.num_decode)]
            if plan.pool:
                nodes += [("store", f"store-{i}") for i in range(plan.num_store)]
            pending = [self._launch(role, nid) for role, nid in nodes]
            self._wait_ready(master)
            self.url = str(master.ready.get("url", ""))
            for child in pending:
                self._wait_ready(child)
            self._wait_schedulable()
        except BaseException:
            self.stop()
            raise
        info = LocalCluster(url=self.url, master=f"127.0.0.1:{master_port}",
                            config_path=str(self.config_path),
                            pids={c.node_id: c.proc.pid for c in self.children})  # fmt: skip
        write_runfile(info)
        return info

    def _launch(self, role: str, node_id: str) -> Child:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "mooncake", "up", "--role", role,
               "--config", str(self.config_path), "--set", f"node.id={node_id}"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env,
                                preexec_fn=_die_with_parent)  # fmt: skip
        child = Child(node_id, role, proc)
        self.children.append(child)
        self.on_progress(f"starting {node_id}")
        return child

    def relaunch(self, node_id: str) -> Child:
        """Start a node again (after it died or was stopped) with the same config; returns
        once it reports ready."""
        old = next(c for c in self.children if c.node_id == node_id)
        if old.proc.poll() is None:
            raise MooncakeError(f"{node_id} is still running (pid {old.proc.pid})")
        self.children.remove(old)
        return self._spawn(old.role, node_id)

    def _spawn(self, role: str, node_id: str) -> Child:
        child = self._launch(role, node_id)
        self._wait_ready(child)
        return child

    def _wait_ready(self, child: Child) -> None:
        """Read the child's stdout until its JSON ready line (or its exit)."""
        assert child.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        sel = selectors.DefaultSelector()
        sel.register(child.proc.stdout, selectors.EVENT_READ)
        buf = b""
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=0.5):
                    if child.proc.poll() is not None:
                        break
                    continue
                chunk = os.read(child.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(msg, dict) and msg.get("ready"):
                        child.ready = msg
                        self.on_progress(f"{child.node_id} ready")
                        return
        finally:
            sel.close()
        code = child.proc.poll()
        raise MooncakeError(
            f"{child.node_id} ({child.role}) did not report ready"
            + (f": it exited with code {code} (its log is above)" if code is not None
               else f" within {READY_TIMEOUT_S:.0f} s")
        )  # fmt: skip

    def _wait_schedulable(self, timeout_s: float = 30.0) -> None:
        """Wait until the master places on the prefill group and the decode node."""
        import httpx

        deadline = time.monotonic() + timeout_s
        want = len(self.children) - 1  # every node but the master
        while time.monotonic() < deadline:
            try:
                nodes = httpx.get(self.url + "/v1/status", timeout=2.0).json()["nodes"]
                ready = [n for n in nodes if n["role"] != "master" and n["state"] == "ready"]
                if len(ready) >= want:
                    return
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                pass
            time.sleep(0.1)
        raise MooncakeError("the local cluster's nodes did not all become ready in time")

    def wait(self) -> int:
        """Block until a child exits (a crash) or a signal arrives; returns its code."""
        while not self.is_stopping:
            for c in self.children:
                code = c.proc.poll()
                if code is not None and not self.is_stopping:
                    log.error("%s (%s) exited with code %s", c.node_id, c.role, code)
                    return code or 1
            time.sleep(0.2)
        return 0

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child (nodes first, master last), then SIGKILL stragglers."""
        self.is_stopping = True
        order = [c for c in self.children if c.role != "master"]
        order += [c for c in self.children if c.role == "master"]
        for group in (order[:-1], order[-1:]) if order else ():
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in group:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", c.node_id, grace_s)
                    c.proc.kill()
                    c.proc.wait()
        for c in self.children:
            if c.proc.stdout is not None:
                c.proc.stdout.close()
        remove_runfile()


def ensure_cost_model(plan: LocalPlan, cache_dir: Path,
                      on_progress: Callable[[str], None] = lambda _: None) -> Path:  # fmt: skip
    """The Conductor's cost model for the plan's model on this machine: profiled once
    (a few seconds for dummy:tiny, one thread as the nodes run) and cached by shape."""
    if plan.cost_model_path:
        return Path(plan.cost_model_path)
    import torch

    from mooncake.engine.kvobject import DTYPE_BYTES
    from mooncake.engine.modelinfo import load_model_info, resolve_dtype
    from mooncake.engine.profiling import profile_cost_model

    name = plan.model.replace(":", "-").replace("/", "_")
    tag = f"{name}-b{plan.block_tokens}-c{plan.chunk_tokens}"
    path = cache_dir / f"costmodel-{tag}.json"
    if path.exists():
        return path
    on_progress(f"profiling {plan.model} once for the Conductor's cost model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        info = load_model_info(plan.model)
        dtype = resolve_dtype(info, "auto", "cpu")
        capacity = DECODE_KV_BYTES // info.spec.kv_bytes_per_token(DTYPE_BYTES[dtype])
        model, _, _ = profile_cost_model(
            info, dtype, plan.block_tokens, plan.chunk_tokens, [64, 256, 512, 1024],
            [0.0, 0.5], [1, 4, 16], [64, 256], 4, 1, capacity, 2e9, on_progress,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return path

"""`mooncake up --local`: a whole cluster on this machine, one process per node.

    master  +  prefill x N (one pipeline group of `group_size`)  +  decode x M  +  store x K

With `num_masters` > 1 it also runs a one-member etcd (`ha/localetcd.py`, fresh data in
memory, auth on: its root password is in the config) and that many masters on it: one
leads, the others forward their API to it and take over when it dies (docs/ha.md). With
one master, the master journals the pool in the run directory (`cluster.state_dir`), so a
restarted master keeps the pool.

The launcher writes one config (a fresh secret, free ports, the small model, a small SSD
tier per node under the run directory) into a private run directory (see `runfile`),
profiles the model once for the Conductor's cost model (cached per model and shape), starts
the master and the other nodes, each reporting ready with a JSON line on stdout (no sleeps),
and writes the runfile `mooncake status` and `mooncake replay` read. `supervise` restarts
nodes that exit (`supervisor.Supervisor`); `stop` ends every child (SIGTERM, then SIGKILL
once its grace, longer than a decode node's drain, is over). Children die with the launcher
even if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mooncake.config.load import load_config
from mooncake.config.settings import ApiConfig, Config, DecodeConfig
from mooncake.errors import MooncakeError, PortInUseError
from mooncake.ha.localetcd import LocalEtcd, tmpfs_data_dir
from mooncake.local.config import local_ssd_dir, write_config
from mooncake.local.plan import LocalPlan
from mooncake.local.runfile import (
    LocalCluster,
    private_dir,
    remove_runfile,
    runfile_path,
    write_runfile,
)
from mooncake.local.supervisor import (
    Child,
    NodeEvent,
    RestartPolicy,
    Supervisor,
    die_with_parent,
    terminate,
    wait_ready,
)
from mooncake.native.shm import sweep_stale

log = logging.getLogger(__name__)
PORT_ATTEMPTS = 3  # starts with freshly chosen ports when a master lost one (see start)
READY_TIMEOUT_S = 180.0  # seconds a node may take to load and report ready
SCHEDULABLE_TIMEOUT_S = 30.0  # seconds for the master to see every ready node
CONFIG_NAME = "mooncake-local.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalLauncher:
    """The running children of one local cluster."""

    def __init__(
        self,
        plan: LocalPlan,
        on_progress: Callable[[str], None] = lambda _: None,
        policy: RestartPolicy = RestartPolicy(),
    ):
        self.plan, self.on_progress, self.policy = plan, on_progress, policy
        self.children: list[Child] = []
        self.config_path = plan.run_dir / CONFIG_NAME
        self.runfile = runfile_path()
        self.url = ""
        self.api_key = ""  # the first API key, for the launcher's own calls
        self.is_stopping = False
        self.info: LocalCluster | None = None  # what the runfile says, once started
        # role -> its drain in the generated config (decode.drain_s, api.drain_s), seconds
        self._drain_s = {"decode": DecodeConfig().drain_s, "master": ApiConfig().drain_s}
        self._master_port = 0
        self._is_api_port_chosen = plan.api_port == 0  # the launcher picks it (again on retry)
        self.etcd: LocalEtcd | None = None  # with several masters
        self._node_sets: dict[str, list[str]] = {}  # node id -> its own --set values
        self._lock = threading.Lock()  # children, is_stopping, the runfile
        # NOTE: PR_SET_PDEATHSIG fires when the *thread* that forked a child ends, so every
        # child is forked on this one long-lived thread, never on a supervising thread
        self._forker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-fork")

    def configure(self, cost_model: str) -> Config:
        """Write the generated config (a fresh secret, free ports) into the checked run
        directory and load it back; starts nothing. Raises ConfigError, RunDirError."""
        plan = self.plan
        private_dir(plan.run_dir)
        private_dir(self.runfile.parent, tighten=True)
        ssd = local_ssd_dir(plan.run_dir)
        private_dir(ssd.parent if ssd.parent != plan.run_dir else ssd)
        self._master_port = free_port()
        if self._is_api_port_chosen:
            plan.api_port = free_port()
        secret = secrets.token_urlsafe(24)
        write_config(plan, self.config_path, secret, self._master_port, cost_model, self._ha_keys())
        config = load_config(self.config_path).config
        self.api_key = next(iter(config.api.load_keys()), "")
        self._drain_s = {"decode": config.decode.drain_s, "master": config.api.drain_s}
        return config

    def _ha_keys(self) -> dict[str, object]:
        """[cluster] keys for the masters: on a fresh local etcd when there are several,
        else a journal in the run directory (a fresh cluster's: an old one is removed)."""
        plan = self.plan
        if plan.num_masters <= 1:
            state = private_dir(plan.run_dir / "state")
            for old in state.glob("pool-local-*.journal"):
                old.unlink()
            return {"state_dir": str(state)}
        data = tmpfs_data_dir(plan.run_dir / f"etcd-{secrets.token_hex(4)}")
        self.etcd = LocalEtcd(data, die_with_parent)
        url = self._forker.submit(self.etcd.start).result()  # NOTE: dies with the launcher
        ports = [self._master_port] + [free_port() for _ in range(plan.num_masters - 1)]
        for i, port in enumerate(ports[1:], 1):
            self._node_sets[f"master-{i}"] = [
                f"cluster.master={plan.host}:{port}",
                f"api.port={free_port()}",
            ]
        return {
            "etcd": [url],
            "etcd_user": self.etcd.access.user,
            "etcd_password": self.etcd.access.password,  # NOTE: in the 0600 config file
            "masters": [f"{plan.host}:{p}" for p in ports],
        }

    def start(self, cost_model: str) -> LocalCluster:
        """Configure, start every node, wait until the master places on all of them, write
        the runfile; returns what it says. Stops what it started if any of it fails.

        The ports are chosen free before the nodes that bind them start, so another
        process may take one in between: a master that exits saying so (PortInUseError's
        exit code) makes the launcher choose again, up to PORT_ATTEMPTS times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.configure(cost_model)
            try:
                return self._start_nodes()
            except BaseException:
                if attempt == PORT_ATTEMPTS or not self._lost_a_port():
                    self.stop()
                    raise
                log.warning(
                    "a port chosen for the local cluster was taken before its master bound "
                    "it; choosing the ports again (attempt %d of %d)",
                    attempt + 1,
                    PORT_ATTEMPTS,
                )
                self._stop_children(grace_s=self.policy.stop_grace_s)
                self.children = []
                if self.etcd is not None:
                    self.etcd.stop()
                    self.etcd = None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _start_nodes(self) -> LocalCluster:
        plan = self.plan
        # NOTE: all at once; nodes retry registering until the master is up
        nodes = [("master", "master")]
        nodes += [("master", f"master-{i}") for i in range(1, plan.num_masters)]
        nodes += [("prefill", f"prefill-{i}") for i in range(plan.num_prefill)]
        nodes += [("decode", f"decode-{i}") for i in range(plan.num_decode)]
        if plan.pool:
            nodes += [("store", f"store-{i}") for i in range(plan.num_store)]
        self.children += [self._launch(role, nid) for role, nid in nodes]
        for child in self.children:  # the master first
            self._wait_ready(child)
        self.url = str(self.children[0].ready.get("url", ""))
        self._wait_schedulable()
        with self._lock:
            self._write_runfile()
        assert self.info is not None
        return self.info

    def _lost_a_port(self) -> bool:
        """Whether a master exited because a port chosen for it was taken."""
        return any(
            c.role == "master" and c.proc.poll() == PortInUseError.exit_code for c in self.children
        )

    def _write_runfile(self) -> None:
        """The runfile with the children's current pids; the caller holds the lock."""
        self.info = LocalCluster(
            url=self.url,
            master=f"{self.plan.host}:{self._master_port}",
            config_path=str(self.config_path),
            pids={c.node_id: c.proc.pid for c in self.children},
            api_key=self.api_key,
        )
        write_runfile(self.info, self.runfile)

    def _launch(self, role: str, node_id: str) -> Child:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("NOTIFY_SOCKET", None)  # NOTE: systemd's readiness is the launcher's to tell
        cmd = [
            sys.executable,
            "-m",
            "mooncake",
            "up",
            "--role",
            role,
            "--config",
            str(self.config_path),
            "--set",
            f"node.id={node_id}",
        ]
        for value in self._node_sets.get(node_id, []):
            cmd += ["--set", value]
        if (placed := self.plan.placements.get(node_id)) is not None:
            cmd = [*placed.prefix, *cmd, "--set", f"node.advertise_address={placed.address}"]
        if role == "prefill" and "node.nice" not in self.plan.extra and self.plan.prefill_nice:
            cmd += ["--set", f"node.nice={self.plan.prefill_nice}"]
        proc = self._forker.submit(
            subprocess.Popen, cmd, stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent
        ).result()
        self.on_progress(f"starting {node_id}")
        return Child(node_id, role, proc)

    def _replace(self, node_id: str) -> Child:
        """Start `node_id` again in place of its exited process; the caller holds the lock."""
        i = next(i for i, c in enumerate(self.children) if c.node_id == node_id)
        old = self.children[i]
        if old.proc.stdout is not None:
            old.proc.stdout.close()
        self.children[i] = child = self._launch(old.role, node_id)
        if self.info is not None:
            self._write_runfile()
        return child

    def relaunch(self, node_id: str) -> Child:
        """Start a node again (after it died or was stopped) with the same config; returns
        once it reports ready. For a launcher nobody `supervise`s."""
        with self._lock:
            old = next(c for c in self.children if c.node_id == node_id)
            if old.proc.poll() is None:
                raise MooncakeError(f"{node_id} is still running (pid {old.proc.pid})")
            child = self._replace(node_id)
        self._wait_ready(child)
        return child

    # the supervisor's view (supervisor.Nodes)
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        with self._lock:
            return {} if self.is_stopping else {c.node_id: c.proc for c in self.children}

    def respawn(self, node_id: str) -> subprocess.Popen[bytes] | None:
        with self._lock:
            if self.is_stopping:
                return None
            child = self._replace(node_id)
        threading.Thread(target=self._await_respawn, args=(child,), daemon=True).start()
        return child.proc

    def is_ready(self, node_id: str) -> bool:
        with self._lock:
            return any(c.node_id == node_id and c.ready for c in self.children)

    def _await_respawn(self, child: Child) -> None:
        try:
            self._wait_ready(child)
        except (MooncakeError, OSError, ValueError) as e:  # ValueError: stop() closed stdout
            if self.is_stopping:
                return
            log.warning("%s", e)
            if child.proc.poll() is None:  # hung while starting: the supervisor restarts it
                child.proc.kill()

    def supervise(
        self, stop: threading.Event, on_event: Callable[[NodeEvent], None] = lambda _: None
    ) -> str | None:
        """Restart nodes that exit (with backoff, up to the policy's limit) until `stop` is
        set (returns None) or a node exits too often (returns why; the caller then stops
        the cluster). Runs on the calling thread; updates the runfile's pids."""
        return Supervisor(self, self.policy).run(stop, on_event)

    def _wait_ready(self, child: Child) -> None:
        wait_ready(child, READY_TIMEOUT_S)
        self.on_progress(f"{child.node_id} ready")

    def _wait_schedulable(self) -> None:
        """Wait until the master places on the prefill group and the decode node."""
        import httpx

        deadline = time.monotonic() + SCHEDULABLE_TIMEOUT_S
        want = sum(c.role != "master" for c in self.children)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        why = "no answer"
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/v1/status", headers=headers, timeout=2.0)
                nodes = r.json()["nodes"] if r.status_code == 200 else []
                ready = sum(n["role"] != "master" and n["state"] == "ready" for n in nodes)
                if ready >= want:
                    return
                why = f"{ready} of {want} nodes ready" if nodes else f"HTTP {r.status_code}"
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
                why = str(e) or type(e).__name__
            time.sleep(0.1)
        raise MooncakeError(f"the local cluster's nodes did not all become ready ({why})")

    def stop_grace_s(self, role: str) -> float:
        """Seconds a node of `role` may take to exit after SIGTERM before it is killed:
        the policy's stop_grace_s, plus decode.drain_s for a decode node and api.drain_s
        for a master."""
        return self.policy.stop_grace_s + self._drain_s.get(role, 0.0)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every child (nodes first, master last; with SIGCONT, so a stopped one
        acts on it), SIGKILL those still running after their grace (`grace_s`, or
        stop_grace_s), and sweep the shared memory the killed ones left. Idempotent."""
        with self._lock:
            self.is_stopping = True
        self._stop_children(grace_s)
        if self.etcd is not None:
            self.etcd.stop()
        self._forker.shutdown(wait=False)
        if self.info is not None:
            remove_runfile(self.runfile)

    def _stop_children(self, grace_s: float | None = None) -> None:
        """stop()'s part for the children (they stay listed)."""
        with self._lock:
            children = list(self.children)
        is_killed = False
        nodes = [c for c in children if c.role != "master"]
        masters = [c for c in children if c.role == "master"]
        for group in (nodes, masters):
            is_killed |= terminate(
                group, lambda c: self.stop_grace_s(c.role) if grace_s is None else grace_s
            )
        if is_killed:
            sweep_stale()  # a killed node never unlinked its /dev/shm arenas
        for c in children:
            if c.proc.stdout is not None:
                c.proc.stdout.close()

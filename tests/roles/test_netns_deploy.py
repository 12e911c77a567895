"""README's "Deploying on N machines" across five network namespaces of one host: a master,
two prefill nodes forming one pipeline group, a decode node and a store node, each at its
own address on a bridge (in a namespace of its own), each from its own TOML file, each
started as `ip netns exec NS python -m mooncake up --config FILE`, no cost model
configured. The decode node also has its own /dev/shm (a mount namespace, as in a
container), so `transfer.protocol = "auto"` must move its KV over TCP across the veth links.
A prefill node's link cut shows the pool whole after it returns, and a request in flight on
the dark stage ending within its deadline (short `stage_timeout_s` and `node_wait_s` here).
Needs root, iproute2's `ip` and util-linux's `unshare`."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from mooncake.errors import MooncakeError
from mooncake.kv.object import DTYPE_BYTES
from mooncake.local.supervisor import Child, wait_ready
from mooncake.model.info import load_model_info, resolve_dtype

pytestmark = [pytest.mark.cluster, pytest.mark.netns, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"  # the bridge's /24; only the namespaces below see it
ADDRESS = {"master": 1, "store-0": 2, "prefill-0": 3, "prefill-1": 4, "decode-0": 5}
MASTER = f"{SUBNET}.1"
TTL_S = 3.0  # store.heartbeat_ttl_s: how long a dark node keeps its place
STAGE_TIMEOUT_S = 3.0  # prefill.stage_timeout_s: a leader's wait per chunk on stage 1
NODE_WAIT_S = 3.0  # scheduler.node_wait_s: a request's wait for a group to place it on
DARK_S = 5.0  # seconds prefill-1 stays dark after the master dropped it
CLONE_NEWNET = 0x40000000
CHOICE = re.compile(r"transport: peer \S+ \((\S+)\): (\w+):")  # (peer node, transport)

SHARED = """
[cluster]
name = "netns"
master = "{master}:50051"
secret = "netns-deploy-secret-0123456789ab"

[model]
path = "dummy:tiny"
block_tokens = 32

[prefill]
pipeline_group_size = 2
chunk_tokens = 256
stage_timeout_s = {stage_timeout}

[scheduler]
node_wait_s = {node_wait}

[store]
dram_bytes = "64MiB"
heartbeat_ttl_s = {ttl}

[transfer]
protocol = "auto"
"""

ROLE = {  # one file per node: the shared part, then what only this node says
    "master": '[node]\nrole = "master"\n\n[api]\nallow_unauthenticated = true\n\n'
    "[metrics]\nenabled = false\n",
    "store-0": '[node]\nrole = "store"\nid = "store-0"\n',
    "prefill-0": '[node]\nrole = "prefill"\nid = "prefill-0"\n',
    "prefill-1": '[node]\nrole = "prefill"\nid = "prefill-1"\n',
    "decode-0": '[node]\nrole = "decode"\nid = "decode-0"\n\n[decode]\nkv_cache_bytes = "64MiB"\n',
}

T = TypeVar("T")


def _ip(*args: str) -> str:
    return subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=10
    ).stdout


@dataclass
class Cluster:
    """The deployed cluster as the test sees it."""

    namespaces: dict[str, str]  # node name -> its network namespace
    children: dict[str, Child]  # node name -> its `mooncake up` process
    logs: dict[str, Path]  # node name -> its stderr
    call: Callable[[Callable[[httpx.Client], T]], T]  # runs with a client in the master's ns

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        url = f"http://{MASTER}:8000{path}"
        return self.call(lambda c: c.request(method, url, timeout=60, **kw))

    def rx_bytes(self, name: str) -> int:
        """Bytes received on the node's veth link, read in its namespace."""
        (link,) = json.loads(_ip("-n", self.namespaces[name], "-j", "-s", "link", "show", "eth0"))
        return int(link["stats64"]["rx"]["bytes"])

    def pool_capacity(self) -> int:
        status = self.api("GET", "/v1/status")
        assert status.status_code == 200, status.text
        return sum(t["capacity_bytes"] for t in status.json()["pool"])

    def moved_bytes(self, transport: str) -> int:
        """Bytes every node says it moved over `transport` (`/v1/status`)."""
        status = self.api("GET", "/v1/status").json()
        return sum(n["transfer_bytes"].get(transport, 0) for n in status["nodes"])

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")


def _create_network(namespaces: dict[str, str]) -> None:
    """A namespace per node (`namespaces`: node name -> namespace), each with `eth0` at its
    address, on a bridge in namespace `namespaces["hub"]`: the root namespace's firewall
    never sees the traffic."""
    for ns in namespaces.values():
        _ip("netns", "add", ns)
    hub = namespaces["hub"]
    _ip("-n", hub, "link", "add", "br0", "type", "bridge")
    _ip("-n", hub, "link", "set", "br0", "up")
    for k, name in enumerate(ADDRESS):
        ns = namespaces[name]
        _ip("-n", hub, "link", "add", f"p{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", hub, "link", "set", f"p{k}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{ADDRESS[name]}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _delete_network(namespaces: dict[str, str]) -> None:
    for ns in namespaces.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _own_shm(cmd: list[str]) -> list[str]:
    """`cmd` in a mount namespace of its own with a fresh tmpfs on /dev/shm."""
    script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]


def _enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (setns: this thread only)."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def _stop(children: dict[str, Child]) -> None:
    for child in children.values():
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in children.values():
        try:
            child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2's `ip` and `unshare` to create network namespaces")
    tmp = tmp_path_factory.mktemp("netns-deploy")
    tag = f"mc{os.getpid() % 100000}"
    namespaces = {name: tag + name for name in [*ADDRESS, "hub"]}
    children: dict[str, Child] = {}
    logs: dict[str, Path] = {}
    pool = ThreadPoolExecutor(1)
    try:
        try:
            _create_network(namespaces)
            probe = ["ip", "netns", "exec", namespaces["decode-0"], *_own_shm(["true"])]
            subprocess.run(probe, check=True, capture_output=True, timeout=10)
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create namespaces or a private /dev/shm here: {e.stderr!r}")
        pool.submit(_enter, namespaces["master"]).result()
        client = pool.submit(httpx.Client).result()
        # NOTE: each node logs its transport per peer at INFO; the default level is warning
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MOONCAKE_LOG_LEVEL": "info"}
        for name, role_part in ROLE.items():  # the master first, as the walkthrough says
            path = tmp / f"{name}.toml"
            shared = SHARED.format(
                master=MASTER, ttl=TTL_S, stage_timeout=STAGE_TIMEOUT_S, node_wait=NODE_WAIT_S
            )
            path.write_text(shared + "\n" + role_part)
            path.chmod(0o600)
            cmd = [sys.executable, "-m", "mooncake", "up", "--config", str(path)]
            if name == "decode-0":
                cmd = _own_shm(cmd)
            logs[name] = tmp / f"{name}.log"
            with logs[name].open("wb") as err:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", namespaces[name], *cmd],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            children[name] = Child(name, name, proc)
        for name, child in children.items():
            try:
                wait_ready(child, 120)
            except MooncakeError as e:
                raise AssertionError(f"{e}\n{logs[name].read_text(errors='replace')}") from e
        deployed = Cluster(namespaces, children, logs, lambda f: pool.submit(f, client).result())
        deadline = time.monotonic() + 60
        while (health := deployed.api("GET", "/health")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.2)
        yield deployed
    finally:
        _stop(children)
        pool.shutdown()
        _delete_network(namespaces)


def _prompt(seed: int, num_tokens: int = 700) -> list[int]:
    return [(i * 31 + seed) % 250 + 1 for i in range(num_tokens)]


def test_a_repeated_long_prompt_is_served_from_the_pool(cluster: Cluster) -> None:
    """No cost model configured, five addresses: requests succeed through the master's API
    and a repeated 700-token prompt reports cached tokens."""
    body = {"prompt": _prompt(7), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = cluster.api("POST", "/v1/completions", json=body)
    assert first.status_code == 200, first.text
    deadline = time.monotonic() + 15
    while True:
        again = cluster.api("POST", "/v1/completions", json=body)
        assert again.status_code == 200, again.text
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cached >= 640, again.json()["usage"]
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_kv_crosses_the_veth_link_of_a_decode_node_with_its_own_shm(cluster: Cluster) -> None:
    """The decode node cannot map the others' /dev/shm: auto picks TCP to reach it (and
    says so in the log), and its link receives at least the request's KV."""
    info = load_model_info("dummy:tiny")
    kv_bytes_per_token = info.spec.kv_bytes_per_token(
        DTYPE_BYTES[resolve_dtype(info, "auto", "cpu")]
    )
    prompt = _prompt(11)
    kv_bytes = len(prompt) // 32 * 32 * kv_bytes_per_token  # its full blocks
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = cluster.rx_bytes("decode-0")
    done = cluster.api("POST", "/v1/completions", json=body)
    assert done.status_code == 200, done.text
    received = cluster.rx_bytes("decode-0") - before
    assert received >= kv_bytes, f"{received} bytes on the decode node's link for {kv_bytes} of KV"
    for name in cluster.logs:  # each node logs its first choice per peer, with the reason
        for peer, transport in CHOICE.findall(cluster.log(name)):
            crosses = "decode-0" in (name, peer)  # only the decode node has another /dev/shm
            assert transport == ("tcp" if crosses else "shm"), f"{name} -> {peer}: {transport}"
    deadline = time.monotonic() + 10  # nodes report what they moved with their heartbeats
    while (tcp_bytes := cluster.moved_bytes("tcp")) < kv_bytes:
        assert time.monotonic() < deadline, f"status shows {tcp_bytes} bytes moved over tcp"
        time.sleep(0.2)


def test_a_prefill_node_dark_past_the_ttl_comes_back_with_its_pool_share(cluster: Cluster) -> None:
    """prefill-1's link down until the master drops it, then up: it registers again, the
    pool's capacity returns to what it was and the group serves again."""
    capacity = cluster.pool_capacity()
    ns = cluster.namespaces["prefill-1"]
    _ip("-n", ns, "link", "set", "eth0", "down")
    try:
        deadline = time.monotonic() + TTL_S + 10
        while (dark := cluster.pool_capacity()) >= capacity:
            assert time.monotonic() < deadline, f"the master kept prefill-1's pool share {dark}"
            time.sleep(0.2)
        # NOTE: dark a while longer: heartbeats pile up on the node and reach the master all
        # at once when the link returns, and the reply to the first comes too late to be read
        time.sleep(DARK_S)
    finally:
        _ip("-n", ns, "link", "set", "eth0", "up")
    deadline = time.monotonic() + 20
    while (now := cluster.pool_capacity()) != capacity:
        assert time.monotonic() < deadline, (
            f"pool capacity {now} after the outage, {capacity} before"
        )
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while (health := cluster.api("GET", "/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    body = {"prompt": _prompt(13), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    done = cluster.api("POST", "/v1/completions", json=body)
    assert done.status_code == 200, done.text


def test_a_request_in_flight_on_a_dark_stage_ends_within_its_deadline(cluster: Cluster) -> None:
    """Stage 1's link cut, and at once (long before the master's heartbeat TTL would drop
    it, so the master still places on the group) a request: its prefill waits on the dark
    stage only `prefill.stage_timeout_s`, then the request is placed again or fails with a
    reason within `scheduler.node_wait_s` more. It does not hang until the link returns."""
    assert cluster.api("GET", "/health").status_code == 200
    leaders = re.findall(r"prefill group led by (\S+) is schedulable", cluster.log("master"))
    assert leaders, cluster.log("master")
    (stage1,) = {"prefill-0", "prefill-1"} - {leaders[-1]}
    ns = cluster.namespaces[stage1]
    bound_s = STAGE_TIMEOUT_S + NODE_WAIT_S + 8.0  # margins: a re-placement, a slow host
    url = f"http://{MASTER}:8000/v1/completions"
    prompt = _prompt(17, 200)  # one prefill chunk: one stage deadline
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    _ip("-n", ns, "link", "set", "eth0", "down")
    cut = time.monotonic()
    try:
        try:
            resp = cluster.call(lambda c: c.post(url, json=body, timeout=bound_s))
        except httpx.TimeoutException:
            pytest.fail(f"the request was still running {bound_s:.0f} s after stage 1 went dark")
        took = time.monotonic() - cut
    finally:
        _ip("-n", ns, "link", "set", "eth0", "up")
    assert took < bound_s
    if resp.status_code != 200:  # failed: said so, with a reason
        assert resp.status_code >= 500, resp.text
        assert resp.json()["error"]["message"], resp.text
    deadline = time.monotonic() + 30  # the group forms again once the link is back
    while (health := cluster.api("GET", "/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)

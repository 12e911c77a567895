"""The soak's network: some nodes each in a network namespace of their own, behind a veth
link to a bridge in the launcher's namespace, and a way to degrade one link at a time.

    bridge mcsk<pid>b  10.231.X.1/24  (masters and the other nodes bind and advertise here)
      +-- veth mcsk<pid>h<k>  <->  eth0 in namespace mcsk<pid>n<k>  10.231.X.(k+2)/24

A node in a namespace also gets a /dev/shm of its own (a mount namespace with a fresh
tmpfs), so its peers cannot map its segments: its KV and its control traffic both cross
its link. `degrade` shapes both directions of one link: with `tc netem` (delay, jitter,
loss) when the kernel has it; else (a kernel without CONFIG_NET_SCH_NETEM) loss by a tc
BPF filter dropping that share of packets at random, and a `tbf` rate limit, and no delay
(`Degrade.how` says which). Every name starts with `mcsk<pid>`: `sweep_stale` removes those
of soaks whose process is gone (a crash, a SIGKILL), and `delete` this one's.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass

from mooncake.errors import MooncakeError
from mooncake.local.plan import Placement

log = logging.getLogger(__name__)
PREFIX = "mcsk"  # every namespace, bridge and veth made here starts with it and a pid
SUBNET = "10.231"  # the bridge's /24 is SUBNET.X.0, X free in this namespace
_OWNED = re.compile(rf"^{PREFIX}(\d+)[bhn]")
_SHM = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'  # sh -c: a fresh /dev/shm, then the node
# classic BPF for cls_bpf direct-action: A = random u32; A > T ? TC_ACT_SHOT : TC_ACT_OK
_DROP = "4,32 0 0 4294963256,37 1 0 {threshold},6 0 0 0,6 0 0 2"


class NetnsError(MooncakeError):
    """A namespace, link or qdisc could not be made (not root, no iproute2, a bad spec)."""


def _run(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except FileNotFoundError as e:
        raise NetnsError(f"{cmd[0]} is not installed (iproute2 provides ip and tc)") from e
    except subprocess.CalledProcessError as e:
        raise NetnsError(f"{' '.join(cmd)}: {e.stderr.strip() or e.returncode}") from e
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces and links of soaks whose process is gone; their names."""
    gone: list[str] = []
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line]
    links = [line.split()[0].split("@")[0] for line in _run("ip", "-br", "link").splitlines()]
    for name in links + namespaces:
        m = _OWNED.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        what = ("netns", "del", name) if name in namespaces else ("link", "del", name)
        subprocess.run(["ip", *what], capture_output=True, timeout=10)
        gone.append(name)
    if gone:
        log.info("removed a crashed soak's network: %s", ", ".join(gone))
    return gone


@dataclass(frozen=True)
class Degrade:
    """How a degraded link misbehaves (each direction)."""

    delay_ms: float = 30.0
    jitter_ms: float = 10.0
    loss_pct: float = 2.0
    rate: str = ""  # a tc rate ("20mbit"), "" = no limit

    def validate(self) -> None:
        """Raise NetnsError naming every flag that is out of range."""
        is_rate = not self.rate or re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", self.rate) is not None
        checks = [
            (self.delay_ms >= 0, f"--netem-delay must be >= 0 ms, got {self.delay_ms}"),
            (self.jitter_ms >= 0, f"--netem-jitter must be >= 0 ms, got {self.jitter_ms}"),
            (0 <= self.loss_pct < 100, f"--netem-loss must be in [0, 100) %, got {self.loss_pct}"),
            (is_rate, f"--netem-rate must be like 20mbit, got {self.rate!r}"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise NetnsError("; ".join(problems))


class Links:
    """The namespaces, bridge and veth links of one soak (see the module docstring)."""

    def __init__(self, node_ids: list[str]):
        self.node_ids = list(node_ids)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}b"
        self.subnet = ""  # SUBNET.X, once created
        self.has_netem: bool | None = None  # known after the first degrade
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), to delete

    @property
    def host(self) -> str:
        """The bridge's address: where masters and the other nodes listen."""
        return f"{self.subnet}.1"

    def namespace(self, node_id: str) -> str:
        return f"{self.tag}n{self.node_ids.index(node_id)}"

    def veth(self, node_id: str) -> str:
        return f"{self.tag}h{self.node_ids.index(node_id)}"

    def address(self, node_id: str) -> str:
        return f"{self.subnet}.{self.node_ids.index(node_id) + 2}"

    def placement(self, node_id: str) -> Placement:
        """How `up --local` starts the node: in its namespace, with its own /dev/shm."""
        prefix = (
            "ip",
            "netns",
            "exec",
            self.namespace(node_id),
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _SHM,
            "sh",
        )
        return Placement(prefix=prefix, address=self.address(node_id))

    def create(self) -> None:
        """Sweep stale soaks' names, then make the bridge and a namespace and link per
        node. Raises NetnsError (having deleted what it made) when any step fails."""
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root; run as root or pass --netns-nodes ''")
        sweep_stale()
        try:
            self.subnet = self._free_subnet()
            self._make("link", self.bridge, "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for node_id in self.node_ids:
                ns, veth = self.namespace(node_id), self.veth(node_id)
                self._make("netns", ns, "netns", "add", ns)
                self._make(
                    "link",
                    veth,
                    "link",
                    "add",
                    veth,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _run("ip", "link", "set", veth, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(node_id)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise

    def _make(self, kind: str, name: str, *cmd: str) -> None:
        _run("ip", *cmd)
        self._made.append((kind, name))

    def _free_subnet(self) -> str:
        used = _run("ip", "-4", "-o", "addr") + _run("ip", "-4", "route")
        for i in range(254):
            x = (os.getpid() + i) % 254 + 1
            if f"{SUBNET}.{x}." not in used:
                return f"{SUBNET}.{x}"
        raise NetnsError(f"no free /24 in {SUBNET}.0.0/16 for the soak's bridge")

    def degrade(self, node_id: str, spec: Degrade) -> str:
        """Shape both directions of the node's link; returns how (netem, or the fallback)."""
        ends = [("tc", "qdisc"), ("tc", "-n", self.namespace(node_id), "qdisc")]
        devs = [self.veth(node_id), "eth0"]
        if self.has_netem is not False:
            netem = [
                "netem",
                "delay",
                f"{spec.delay_ms}ms",
                f"{spec.jitter_ms}ms",
                "loss",
                f"{spec.loss_pct}%",
            ] + (["rate", spec.rate] if spec.rate else [])
            try:
                for tc, dev in zip(ends, devs, strict=True):
                    _run(*tc, "replace", "dev", dev, "root", *netem)
                self.has_netem = True
                return "tc netem " + " ".join(netem[1:])
            except NetnsError as e:
                if "unknown" not in str(e).lower():
                    raise
                self.has_netem = False
                log.warning("no tc netem in this kernel: loss by a BPF filter, no delay")
        threshold = min(2**32 - 1, round((1 - spec.loss_pct / 100) * 2**32))
        for tc, dev in zip(ends, devs, strict=True):
            _run(*tc, "replace", "dev", dev, "clsact")
            filt = [*tc[:-1], "filter", "add", "dev", dev, "egress", "bpf", "da"]
            _run(*filt, "bytecode", _DROP.format(threshold=threshold))
            if spec.rate:
                _run(
                    *tc,
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    spec.rate,
                    "burst",
                    "32kb",
                    "latency",
                    "400ms",
                )
        rate = f", tbf rate {spec.rate}" if spec.rate else ""
        return f"bpf drop {spec.loss_pct:g}%{rate} (no netem in this kernel: no delay)"

    def restore(self, node_id: str) -> None:
        """Undo `degrade` on the node's link (what is not there is skipped)."""
        for tc, dev in (
            (["tc"], self.veth(node_id)),
            (["tc", "-n", self.namespace(node_id)], "eth0"),
        ):
            for what in (["root"], ["clsact"]):
                subprocess.run(
                    [*tc, "qdisc", "del", "dev", dev, *what], capture_output=True, timeout=10
                )

    def delete(self) -> None:
        """Remove every namespace and link this soak made (idempotent)."""
        for kind, name in reversed(self._made):
            subprocess.run(["ip", kind, "del", name], capture_output=True, timeout=10)
        self._made.clear()

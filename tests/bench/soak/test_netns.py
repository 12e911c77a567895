"""The soak's network on a real kernel (root only): a process started with a node's
placement runs in its namespace, with its own /dev/shm, at its address behind the veth
link; a degraded link loses packets, a restored one does not; nothing is left after
`delete`, and `sweep_stale` removes what a dead soak left."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.bench.soak.netns import PREFIX, Degrade, Links, sweep_stale

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root and iproute2 (ip, tc) to create network namespaces",
    ),
]
NUM_PACKETS = 400
# in the node's namespace: count UDP datagrams until a quiet second, say whether the
# launcher's /dev/shm file is visible there
RECEIVER = """
import os, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: none lost to a full buffer
s.bind((sys.argv[1], 9999))
print(os.path.exists(sys.argv[2]), flush=True)
s.settimeout(1.0)
n = 0
try:
    while True:
        s.recv(64)
        n += 1
except TimeoutError:
    print(n, flush=True)
"""


def _names() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout + (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


@pytest.fixture
def links() -> Iterator[Links]:
    links = Links(["decode-0"])
    links.create()
    try:
        yield links
    finally:
        links.delete()
    assert links.tag not in _names()


def _received(links: Links, marker: Path) -> tuple[bool, int]:
    """(saw the marker file, datagrams received) for NUM_PACKETS sent from here."""
    addr = links.address("decode-0")
    cmd = [*links.placement("decode-0").prefix, sys.executable, "-c", RECEIVER, addr, str(marker)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    saw = proc.stdout.readline().strip() == "True"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(NUM_PACKETS):
            s.sendto(b"x", (addr, 9999))
    out, _ = proc.communicate(timeout=30)
    return saw, int(out.strip())


def test_a_placed_process_is_behind_its_link_and_a_degraded_link_loses_packets(
    links: Links,
) -> None:
    marker = Path("/dev/shm") / f"{links.tag}-marker"
    marker.write_bytes(b"")
    try:
        saw, clean = _received(links, marker)
        assert not saw  # NOTE: a /dev/shm of its own: its peers cannot map its segments
        assert clean == NUM_PACKETS
        how = links.degrade("decode-0", Degrade(delay_ms=1, jitter_ms=0, loss_pct=50))
        assert "50" in how
        _, lossy = _received(links, marker)
        assert NUM_PACKETS * 0.3 < lossy < NUM_PACKETS * 0.7, (how, lossy)
        links.restore("decode-0")
        assert _received(links, marker)[1] == NUM_PACKETS
    finally:
        marker.unlink()


def test_sweep_removes_only_what_dead_soaks_left() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{PREFIX}{dead.pid}b", f"{PREFIX}{os.getpid()}b"
    for name in (stale, live):
        subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        assert stale in sweep_stale()
        names = _names()
        assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "link", "del", name], capture_output=True)

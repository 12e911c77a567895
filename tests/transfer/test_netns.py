"""Two hosts in network namespaces joined by two veth pairs (two addresses each): slices
stripe over both paths, and when one link is cut the failed slices are retried on the other
path and the batch still completes with every byte in place. Needs root and `ip`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.netns]
ROOT = Path(__file__).resolve().parents[2]
SIZE = 4 << 20


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    """Namespaces (initiator, target) with 10.231.1.0/24 and 10.231.2.0/24 between them."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    ini, tgt = f"mci{tag}", f"mct{tag}"
    try:
        _ip("netns", "add", ini)
        _ip("netns", "add", tgt)
    except subprocess.CalledProcessError as e:
        subprocess.run(["ip", "netns", "del", ini], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    try:
        for ns in (ini, tgt):
            _ip("-n", ns, "link", "set", "lo", "up")
        for k in (0, 1):
            _ip(
                "link",
                "add",
                f"vi{k}",
                "netns",
                ini,
                "type",
                "veth",
                "peer",
                "name",
                f"vt{k}",
                "netns",
                tgt,
            )
            _ip("-n", ini, "addr", "add", f"10.231.{k + 1}.1/24", "dev", f"vi{k}")
            _ip("-n", tgt, "addr", "add", f"10.231.{k + 1}.2/24", "dev", f"vt{k}")
            _ip("-n", ini, "link", "set", f"vi{k}", "up")
            _ip("-n", tgt, "link", "set", f"vt{k}", "up")
        yield ini, tgt
    finally:
        for ns in (ini, tgt):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _node(ns: str, *args: str) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.transfer.netns_node", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_cut_path_is_retried_on_the_other_path_and_the_batch_completes(hosts) -> None:
    ini, tgt = hosts
    target = _node(tgt, "target", "vt0@10.231.1.2,vt1@10.231.2.2", str(SIZE))
    initiator = None
    try:
        ready = target.stdout.readline().split()  # type: ignore[union-attr]
        assert ready[0] == "ready", ready
        initiator = _node(ini, "initiator", "10.231.1.2", ready[1], str(SIZE))
        assert initiator.stdout.readline().strip() == "ready"  # type: ignore[union-attr]

        first = json.loads(_ask(initiator, "write 1"))
        assert first["states"] == ["done"] and first["retries"] == 0
        assert all(p[0] > 0 for p in first["paths"].values()), first  # both paths carried slices
        assert _ask(target, "digest") == first["digest"]

        _ip("-n", tgt, "link", "set", "vt1", "down")  # cut the 10.231.2.0/24 path
        second = json.loads(_ask(initiator, "write 2"))
        assert second["states"] == ["done"], second
        assert second["retries"] > 0, second
        cut = second["paths"]["tcp 10.231.2.2:" + ready[1]]
        assert cut[1] > 0, second  # the cut path failed slices ...
        assert _ask(target, "digest") == second["digest"]  # ... yet every byte landed
    finally:
        for proc in (initiator, target):
            if proc is not None:  # EOF on stdin: the node closes its engine (unlinks its shm)
                proc.stdin.close()  # type: ignore[union-attr]
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

"""A master and store nodes as real child processes (see procs.py), for client tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECRET = "store-test-secret-0123456789abcdef"


class Child:
    """One child process; `address` is what it printed after READY."""

    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "tests.store.procs", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["READY"]:
            self.stop()
            raise RuntimeError(f"child {args[:2]} did not start (said {line!r})")
        self.address = line[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Close stdin (a clean stop: the node unmounts), then wait."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_master(lease_ttl_s: float = 0.2, **config: float) -> Child:
    """A master; `config`: more MetadataConfig fields with float values (watermarks)."""
    return Child("master", SECRET, str(lease_ttl_s), *(f"{k}={v}" for k, v in config.items()))


def start_node(node_id: str, master: Child, dram_bytes: int, *ssd: str) -> Child:
    return Child("node", node_id, master.address, SECRET, str(dram_bytes), *ssd)

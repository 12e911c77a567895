"""What one journal transaction costs: our etcd client's CPU, etcd's CPU, and the wall time.

    python -m mooncake.bench.etcdtxn [--txns 1000] [--puts 1,4,16] [--json]

A one-member etcd on loopback with its data on /dev/shm and its auth on (as `up --local`
runs it, and `bench store` and `mooncake.bench.commits`); one thread sends `--txns`
transactions of `--puts` puts each, fenced on a leader key as the pool journal's are
(ha/journal.py: compare the leader key, then the puts; read the key back on failure), with
values the size of a sealed object entry. Per transaction: the wall time, this process's
CPU (the client: encoding, HTTP, decoding) and etcd's (from /proc), in microseconds.
Against a busy host the wall time grows with the run queue; the CPU figures hold.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

VALUE_BYTES = 160  # a sealed object entry with one replica (ha/sealed.py, poolstate.py)
LEADER, ME = "/bench/leader", b"this-master"


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(etcd: Any, etcd_pid: int, num_txns: int, num_puts: int) -> dict[str, float]:
    """Send `num_txns` fenced transactions of `num_puts` puts; their costs per transaction."""
    from mooncake.ha.etcd import Compare, Put

    fence, value = Compare.equals(LEADER, ME), bytes(VALUE_BYTES)
    keys = [f"/bench/pool/o/load-{i}-{time.monotonic_ns()}" for i in range(num_puts)]
    etcd.txn([fence], [Put(k, value) for k in keys], read=LEADER)  # connect, warm
    etcd0, ours0, wall0 = process_cpu_s(etcd_pid), time.process_time(), time.perf_counter()
    for i in range(num_txns):
        ok, _ = etcd.txn([fence], [Put(f"{k}-{i}", value) for k in keys], read=LEADER)
        assert ok, "the fence failed: another process wrote the leader key"
    wall = time.perf_counter() - wall0
    ours, theirs = time.process_time() - ours0, process_cpu_s(etcd_pid) - etcd0
    return {
        "puts": num_puts,
        "wall_us": round(wall / num_txns * 1e6),
        "client_cpu_us": round(ours / num_txns * 1e6),
        "etcd_cpu_us": round(theirs / num_txns * 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--txns", type=int, default=1000, help="transactions per row")
    parser.add_argument("--puts", default="1,4,16", help="puts per transaction, per row")
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = parser.parse_args()
    sizes = [int(n) for n in args.puts.split(",")]
    if args.txns < 1 or any(not 1 <= n <= 127 for n in sizes):
        parser.error("--txns must be >= 1 and each of --puts 1..127 (etcd's --max-txn-ops)")

    from mooncake.ha.etcd import Etcd
    from mooncake.ha.localetcd import LocalEtcd, tmpfs_data_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalEtcd(tmpfs_data_dir(Path(tmp) / "etcd"))
        server.start()
        try:
            assert server.proc is not None
            etcd = Etcd([server.url], timeout_s=5.0, access=server.access)
            etcd.put(LEADER, ME)
            rows = [measure(etcd, server.proc.pid, args.txns, n) for n in sizes]
            etcd.close()
        finally:
            server.stop()
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(
            f"puts={r['puts']:3d}  wall {r['wall_us']:6d} us/txn  client CPU "
            f"{r['client_cpu_us']:5d} us  etcd CPU {r['etcd_cpu_us']:5d} us"
        )


if __name__ == "__main__":
    main()

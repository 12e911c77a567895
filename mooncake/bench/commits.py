"""Commits per second of one Store master, file journal against etcd, from N clients.

    python -m mooncake.bench.commits --clients 1,8 --seconds 5 [--journals file,etcd] [--json]

(`--journals file-grouped` also writes the file journal in groups, off the lock;
`--window-ms` sets the groups' window.)

The master (a StoreService with a DRAM segment, no node behind it: only metadata moves) runs
in this process; each client is a process of its own that, over the master's direct
channel, repeats put_start then put_end of a small value under a key of its own: every
put_end is one commit, replied to once it is durable. Per journal it reports commits/s and
the put_end latency's p50/p99 (ms); with etcd, a one-member etcd on loopback with its data
on /dev/shm (as `up --local` runs it), the master fenced on a leader key as a leader is.
The groups the journal wrote are reported when the master groups (store/metadata/groupcommit.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

SECRET = b"commits-bench-secret-0123456789abcdef"
VALUE_BYTES = 64


def client(port: int, index: int, seconds: float, conn: Connection) -> None:
    """Commit puts for `seconds` after the parent says go; send (commits, latencies s)."""
    from mooncake.store.server import messages as m
    from mooncake.store.server.direct import DirectChannel

    channel = DirectChannel("127.0.0.1", port, SECRET, timeout_s=30.0)
    channel.call(m.ExistsMsg("warm"), m.KeyReplyMsg)  # connect before the clock starts
    conn.send("ready")
    conn.recv()
    latencies: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        key = f"c{index}-{i}"
        i += 1
        start = channel.call(m.PutStartMsg(key, VALUE_BYTES, f"client-{index}"), m.PutStartReplyMsg)
        assert start.result.status == "ok", start
        t0 = time.perf_counter()
        reply = channel.call(m.PutEndMsg(key), m.KeyReplyMsg)
        latencies.append(time.perf_counter() - t0)
        assert reply.result.status == "ok", reply
    conn.send(latencies)
    channel.close()


def measure(journal: Any, num_clients: int, seconds: float) -> dict[str, Any]:
    """Run the clients against a master journaling to `journal`; its figures."""
    from mooncake.store.metadata.settings import MetadataConfig
    from mooncake.store.server.service import StoreService

    cfg = MetadataConfig(replicas=1, lease_ttl_s=0.001)
    with StoreService(SECRET, cfg, journal=journal, tick_s=3600) as svc:
        with svc.lock:
            svc.metadata.mount_segment(
                "n", "n.dram", "dram", 1 << 30, time.monotonic(), "127.0.0.1:1", 64
            )
            svc.flush()
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for i in range(num_clients):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=client, args=(svc.direct_port, i, seconds, theirs))
            p.start()
            pipes.append(mine)
            procs.append(p)
        for pipe in pipes:
            assert pipe.recv() == "ready"
        commits = getattr(svc, "commits", None)
        groups0 = commits.num_groups if commits else 0
        t0 = time.monotonic()
        for pipe in pipes:
            pipe.send("go")
        lat = [x for pipe in pipes for x in pipe.recv()]
        wall = time.monotonic() - t0
        for p in procs:
            p.join()
        groups = (commits.num_groups - groups0) if commits else 0
    lat.sort()
    return {
        "commits": len(lat),
        "commits_per_s": len(lat) / wall,
        "p50_ms": 1e3 * statistics.median(lat) if lat else 0.0,
        "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
        "groups": groups,
        "entries_per_group": len(lat) / groups if groups else 0.0,
    }


def etcd_journal(etcd: Any, prefix: str) -> Any:
    from mooncake.ha.etcd import Compare, Put
    from mooncake.ha.journal import EtcdJournal
    from mooncake.ha.sealed import Sealer

    sealer = Sealer(SECRET)
    key, value = f"{prefix}/leader", b"this-master"
    ok, _ = etcd.txn([Compare.absent(key)], [Put(key, value)])
    assert ok, "a leader key already exists"
    return EtcdJournal(etcd, prefix, key, value, sealer, lambda current: False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=str, default="1,8", help="comma-separated counts")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--journals", type=str, default="file,etcd")
    parser.add_argument("--window-ms", type=float, default=-1, help="-1: the journal's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from mooncake.ha.etcd import Etcd
    from mooncake.ha.localetcd import LocalEtcd, tmpfs_data_dir
    from mooncake.store.metadata.journal import FileJournal

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalEtcd(tmpfs_data_dir(Path(tmp) / "etcd"))
        server.start()
        etcd = Etcd([server.url], timeout_s=5.0, access=server.access)
        try:
            for n in [int(x) for x in args.clients.split(",")]:
                for kind in args.journals.split(","):
                    run = f"{kind}-{n}-{time.monotonic_ns()}"
                    journal = (
                        FileJournal(Path(tmp) / f"{run}.journal")
                        if kind.startswith("file")
                        else etcd_journal(etcd, f"/bench/{run}")
                    )
                    if kind == "file-grouped":  # NOTE: the file journal written in groups
                        journal.is_grouped = True
                    if args.window_ms >= 0:
                        journal.group_window_s = args.window_ms / 1e3
                    figures = measure(journal, n, args.seconds)
                    results.append({"journal": kind, "clients": n, **figures})
                    if not args.json:
                        print(
                            f"{kind:12} clients={n:3} commits/s={figures['commits_per_s']:8.0f} "
                            f"p50={figures['p50_ms']:6.2f} ms p99={figures['p99_ms']:6.2f} ms "
                            f"entries/group={figures['entries_per_group']:5.1f}",
                            flush=True,
                        )
        finally:
            etcd.close()
            server.stop()
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

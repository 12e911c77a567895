"""A node for the network-namespace test, run as `python -m tests.transfer.netns_node ROLE`
inside `ip netns exec`. It talks to the test over stdin/stdout, one line each way:

    target NIC@IP,... SIZE    prints "ready PORT"; then "digest" -> sha256 of the segment
    initiator HOST PORT SIZE  prints "ready"; each "write SEED" writes pattern SEED over the
                              target's segment and prints a JSON report of the batch
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from mooncake.transfer import (
    EndpointDesc,
    EngineOptions,
    TransferEngine,
    TransferOp,
    TransferRequest,
)

SECRET = b"netns-test-secret-0123456789abcdef"


def pattern(size: int, seed: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) * 7 + seed) % 253).astype(np.uint8)


def target(endpoints: str, size: int) -> None:
    eps = [e.split("@") for e in endpoints.split(",")]  # nic@ip
    engine = TransferEngine("netns-target", SECRET, host="0.0.0.0")
    engine.endpoints = [EndpointDesc(nic, ip, engine.server.port) for nic, ip in eps]
    pool = engine.allocate("pool", size)
    print("ready", engine.server.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(hashlib.sha256(pool.tobytes()).hexdigest(), flush=True)
    engine.close()


def initiator(host: str, port: int, size: int) -> None:
    opts = EngineOptions(
        protocol="tcp",
        slice_bytes=64 << 10,
        connections_per_peer=2,
        retry_budget=3,
        timeout_s=15.0,
        io_timeout_s=1.0,
    )
    engine = TransferEngine("netns-initiator", SECRET, opts, host="0.0.0.0")
    src = np.zeros(size, np.uint8)
    engine.register("src", src)
    remote = f"pool@{host}:{port}"
    print("ready", flush=True)
    for line in sys.stdin:
        src[:] = pattern(size, int(line.split()[1]))
        retries = engine.num_retries
        batch = engine.submit([TransferRequest(TransferOp.WRITE, "src", 0, remote, 0, size)])
        states = [s.state.value for s in batch.wait()]
        paths = engine.resolve(remote).pathsets["cpu:0"].paths
        report = {
            "states": states,
            "retries": engine.num_retries - retries,
            "digest": hashlib.sha256(src.tobytes()).hexdigest(),
            "paths": {p.key: [p.num_slices, p.num_failures, p.is_paused()] for p in paths},
        }
        print(json.dumps(report), flush=True)
    engine.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "target":
        target(args[0], int(args[1]))
    else:
        initiator(args[0], int(args[1]), int(args[2]))

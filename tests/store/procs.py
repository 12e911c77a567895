"""Child processes for store tests: a master (StoreService) or a store node (StoreNode).

    python -m tests.store.procs master SECRET [LEASE_TTL_S [FIELD=VALUE ...]]
    python -m tests.store.procs node NODE_ID MASTER_ADDRESS SECRET DRAM_BYTES [SSD_DIR SSD_BYTES]

Each prints "READY <address>" on stdout once serving, then runs until stdin closes.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    if argv[0] == "master":
        from mooncake.store.metadata.settings import MetadataConfig
        from mooncake.store.server.service import StoreService

        lease_ttl_s = float(argv[2]) if len(argv) > 2 else 0.2
        more = {k: float(v) for k, _, v in (a.partition("=") for a in argv[3:])}  # watermarks
        fields = {"heartbeat_ttl_s": 1.0, "lease_ttl_s": lease_ttl_s, **more}
        cfg = MetadataConfig(**fields)  # type: ignore[arg-type]
        with StoreService(argv[1], cfg) as service:
            print("READY", service.address, flush=True)
            sys.stdin.read()
        return
    from mooncake.store.node.node import StoreNode, TierSizes

    node_id, master, secret, dram = argv[1], argv[2], argv[3], int(argv[4])
    ssd_path, ssd_bytes = (argv[5], int(argv[6])) if len(argv) > 6 else ("", 0)
    sizes = TierSizes(dram_bytes=dram, ssd_bytes=ssd_bytes, ssd_path=ssd_path)
    node = StoreNode(node_id, master, secret, sizes, heartbeat_s=0.2)
    node.start()
    print("READY", node.endpoint, flush=True)
    try:
        sys.stdin.read()
    finally:
        node.stop()


if __name__ == "__main__":
    main(sys.argv[1:])

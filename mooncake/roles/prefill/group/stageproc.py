"""A later pipeline stage as a process: builds its layers, serves one upstream link.

The ready handshake is one JSON line on stdout, printed once the port is bound; the
secret comes from the environment, never argv (other users can read argv):

    MOONCAKE_STAGE_SECRET=... python -m mooncake.roles.prefill.group.stageproc \\
        --model dummy:tiny --layers 2:4 --listen 127.0.0.1:0 [--next HOST:PORT]
    -> {"ready": true, "port": 43121}

With `--stream` the stage's KV cache lives in Transfer Engine segments and the stage
writes its layers' KV where each prompt's plan (a DEST frame) says, as a prefill node's
later stage does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from mooncake.kv.handoff import place_cache_in_segments
from mooncake.kv.stream import KVStreamer, StreamPlan, StreamWriter
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner, PrefillState
from mooncake.roles.prefill.group.link import TcpStageLink
from mooncake.roles.prefill.group.listener import StageListener
from mooncake.roles.prefill.group.stage import StageServer
from mooncake.transfer import TransferEngine

log = logging.getLogger(__name__)


def _parse_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """Serve one pipeline stage; prints a JSON ready line with the bound port."""
    from mooncake.model.info import load_model_info, resolve_dtype
    from mooncake.model.weights import create_model

    p = argparse.ArgumentParser(
        prog="python -m mooncake.roles.prefill.group.stageproc", description=__doc__
    )
    p.add_argument("--model", default="dummy:tiny", help="dummy:NAME or an HF directory")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--layers", required=True, help="layer range START:END this stage owns")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=64, help="KV cache blocks")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept upstream on")
    p.add_argument("--next", default="", help="HOST:PORT of the next stage (not on the last)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--stream", action="store_true", help="stream KV as plans say (kvstream)")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOONCAKE_LOG_LEVEL", "WARNING").upper())
    torch.set_num_threads(args.threads)
    secret = os.environ.get("MOONCAKE_STAGE_SECRET", "").encode()
    first, end = (int(x) for x in args.layers.split(":"))
    info = load_model_info(args.model)
    dtype = resolve_dtype(info, args.dtype, "cpu")
    model = create_model(info, dtype, "cpu", (first, end))
    cache = PagedKVCache.for_model(model, args.num_blocks, args.block_tokens)
    runner = PrefillRunner(model, cache)
    listener = StageListener(secret, *_parse_hostport(args.listen))
    streamer, engine, writer = None, None, None
    if args.stream:
        engine = TransferEngine(f"stage-{listener.port}", secret)
        place_cache_in_segments(engine, cache, "stage.kv.")
        writer = StreamWriter()

        def streamer(st: PrefillState, plan: StreamPlan) -> KVStreamer:
            assert engine is not None and writer is not None
            return KVStreamer(
                engine, cache, "stage.kv.", st.block_ids, plan, runner.layout, writer, 30.0
            )

    print(json.dumps({"ready": True, "port": listener.port}), flush=True)
    upstream = listener.accept()  # NOTE: peers without the secret are refused (and logged)
    downstream = TcpStageLink.connect(*_parse_hostport(args.next), secret) if args.next else None
    StageServer(runner, upstream, downstream, streamer).serve()
    listener.close()
    if writer is not None and engine is not None:
        writer.close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

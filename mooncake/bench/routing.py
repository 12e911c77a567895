"""`bench router`'s run: the master routing across vLLM instances, against round robin.

    vLLM instances  started once, each pinned to its own CPUs, publishing KV events
    for each policy (round_robin, kvcache_centric):
        reset every instance's prefix cache (vLLM's /reset_prefix_cache)
        start `mooncake up --role master` with [router] backends = the instances
        replay the slice through it; stop it
        hit rate = vLLM's own prefix cache hits / queries (tokens, /metrics) over the run

The instances are the same for every policy, so the figures differ only by where each
request went. vLLM's /reset_prefix_cache is a development endpoint: the instances run
with VLLM_SERVER_DEV_MODE=1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec

from mooncake.bench.servers import LaunchedServer, ServerSpec, ServerStartError, mooncake_argv
from mooncake.bench.versus import VersusPlan, server_spec
from mooncake.local.launcher import free_port
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.runner import ReplayConfig, replay
from mooncake.sim.trace import TraceRecord

COMPARED = ("round_robin", "kvcache_centric")
# (plan, index, run dir, block tokens) -> how to start instance i, publishing KV events
InstanceSpec = Callable[["RoutingPlan", int, Path, int], ServerSpec]
_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\}\s+([0-9.eE+]+)$", re.M)


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    versus: VersusPlan  # the checkpoint, vLLM's python, KV space, args, timeouts
    num_instances: int = 2
    policies: tuple[str, ...] = COMPARED
    speed: float = 1.0
    max_model_len: int = 2048


class PolicyRow(msgspec.Struct, kw_only=True):
    policy: str
    hit_rate: float  # vLLM prefix cache hit tokens / queried tokens, all instances
    hit_tokens: int
    query_tokens: int
    completed: int
    failed: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    per_instance: list[int]  # requests each instance answered (its /metrics)


class RoutingResult(msgspec.Struct, kw_only=True):
    model: str
    requests: int
    instances: int
    block_tokens: int
    speed: float
    rows: list[PolicyRow]
    logs: dict[str, str]


def vllm_instance(plan: RoutingPlan, i: int, run_dir: Path, block_tokens: int) -> ServerSpec:
    """vLLM instance i: on CPU i (mod the CPUs given), publishing its KV events on free
    ports (events, replay)."""
    v = plan.versus
    cpus = sorted(v.cpus or os.sched_getaffinity(0))
    events, replay_port = free_port(), free_port()
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    # NOTE: eager (compilation mode 0): vLLM's CPU compile takes minutes per start-up
    args = (
        "--kv-events-config",
        json.dumps(kv_events),
        "--max-model-len",
        str(plan.max_model_len),
        "--compilation-config",
        '{"mode": 0}',
    )
    mine = dataclasses.replace(
        v, cpus=frozenset({cpus[i % len(cpus)]}), vllm_args=v.vllm_args + args
    )
    spec = server_spec(mine, "vllm", run_dir, block_tokens)
    env = {**spec.env, "VLLM_SERVER_DEV_MODE": "1"}
    return dataclasses.replace(spec, name=f"vllm-{i}", env=env)


def events_of(spec: ServerSpec) -> tuple[str, str]:
    """The (events, replay) endpoints a `vllm_instance` spec publishes on."""
    cfg = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
    return cfg["endpoint"], cfg["replay_endpoint"]


def router_spec(
    plan: RoutingPlan, policy: str, instances: list[ServerSpec], run_dir: Path, block_tokens: int
) -> ServerSpec:
    """`mooncake up --role master` routing across `instances` by `policy`."""
    port = free_port()
    lines = [
        "[cluster]",
        'name = "router"',
        f'master = "127.0.0.1:{free_port()}"',
        f'secret = "{secrets.token_urlsafe(24)}"',
        "[model]",
        f"path = {json.dumps(plan.versus.model)}",
        f"block_tokens = {block_tokens}",
        f"max_model_len = {plan.max_model_len}",
        "[api]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "[scheduler]",
        f'policy = "{policy}"',
        "[metrics]",
        "enabled = false",
    ]
    entries = [" ".join((spec.url, *events_of(spec))) for spec in instances]
    lines += ["[router]", f"backends = {json.dumps(entries)}"]
    path = run_dir / f"router-{policy}.toml"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    argv = mooncake_argv("up", "--role", "master", "--config", str(path))
    return ServerSpec(f"router-{policy}", argv, f"http://127.0.0.1:{port}", start_timeout_s=120)


def cache_counters(url: str) -> tuple[int, int, int]:
    """(prefix cache hit tokens, queried tokens, finished requests) from a vLLM /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    got = {"hits": 0.0, "queries": 0.0}
    for kind, value in _COUNTER.findall(text):
        got[kind] += float(value)
    done = sum(
        float(v)
        for v in re.findall(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+]+)$", text, re.M)
    )
    return int(got["hits"]), int(got["queries"]), int(done)


def run_routing(
    plan: RoutingPlan,
    records: list[TraceRecord],
    prompts: PromptConfig,
    on_progress: Callable[[str], None] = lambda _: None,
    instance_spec: InstanceSpec | None = None,  # default: vllm_instance
) -> RoutingResult:
    """Start the instances, replay the slice through a router per policy; compare."""
    instance_spec = instance_spec or vllm_instance
    v = plan.versus
    prompts = dataclasses.replace(prompts, vocab_size=v.vocab_size)
    prompts.validate()
    run_dir = v.work_dir / "runs" / f"router-{int(time.time())}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    bt = prompts.block_tokens
    specs = [instance_spec(plan, i, run_dir, bt) for i in range(plan.num_instances)]
    logs = {s.name: str(run_dir / f"{s.name}.log") for s in specs}
    rows = []
    with ExitStack() as stack:
        for s in specs:  # NOTE: one at a time: two vLLM start-ups at once starve each other
            on_progress(f"starting {s.name} (log: {logs[s.name]})")
            stack.enter_context(LaunchedServer(s, Path(logs[s.name])))
        for policy in plan.policies:
            for s in specs:
                r = httpx.post(s.url + "/reset_prefix_cache", timeout=30)
                if r.status_code != 200:
                    raise ServerStartError(
                        f"{s.name}: /reset_prefix_cache answered {r.status_code}"
                    )
            before = [cache_counters(s.url) for s in specs]
            router = router_spec(plan, policy, specs, run_dir, bt)
            logs[router.name] = str(run_dir / f"{router.name}.log")
            on_progress(f"{policy}: replaying {len(records)} requests through the router")
            with LaunchedServer(router, Path(logs[router.name])):
                cfg = ReplayConfig(
                    url=router.url,
                    vocab_size=v.vocab_size,
                    speed=plan.speed,
                    ttft_slo_s=v.ttft_slo_s,
                    tbt_slo_s=v.tbt_slo_s,
                )
                report = replay(records, prompts, cfg)
            after = [cache_counters(s.url) for s in specs]
            hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            rows.append(
                PolicyRow(
                    policy=policy,
                    hit_rate=hits / queries if queries else 0.0,
                    hit_tokens=hits,
                    query_tokens=queries,
                    completed=report.completed,
                    failed=report.failed,
                    ttft_p50_s=report.ttft_p50_s,
                    ttft_p90_s=report.ttft_p90_s,
                    per_instance=[a[2] - b[2] for a, b in zip(after, before, strict=True)],
                )
            )
    return RoutingResult(
        model=v.model,
        requests=len(records),
        instances=plan.num_instances,
        block_tokens=bt,
        speed=plan.speed,
        rows=rows,
        logs=logs,
    )
